"""load_offloaded: build an offloaded model straight from .safetensors files.

The model is built without weights (on the meta device, e.g. with
accelerate.init_empty_weights or `with torch.device("meta"):`). Layer tensors
are read from the files straight into their place in the host arena (plain
positioned reads into the arena's pages: no intermediate host copy and no
file mapping that would count against the process), non-layer tensors go
straight to the device, and the multi-group order of configure holds: every
group packed, largest first, then one model.to, then finalisation.

Weights the model declares tied are tied first (one checkpoint name fills
them all), buffers left on meta that no checkpoint holds are recomputed from
the config of the module that owns them (layerwise.empty_model builds a model
whose buffers need no recomputing), and `dtype=` casts floating-point tensors
while reading, as `model.to(dtype)` would.

A quantized model (torchao, optimum-quanto: quantized on meta the way the
checkpoint was) is read as its wrappers' inner tensors, each from a key of its
own (layerwise.formats.quantized.checkpoint_leaf_keys: torchao's safetensors
layout with each wrapper's form in the metadata, or a state dict whose keys are
the inner tensors' own), the form checked first; a checkpoint that cannot fill
the model's wrappers exactly is refused naming the parameter and its library.

Everything (keys, shapes, dtypes, buffers the checkpoint cannot supply) is
checked before the model changes; a failure half way puts it back.

The file format is layerwise.formats.safetensors (headers, index, positioned
reads), models built without weights are layerwise.empty; this module is the
orchestration, plus the disk tier's checkpoint store and the split-fetch share
reads that load_offloaded sets up.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os

import torch
from torch import nn

from layerwise import contract, stages
from layerwise.configure import build_groups, prepare_groups
from layerwise.empty import (
    dtype_at_load,
    from_pretrained_rule,
    recompute_buffers,
    retype,
    tie_declared,
    warn_unlike_from_pretrained,
)
from layerwise.formats import quantized
from layerwise.formats import safetensors as sft
from layerwise.formats.safetensors import PageCacheDrop, Stored, bytes_of, checkpoint_files, read_header
from layerwise.options import OffloadOptions, named_options
from layerwise.planning import share_key
from layerwise.planning.device_budget import record_host_budget
from layerwise.planning.host_budget import plan_host_budget

log = logging.getLogger("layerwise")

def _names(items, what: str) -> str:
    items = list(items)
    more = f" (and {len(items) - 8} more)" if len(items) > 8 else ""
    return f"{what} {len(items)} tensor(s): {', '.join(items[:8])}{more}"


# ------------------------------------------------------------ empty models
def _parameter_entries(model: nn.Module):
    """[(module, attr, parameter)] for every registration of a parameter."""
    return [(mod, attr, p) for mod in model.modules(remove_duplicate=False)
            for attr, p in mod._parameters.items() if p is not None]


# ------------------------------------------------------------ load_offloaded
# The options' defaults are OffloadOptions' fields, repeated for help() and IDEs (layerwise/options.py says why).
def load_offloaded(model: nn.Module, checkpoint, layer_names, device=None, prefetch_depth: int = 1,
                   resident_layers=0, residency_policy: str = "leading", pin_memory: bool | str = "auto",
                   device_budget=None, budget_margin=None, strict: bool = True, dtype: torch.dtype | None = None,
                   host_budget=None, spill_dir=None, disk_prefetch_depth: int | None = None,
                   share_host: bool | str = False, **kwargs):
    """Load `checkpoint` (a .safetensors file, a list of them, or an index JSON)
    into `model` (built on the meta device) and stream `layer_names` to `device`.
    Returns the managers, as configure_layerwise_offload does.

    Weights the model declares tied are tied first (one checkpoint name fills them
    all); non-persistent buffers left on meta are recomputed from the config of the
    module that owns them. `dtype` (a floating-point dtype) casts every floating-point
    parameter and buffer to it while reading, as `model.to(dtype)` would; without it
    the checkpoint's dtypes must be the model's. For a model that declares modules to
    keep in fp32 (`_keep_in_fp32_modules`: diffusers' Wan, transformers' T5), `dtype=`
    gives it what `from_pretrained(path, dtype)` gives it instead: those modules'
    tensors in fp32 by its library's rule (empty.from_pretrained_rule), the rest of the
    checkpoint in `dtype`, and the buffers the model computes as a fresh build computes them.

    `host_budget` (bytes, or "auto") caps the host memory the weights take: the
    layers that do not fit stay in the checkpoint files and stream disk ->
    pinned staging -> device at every step (layerwise/stages/disk/). Such
    layers are read-only (load_state_dict into them is refused) unless
    `spill_dir` is given: they are then copied into spill files of their own,
    which is also how layers stored in another dtype (`dtype=`) or strided
    parameters reach the disk tier.
    `compress`, `num_copy_streams`, `debug_copy_delay_us`, `debug_read_delay_us`,
    `measure_stalls`: as in configure_layerwise_offload (every option is
    validated once, into a layerwise.options.OffloadOptions).
    `split_fetch=<ProcessGroup>`: every rank of the group loads the same model
    this way and reads only its share of each streamed layer from the files
    (contiguous parameters; a strided one is read whole), so the node reads and
    holds the streamed layers about once (layerwise/stages/split/).
    `share_host=True`: every process on the machine that loads the same files
    (the same path, inode, size and modification time, and header) with the same
    layout maps one shared arena of the streamed layers instead of holding its
    own copy (docs/share-host.md); a key string asserts the weights' identity
    instead of the files'.
    """
    options = OffloadOptions.build(caller="load_offloaded", **named_options(locals()), **kwargs)
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating-point torch.dtype (torch.bfloat16, torch.float16, "
                        f"torch.float32, ...), got {dtype!r}")
    if not isinstance(strict, bool):
        raise TypeError(f"strict must be True (a checkpoint tensor the model does not have is an error) or False "
                        f"(such tensors are ignored), got {strict!r}")
    files = checkpoint_files(checkpoint)
    stored: dict[str, Stored] = {}
    for path in files:
        for key, s in read_header(path).items():
            if key in stored:
                raise ValueError(f"checkpoint: tensor {key!r} is in both {stored[key].path} and {path}")
            stored[key] = s

    if options.share_host is True:  # the weights' identity: these files, as they are now, read as asked
        options = dataclasses.replace(options, share_host=share_key.checkpoint_identity(files, dtype))
    managers = prepare_groups(model, layer_names, options)  # (a configured model, bad paths) before anything changes
    keep = None  # what from_pretrained keeps in fp32; None: dtype= is model.to(dtype)
    if dtype is not None:
        for name, p in model.named_parameters():
            if quantized.is_wrapper(p) and p.dtype != dtype:
                raise ValueError(
                    f"load_offloaded: dtype={dtype} would cast parameter {name!r}, a {quantized.library_type(p)} "
                    f"(a quantized wrapper tensor computing in {p.dtype}); its inner tensors keep the dtypes they "
                    f"are stored in. Quantize the meta model in {dtype} (or load without dtype=). The model is "
                    "unchanged.")
        keep = from_pretrained_rule(model, dtype)
        if keep is None:
            warn_unlike_from_pretrained(model, dtype)
    # Ties and dtype change which parameter objects the model holds (and so the
    # plan): done now, put back if anything later fails.
    registered = _parameter_entries(model)
    try:
        changed = tie_declared(model)
        if dtype is not None:
            changed = retype(model, dtype, keep) or changed
        if changed:
            managers = prepare_groups(model, layer_names, options)
        forms = quantized.checkpoint_forms(sft.read_metadata(path) for path in files)
        return _load(model, managers, options, files, stored, strict, dtype, forms, keep)
    except BaseException:
        if not contract.managers_of(model):  # (a Ctrl-C delivered once the model was whole keeps it)
            for mod, attr, p in registered:
                mod._parameters[attr] = p
        raise


def _load(model, managers, options: OffloadOptions, files, stored, strict, dtype, forms, keep=None):
    """`forms`: the quantized wrappers' forms the checkpoint records (formats/quantized.checkpoint_forms);
    `keep`: what from_pretrained(dtype=) keeps in fp32 (empty.from_pretrained_rule), None: dtype= is model.to."""
    dev = options.device
    cast = dtype_at_load(dtype, keep) if dtype is not None else None
    # from_pretrained never casts a buffer the model computes (non-persistent): with a
    # `keep` rule such a buffer stays as a fresh build computes it.
    as_computed = keep is not None

    def want(t: torch.Tensor, name: str) -> torch.dtype:
        return cast(t, [name]) if cast is not None else t.dtype

    # Every name of every parameter and buffer, and where it sits.
    param_names: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        for attr, p in mod._parameters.items():
            if p is None:
                continue
            full = f"{mod_name}.{attr}" if mod_name else attr
            param_names.setdefault(id(p), []).append(full)
            params[id(p)] = p
            places.setdefault(id(p), [])
            if (mod, attr) not in places[id(p)]:
                places[id(p)].append((mod, attr))
    buffers = []  # (module, attr, full name, persistent)
    for mod_name, mod in model.named_modules():
        for attr, b in mod._buffers.items():
            if b is not None:
                full = f"{mod_name}.{attr}" if mod_name else attr
                buffers.append((mod, attr, full, attr not in mod._non_persistent_buffers_set))

    def source_key(names):
        return next((n for n in names if n in stored), None)

    # ---- check everything before anything changes
    # A quantized wrapper parameter is read as its inner tensors, each from a key of its own.
    wrapped = {pid: quantized.structure(p) for pid, p in params.items() if quantized.is_wrapper(p)}
    leaf_keys = {pid: quantized.checkpoint_leaf_keys(param_names[pid][0], params[pid], form, stored, forms)
                 for pid, form in wrapped.items()}
    missing = [names[0] for pid, names in param_names.items() if pid not in wrapped and source_key(names) is None]
    missing += [full for _, _, full, persistent in buffers if persistent and full not in stored]
    # A non-persistent buffer is not part of a state dict (torch's load_state_dict calls it
    # unexpected): its value is computed by the model, never taken from a checkpoint.
    known = {n for names in param_names.values() for n in names} | {full for _, _, full, p in buffers if p}
    known |= {k for keys in leaf_keys.values() for k in keys.values()}
    unexpected = sorted(k for k in stored if k not in known)
    if missing or (strict and unexpected):
        problems = ([_names(missing, "missing")] if missing else []) + \
                   ([_names(unexpected, "unexpected")] if strict and unexpected else [])
        hint = " (strict=False ignores unexpected tensors)" if strict and unexpected and not missing else ""
        raise KeyError(f"checkpoint does not match the model: {'; '.join(problems)}{hint}")

    def check(name, s: Stored, shape, expected: torch.dtype):
        if not isinstance(s.dtype, torch.dtype):
            raise TypeError(f"checkpoint tensor {name!r} has dtype {s.dtype}, which layerwise cannot read")
        castable = dtype is not None and expected.is_floating_point and s.dtype.is_floating_point
        if tuple(shape) != s.shape or (expected != s.dtype and not castable):
            hint = ""
            if tuple(shape) == s.shape and expected.is_floating_point and s.dtype.is_floating_point:
                hint = (f": pass dtype={expected} to load_offloaded to cast it while reading (or "
                        f"dtype={s.dtype} to run the model in the checkpoint's dtype)")
            raise ValueError(f"checkpoint tensor {name!r} is {s.dtype}{list(s.shape)} but the model expects "
                             f"{expected}{list(shape)}{hint}")
        if s.nbytes != s.dtype.itemsize * int(torch.Size(s.shape).numel()):
            raise ValueError(f"checkpoint tensor {name!r}: {s.nbytes} bytes stored for shape {list(s.shape)}")

    for pid, names in param_names.items():
        if pid in wrapped:  # (its leaves: checked by checkpoint_leaf_keys)
            continue
        key = source_key(names)
        check(key, stored[key], params[pid].shape, params[pid].dtype)
        present = [n for n in names if n in stored]
        if len(present) > 1:  # one tensor under two names (tied): the checkpoint must agree with itself
            _same_values(stored, present)

    meta_buffers, cast_down = {}, {}
    for mod, attr, full, persistent in buffers:
        b = mod._buffers[attr]
        if persistent and full in stored:
            check(full, stored[full], b.shape, want(b, full))
        elif b.is_meta:
            meta_buffers[full] = b
        elif as_computed and b.is_floating_point() and b.element_size() < 4:
            cast_down[full] = b
    recomputed = {}
    if cast_down:
        # A computed buffer in less than fp32 was cast before loading (model.to(dtype) on a model
        # built under accelerate.init_empty_weights): from_pretrained has it as computed.
        recomputed, why = recompute_buffers(model, cast_down, as_computed=True)
        recomputed = {n: v for n, v in recomputed.items() if v[0].dtype != cast_down[n].dtype}
        for full, reason in why.items():
            log.warning("layerwise: load_offloaded(dtype=%s): buffer %r holds values cast to %s before loading, "
                        "where from_pretrained(dtype=%s) holds them as the model computes them, and layerwise "
                        "cannot recompute them (%s): build the model without .to(dtype) and let dtype= cast it",
                        dtype, full, cast_down[full].dtype, dtype, reason)
    if meta_buffers:
        more, why = recompute_buffers(model, meta_buffers, as_computed=as_computed)
        recomputed.update(more)
        if why:
            full, reason = next(iter(why.items()))
            others = [n for n in why if n != full]
            raise ValueError(
                f"buffer {full!r} is on the meta device and not in the checkpoint, and layerwise cannot recompute "
                f"it ({reason})" + (f"; so are {', '.join(others[:8])}" if others else "") + ". Build the model "
                f"with its buffers computed and only its parameters on meta: `model = layerwise.empty_model("
                f"{type(model).__name__}, ...)` (or under accelerate.init_empty_weights()), not under "
                "`torch.device('meta')`")
    if recomputed:
        log.info("layerwise: recomputed %d buffer(s) the checkpoint does not hold: %s", len(recomputed),
                 ", ".join(f"{n} (from {what})" for n, (_, what) in recomputed.items()))

    if options.device_budget is not None:
        from layerwise.planning.device_budget import apply_device_budget

        apply_device_budget(model, managers, dev, options.device_budget, options.budget_margin,
                            options.residency_policy)
    entries = [e for m in managers for lp in m.plan.layers for e in lp.params]
    managed = {id(e.param) for e in entries}
    entry_key = {id(e): leaf_keys[id(e.param)][e.leaf] if e.leaf is not None else source_key(param_names[id(e.param)])
                 for e in entries}
    with stages.attached(managers, options, values=_sampled_values(stored, entry_key)):
        if options.host_budget is not None:  # (after split fetch: the budget counts this rank's shares)
            _plan_disk(model, managers, options, stored, entry_key)
        share_of = _share_ranges(managers)  # split layers' parameters: read only this rank's bytes
        total = sum(s.nbytes for s in stored.values())
        bar = None
        if total >= 1 << 30:
            from tqdm.auto import tqdm

            bar = tqdm(total=total, unit="B", unit_scale=True, desc="layerwise: loading")

        # ---- change the model (undone on failure)
        swapped: list[tuple[nn.Module, str, nn.Parameter]] = []

        def swap(pid, new: nn.Parameter):
            for mod, attr in places[pid]:
                swapped.append((mod, attr, mod._parameters[attr]))
                mod._parameters[attr] = new

        buffers_before = [(mod, attr, mod._buffers[attr]) for mod, attr, _, _ in buffers]

        replaced: list[tuple[nn.Parameter, torch.Tensor]] = []
        # Quantized wrappers are rebuilt over other leaves in the same object (formats/quantized.rebind;
        # packing does it for the streamed ones): given back their meta leaves on failure.
        rebound = [(params[pid], form, quantized.leaf_tensors(params[pid])) for pid, form in wrapped.items()]
        owners = [(e, e.param) for e in entries]

        def undo():
            for p, old in reversed(replaced):
                p.data = old
            for mod, attr, old in reversed(swapped):
                mod._parameters[attr] = old
            for mod, attr, old in buffers_before:
                mod._buffers[attr] = old
            for p, form, leaves in rebound:
                if any(quantized.leaf(p, path) is not t for path, t in leaves.items()):
                    quantized.rebind(p, form, leaves)
            for e, p in owners:
                e.param = p

        # A meta parameter cannot take host data (set_data refuses): packed ones get
        # a fresh Parameter object, in every module that shares it.
        for e in entries:
            if e.leaf is None and e.param.is_meta:
                new = nn.Parameter(torch.empty((1,), dtype=e.dtype), requires_grad=e.param.requires_grad)
                swap(id(e.param), new)
                e.param = new

        def fill(e, block):
            s = stored[entry_key[id(e)]]
            dst = e.view_in(block)
            if id(e) in share_of and dst.is_contiguous():
                _read_share(s, e, block, *share_of[id(e)])
            elif dst.is_contiguous() and s.dtype == e.dtype:
                sft.read_into(s, dst)
            else:  # strided, or cast while reading: copy_ rounds exactly as .to(dtype) does
                dst.copy_(sft.host_tensor(s).view(e.shape))
            if bar is not None:
                bar.update(s.nbytes)

        def place_non_layer():
            for pid, names in param_names.items():
                if pid in managed:
                    continue
                p = params[pid]
                if pid in wrapped:  # a quantized wrapper outside the groups: rebuilt over its leaves on the device
                    keys = leaf_keys[pid]
                    quantized.rebind(p, wrapped[pid], {path: sft.host_tensor(stored[k]).to(dev)
                                                       for path, k in keys.items()})
                    if bar is not None:
                        bar.update(sum(stored[k].nbytes for k in keys.values()))
                    continue
                s = stored[source_key(names)]
                t = sft.host_tensor(s, p.dtype).to(dev)
                if p.is_meta:
                    swap(pid, nn.Parameter(t, requires_grad=p.requires_grad))
                else:
                    replaced.append((p, p.data))  # given back if the load fails later
                    p.data = t
                if bar is not None:
                    bar.update(s.nbytes)
            for mod, attr, full, persistent in buffers:
                b = mod._buffers[attr]
                if persistent and full in stored:
                    mod._buffers[attr] = sft.host_tensor(stored[full], want(b, full)).to(dev)
                elif full in recomputed:
                    value = recomputed[full][0]
                    mod._buffers[attr] = (value if as_computed else value.to(want(b, full))).to(dev)
                elif not as_computed and want(b, full) != b.dtype:
                    mod._buffers[attr] = b.to(want(b, full))

        fds: dict = {}
        evict = None
        try:
            try:
                for path in files:
                    with contract.defer_interrupts():  # each descriptor recorded where the `finally` closes it
                        fds[path] = os.open(path, os.O_RDONLY)
                if options.host_budget is not None:
                    evict = PageCacheDrop(fds.values(), PageCacheDrop.every_for(managers))
                for st in stored.values():
                    st.fd = fds[st.path]
                    st.evict = evict
            except BaseException:
                # (build_groups' rollback has not begun: the swaps above go back here)
                with contract.defer_interrupts():
                    undo()
                raise
            return build_groups(model, managers, dev, fill=fill, place_non_layer=place_non_layer, undo=undo)
        finally:
            try:
                if evict is not None:
                    evict.close()
            finally:
                for fd in fds.values():
                    os.close(fd)
            if bar is not None:
                bar.close()


def _streams_from_file(e, s: Stored) -> str | None:
    """Why parameter entry `e` cannot be read from its checkpoint bytes as they are
    (None: it can)."""
    if s.dtype != e.dtype:
        return f"{e.qualname} is stored as {s.dtype} and used as {e.dtype}"
    if e.span_bytes != s.nbytes or tuple(e.stride) != torch.empty(e.shape, device="meta").stride():
        return f"{e.qualname} is strided"
    return None


def _plan_disk(model, managers, options: OffloadOptions, stored, entry_key) -> None:
    """The disk tier of load_offloaded: layers over the host budget stay in the
    checkpoint files (or go to spill files with spill_dir)."""
    from layerwise.stages.disk import spill_store

    host_budget, spill_dir = options.host_budget, options.spill_dir

    def why_not_disk(m, i):
        if spill_dir is not None:
            return None
        for e in m.plan.layers[i].params:
            why = _streams_from_file(e, stored[entry_key[id(e)]])
            if why:
                return why
        return None

    plan = plan_host_budget(model, managers, options, why_not_disk=why_not_disk, spill=spill_dir is not None,
                            cache_bytes=PageCacheDrop.most(PageCacheDrop.every_for(managers)))
    record_host_budget(managers, host_budget, plan["budget"])
    for m in managers:
        if m.tiers.disk_layers:
            if spill_dir is not None:
                store = functools.partial(spill_store, m.layer_name, spill_dir)
                m.tiers.keep_on_disk(m.tiers.disk_layers, "spill", store)
            else:
                store = functools.partial(_checkpoint_store, stored, entry_key)
                m.tiers.keep_on_disk(m.tiers.disk_layers, "checkpoint", store)


def _same_layout(path: str, expected: dict):
    """A DiskFile's layout check: the reopened checkpoint must hold the tensors it
    held, at the same places."""
    def check(of):
        now = read_header(path)
        for key, s in expected.items():
            t = now.get(key)
            if t is None or (t.start, t.nbytes, t.dtype, t.shape) != (s.start, s.nbytes, s.dtype, s.shape):
                raise ValueError(f"layerwise: {path} is not the checkpoint the model was loaded from: tensor {key!r} "
                                 "is gone or moved. Restore the file, or load the model again.")
    return check


def _checkpoint_store(stored: dict, entry_key: dict, files: list):
    """A file store (stages/chain.py) for layers that stay in the checkpoint: a
    DiskSource that reads each file's tensors of the layer (or of this rank's
    share of it: `span` (lo, hi) of its plan layout) with one vectored read per
    run. `files` receives the files opened (closed by remove())."""
    from layerwise.stages.disk import DiskFile, DiskSource, crc_of
    from layerwise.stages.disk.reader import staging_layout

    opened: dict = {}  # this group's own descriptors (a reader caches per descriptor)

    def disk_file(path):
        if path not in opened:
            expected = {k: s for k, s in stored.items() if s.path == path}
            with contract.defer_interrupts():  # opened and recorded where remove() and a failed load close it
                opened[path] = DiskFile(path, check_layout=_same_layout(path, expected))
                files.append(opened[path])
        return opened[path]

    def store(lp, payload, span, what):
        lo, hi = span if span is not None else (0, lp.nbytes)
        by_file: dict = {}
        for e in lp.params:
            s = stored[entry_key[id(e)]]
            a, b = max(e.offset, lo), min(e.offset + s.nbytes, hi)  # (contiguous, as stored: why_not_disk)
            if a < b:
                by_file.setdefault(s.path, []).append((s.start + a - e.offset, b - a, a - lo))
        parts, copies, base = [], [], 0
        for path, items in by_file.items():
            extents, size = staging_layout([(a, n) for a, n, _ in items], base)
            parts.append((disk_file(path), extents))
            copies += [(d, poff, n) for (_, n, d), (_, _, poff) in zip(extents, items)]
            base += size
        merged = []
        for c in sorted(copies, key=lambda c: c[1]):
            if merged and merged[-1][0] + merged[-1][2] == c[0] and merged[-1][1] + merged[-1][2] == c[1]:
                merged[-1] = (merged[-1][0], merged[-1][1], merged[-1][2] + c[2])
            else:
                merged.append(c)
        return DiskSource(lp.index, hi - lo, parts, merged, crc_of(payload), what=what)

    return store


_SAMPLE = 4096  # bytes at each end of a tensor that every rank reads for the split-fetch values check


def _sampled_values(stored: dict, entry_key: dict):
    """split_fetch's values check (stages/gather.layer_values) for a load: every rank
    reads only its share of a split layer, so no rank can compare all of a layer's
    bytes with another's. What every rank compares instead, per split layer: each
    tensor's dtype, shape and size in the file and a CRC-32 of its first and last
    4 KiB (two small reads per tensor). Ranks that load checkpoints saved from
    different weights (other seeds, another fine-tune) are refused; a change that
    touches only the middle of a tensor is not seen (the same file on every rank is
    the caller's promise)."""
    import zlib

    def values(manager, lp):
        crc = 0
        fds = {}
        try:
            for e in lp.params:
                st = stored.get(entry_key.get(id(e)))
                if st is None:
                    return None
                crc = zlib.crc32(repr((str(st.dtype), tuple(st.shape), st.nbytes)).encode(), crc)
                fd = fds.get(st.path)
                if fd is None:
                    with contract.defer_interrupts():  # recorded where the `finally` closes it
                        fd = fds[st.path] = os.open(st.path, os.O_RDONLY)
                head = min(_SAMPLE, st.nbytes)
                crc = zlib.crc32(os.pread(fd, head, st.start), crc)
                crc = zlib.crc32(os.pread(fd, head, st.start + st.nbytes - head), crc)
        finally:
            for fd in fds.values():
                os.close(fd)
        return crc

    return values


def _share_ranges(managers) -> dict:
    """id(param entry) -> (lo, hi): the bytes of its layer block this rank keeps (split fetch)."""
    out = {}
    for m in managers:
        split = m.tiers.split_store
        if split is None:
            continue
        for i, (_, lo, hi) in split.spans.items():
            for e in m.plan.layers[i].params:
                out[id(e)] = (lo, hi)
    return out


def _read_share(stored: Stored, e, block: torch.Tensor, lo: int, hi: int) -> None:
    """Write into `block` the bytes of the contiguous parameter `e` that fall in
    [lo, hi) (this rank's share), reading only the elements that cover them (cast
    to e.dtype exactly as .to(dtype) does where the dtypes differ). Bytes outside
    [lo, hi) are left as they are: the share store keeps [lo, hi) only."""
    a, b = max(lo, e.offset), min(hi, e.offset + e.span_bytes)
    if a >= b:
        return
    isz = e.dtype.itemsize
    first, last = (a - e.offset) // isz, -(-(b - e.offset) // isz)  # elements covering [a, b)
    src = torch.empty(last - first, dtype=stored.dtype)
    sft.pread_exact(stored, bytes_of(src), stored.start + first * stored.dtype.itemsize)
    out = src if stored.dtype == e.dtype else src.to(e.dtype)
    at = e.offset + first * isz
    block[at : at + out.numel() * isz].copy_(out.view(torch.uint8))


def _same_values(stored: dict[str, Stored], names: list[str]) -> None:
    """The checkpoint tensors `names`, which all fill one (tied) parameter, must be equal."""
    def read(s: Stored) -> torch.Tensor:
        fd = -1
        try:
            with contract.defer_interrupts():  # held until the `finally` would close it
                fd = os.open(s.path, os.O_RDONLY)
            return sft.host_tensor(dataclasses.replace(s, fd=fd)).reshape(-1).view(torch.uint8)
        finally:
            if fd >= 0:
                os.close(fd)

    first = stored[names[0]]
    ref = read(first)
    for name in names[1:]:
        s = stored[name]
        if s.dtype != first.dtype or s.shape != first.shape or not torch.equal(read(s), ref):
            raise ValueError(
                f"checkpoint tensors {names[0]!r} and {name!r} differ, but the model ties them (one parameter "
                "under both names): build the model untied (for transformers: tie_word_embeddings=False in its "
                "config), or save the checkpoint from the tied model")
