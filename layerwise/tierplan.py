"""Host bytes of a group at the size its tiers will keep each layer, known
before packing (DESIGN.md, "Tiers and stages": budgets count layers at the
size they will have).

The manager decides its tiers right before packing (`_choose_tiers`); the
budgets of offload_pipeline are computed before that, so this module makes
the same per-layer choice from the same inputs:

disk      layers the disk tier keeps (`_disk_layers`): no host bytes
split     this rank's share of each split layer (split_fetch), page-rounded as
          the ShareStore's arena allocates it
encoded   compress="lossless": the streamed layers with a bf16/fp16 segment
          (stages/decode.select_layers), at their **exact** encoded size: the
          codec's choice per segment (code width, stored or coded) depends only
          on the histogram of the segment's symbols (exponents), which is
          computed here from the parameters' bytes without encoding; a layer
          whose encoding saves too little (decode.MIN_SAVING) counts raw
arena     every other layer, raw

Every figure is rounded up to a page (BLOCK_ALIGN): each layer block is
allocated page-aligned, in the arena or in a block of its own.
"""
from __future__ import annotations

import torch

from . import codec as _codec
from .plan import BLOCK_ALIGN, local_tensor, round_up

_ALIGN = 16  # every codec stream starts at a multiple of 16 bytes
_MAX_WIDTH = {torch.bfloat16: 5, torch.float16: 4}
_EXTRA_BITS = {torch.bfloat16: 0, torch.float16: 3}
_SYMBOL = {torch.bfloat16: (7, 0xFF, 256), torch.float16: (10, 0x1F, 32)}  # shift, mask, symbols
_CHUNK = 1 << 22  # values per histogram step (bounds the temporaries)


def _a16(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _coded_total(n_values: int, field_bits: int, n_exc: int) -> int:
    """csrc/codec.cpp coded_layout(...).total."""
    blocks = -(-n_values // _codec.BLOCK_VALUES)
    off_fields = _a16(_codec.HEADER_BYTES + 4 * (blocks + 1))
    off_raw = _a16(off_fields + -(-n_values * field_bits // 8))
    off_exc = _a16(off_raw + n_values)
    return _a16(off_exc + n_exc)


def segment_encoded_bytes(hist: torch.Tensor, n_bytes: int, dtype: torch.dtype) -> int:
    """Bytes codec.encode gives a segment of `n_bytes` of `dtype` whose symbol
    histogram is `hist` (csrc/codec.cpp plan_encode, mirrored)."""
    stored = _a16(_codec.HEADER_BYTES + n_bytes)
    n_values = n_bytes // 2
    if dtype not in _MAX_WIDTH or n_values == 0 or n_values >= 1 << 32:
        return stored
    counts = sorted((int(c) for c in hist.tolist() if c), reverse=True)
    best = None
    for w in range(1, _MAX_WIDTH[dtype] + 1):
        covered = sum(counts[: (1 << w) - 1])
        total = _coded_total(n_values, w + _EXTRA_BITS[dtype], n_values - covered)
        best = total if best is None or total < best else best
    return stored if best * 100 > n_bytes * 97 else best


def _histogram(entries, dtype: torch.dtype, seg_bytes: int) -> torch.Tensor | None:
    """Symbol histogram of one packed segment: its parameters' storage spans, and
    zeros for the alignment gaps between them. None: a parameter has no data (meta)."""
    shift, mask, n_sym = _SYMBOL[dtype]
    hist = torch.zeros(n_sym, dtype=torch.int64)
    values = 0
    for e in entries:
        data = local_tensor(e.param.data)
        if data.is_meta or data.dtype != dtype:
            return None
        flat = torch.as_strided(data, (e.span,), (1,), data.storage_offset()).view(torch.int16)
        for k in range(0, e.span, _CHUNK):
            sym = (flat[k : k + _CHUNK] >> shift) & mask
            hist += torch.bincount(sym.reshape(-1).to("cpu"), minlength=n_sym)
        values += e.span
    hist[0] += seg_bytes // 2 - values  # the gaps are zero bytes: symbol 0
    return hist


def encoded_layer_bytes(lp) -> int | None:
    """The exact byte count stages/decode.encode_layer gives layer `lp` (its
    segments one after the other, 16-byte aligned); None where its parameters
    hold no data yet."""
    total = 0
    for dtype, (_, n) in sorted(lp.segments.items(), key=lambda kv: kv[1][0]):
        if dtype in _MAX_WIDTH:
            hist = _histogram([e for e in lp.params if e.dtype == dtype], dtype, n)
            if hist is None:
                return None
            total += _a16(segment_encoded_bytes(hist, n, dtype))
        else:
            total += _a16(_a16(_codec.HEADER_BYTES + n))
    return total


def layer_host_bytes(manager) -> dict[int, int]:
    """{layer index: host bytes it will take} for the manager's tier choice
    (as _choose_tiers will make it), each page-rounded."""
    from .stages.decode import MIN_SAVING, select_layers

    disk = manager._disk_layers
    split = manager._split.spans if manager._split is not None else {}
    codec = set(select_layers(manager.plan, manager.resident)) if manager.compress == "lossless" else set()
    out = {}
    for lp in manager.plan.layers:
        i = lp.index
        if i in disk:
            out[i] = 0
        elif i in split:
            _, lo, hi = split[i]
            out[i] = round_up(hi - lo, BLOCK_ALIGN)
        elif i in codec:
            enc = encoded_layer_bytes(lp)
            size = lp.nbytes if enc is None or enc > MIN_SAVING * lp.nbytes else enc
            out[i] = round_up(max(size, 1), BLOCK_ALIGN)
        else:
            out[i] = round_up(lp.nbytes, BLOCK_ALIGN)
    return out


def planned_host_bytes(manager) -> int:
    """Host bytes of the group's layers at the size their tiers keep them."""
    return sum(layer_host_bytes(manager).values()) if manager.enabled else 0
