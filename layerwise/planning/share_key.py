"""share_key: what makes two processes' shared host arenas the same (docs/share-host.md).

Two processes may stream from one arena only if every byte one of them would
have packed is the byte the other did pack, at the same offset. The key of a
group's arena is a digest of:

- its layout: the group's path, every layer's size and every parameter's
  name, dtype, shape, strides, offset and span (routed experts' tails and
  quantized wrappers' leaves included: they are entries of the plan);
- the options that change the bytes or where they go: `compress` (encoded
  payloads) and, with it, which layers are resident (a resident layer is
  packed raw), `host_budget` as given and whether a `spill_dir` is set;
- the layout and format versions of this library (an arena packed by another
  version is never read);
- the weights' identity: for `load_offloaded`, the checkpoint files as they
  are now (path, device, inode, size, modification time, a digest of their
  headers) and the dtype asked for; for an in-memory model, a checksum of
  every streamed parameter's bytes; or a string the caller gives (it asserts
  that every process giving it streams the same weights).

Left out on purpose: the device, the prefetch depth, pinning and (without
`compress`) residency: processes that differ only there share one arena.
"""
from __future__ import annotations

import hashlib
import json
import os
import zlib

import torch

from layerwise.planning.layout import BLOCK_ALIGN, PARAM_ALIGN

FORMAT = 1  # bumped when what an arena holds, or how, changes
CHECKPOINT = "checkpoint:"  # the prefix of an identity made from checkpoint files (checkpoint_identity)


def layout_of(plan) -> list:
    """The group's layout as plain data (the key's part that a manifest repeats)."""
    return [[lp.nbytes, lp.base_bytes,
             [[e.qualname, str(e.dtype), list(e.shape), list(e.stride), e.offset, e.span_bytes,
               list(e.leaf) if e.leaf is not None else None] for e in lp.params]]
            for lp in plan.layers]


def share_key(plan, options, identity: str, resident=()) -> tuple[bytes, str]:
    """(digest, name) of a group's shared arena: the sha256 of the module doc's
    parts, and the first 32 hex digits of it (the rendezvous name)."""
    from layerwise import __version__

    parts = {
        "format": FORMAT,
        "layerwise": __version__,
        "align": [BLOCK_ALIGN, PARAM_ALIGN],
        "group": plan.path,
        "layout": layout_of(plan),
        "compress": options.compress,
        "resident": sorted(resident) if options.compress is not None else None,
        "host_budget": options.host_budget,
        "spill": options.spill_dir is not None,
        "experts": options.experts,
        "identity": identity,
    }
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).digest()
    return digest, digest.hex()[:32]


def checkpoint_identity(files, dtype) -> str:
    """The identity of a checkpoint's weights as `load_offloaded` reads them: each
    file's real path, device, inode, size and modification time and a digest of
    its header (the tensors' names, dtypes, shapes and offsets), and the dtype asked
    for. A file rewritten in place changes its modification time (and usually its
    header): processes that loaded it before and after never share."""
    h = hashlib.sha256()
    for path in files:
        real = os.path.realpath(path)
        st = os.stat(real)
        with open(real, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else 0
            header = f.read(min(n, 100 << 20))
        h.update(json.dumps([real, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]).encode())
        h.update(hashlib.sha256(header).digest())
    h.update(str(dtype).encode())
    return CHECKPOINT + h.hexdigest()


def content_identity(plan) -> str:
    """The identity of an in-memory model's streamed weights: a CRC-32 of every
    parameter's storage span (the bytes the arena would hold), folded into one
    sha256. One read of the group's weights."""
    h = hashlib.sha256()
    for lp in plan.layers:
        for e in lp.params:
            data = e.source()
            if data.is_meta:
                raise ValueError(f"share_host=True: parameter {e.qualname!r} is on the meta device, so its bytes "
                                 "cannot identify the weights; load the model with layerwise.load_offloaded(..., "
                                 "share_host=True), or give share_host a key string")
            flat = torch.as_strided(data.detach(), (e.span,), (1,), data.storage_offset())
            raw = flat.cpu().contiguous().view(torch.uint8)
            h.update(zlib.crc32(raw.numpy().data).to_bytes(4, "little"))
            h.update(e.span_bytes.to_bytes(8, "little"))
    return "content:" + h.hexdigest()
