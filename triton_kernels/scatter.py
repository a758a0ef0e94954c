"""Scatter one flat segment into many destination tensors with one kernel launch.

``dsts[i]`` receives ``segment[offsets[i] : offsets[i] + dsts[i].numel()]``,
read in row-major order into ``dsts[i]``'s logical shape and cast to
``dsts[i].dtype`` with the semantics of torch's ``Tensor.to(dtype)``.

Layout of this file: the pure-torch reference (:func:`scatter_segment_ref`),
the Triton kernel (``_scatter_kernel`` and its ``@triton.jit`` helpers), the
table builder and launcher (:func:`build_scatter_table`, ``_launch``), then the
public entry points (:func:`scatter_segment`, :func:`scatter`).

Supported dtypes (segment and destinations): float32, float16, bfloat16, int8,
uint8 and, where torch has it, float8_e4m3fn.  The kernel never uses Triton's
bf16/fp8 arithmetic: bf16 and fp8 values travel as integer bit patterns and
are converted with integer operations that reproduce torch's CPU conversion
code, so the same kernel runs under the Triton interpreter
(``TRITON_INTERPRET=1``) and compiled on a GPU.

Validation (all in :func:`build_scatter_table`, before anything is written):
  * ``len(offsets) != len(dsts)``                          -> ValueError
  * segment not a 1-D contiguous tensor                     -> ValueError
  * segment / destination of an unsupported dtype          -> TypeError
  * destination on another device than the segment          -> ValueError
  * destination of rank > 6, negative offset                -> ValueError
  * slice past the end of the segment                       -> ValueError
  * destination overlapping itself (stride 0 dims of size
    > 1, i.e. ``expand``-ed tensors, or any layout whose
    strides cannot be proven non-overlapping)               -> ValueError
  * two destinations whose address ranges
    ``[data_ptr, data_ptr + span_bytes)`` intersect         -> ValueError
    (conservative: interleaved views such as ``x[:, ::2]`` and ``x[:, 1::2]``
    are rejected too)
  * a destination overlapping the segment's memory          -> ValueError
Every message names the offending destination index.

Known limitations:
  * Casts of NaN values between *different* dtypes may produce a NaN with a
    different payload than torch on the same device (torch itself differs
    between CPU and CUDA there); copies without a cast are bit-exact,
    NaN payloads included.
  * Float -> int8/uint8 casts of values outside the target range (or NaN)
    are undefined in torch; the kernel truncates to int32 and wraps.
  * The table stores raw destination addresses. It keeps references to the
    destination tensors so their memory stays alive, but destinations must
    not be resized or have their storage swapped (``set_``) afterwards.
  * Under the Triton interpreter only CPU tensors are supported (destination
    addresses are dereferenced on the host).
  * On CUDA the kernel runs on the current stream of the segment's device,
    like any torch op; nothing is synchronized.
  * A call whose destinations are all empty launches nothing.
"""

from __future__ import annotations

import operator
import os
from typing import NamedTuple, Optional, Sequence, Tuple

import torch

try:  # Triton is optional: the reference path must work without it.
    import triton
    import triton.language as tl

    _TRITON_IMPORT_ERROR: Optional[BaseException] = None
except Exception as _exc:  # noqa: BLE001 - ImportError or a broken install
    triton = None
    tl = None
    _TRITON_IMPORT_ERROR = _exc

# Read once, like Triton itself does when it decorates the kernel.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

MAX_RANK = 6
DEFAULT_BLOCK = 1024
_ROW = 20  # int64 words per destination descriptor row
# Row layout (int64 words):
_F_ADDR, _F_SEG_OFF, _F_NUMEL, _F_PROG_START, _F_CODE, _F_FLAGS, _F_RANK = range(7)
_F_SHAPE = 7  # 6 words, right-aligned, unused leading dims have size 1
_F_STRIDE = 13  # 6 words, unused leading dims have stride 0
_FLAG_CONTIG = 1
_FLAG_FAST = 2  # contiguous and 16-byte aligned on both sides

# dtype -> (code, element size, torch dtype the kernel sees the memory as)
_DTYPES = {
    torch.float32: (0, 4, torch.float32),
    torch.float16: (1, 2, torch.float16),
    torch.bfloat16: (2, 2, torch.int16),
    torch.int8: (3, 1, torch.int8),
    torch.uint8: (4, 1, torch.uint8),
}
_FP8 = getattr(torch, "float8_e4m3fn", None)
if _FP8 is not None:
    _DTYPES[_FP8] = (5, 1, torch.uint8)

SUPPORTED_DTYPES = tuple(_DTYPES)


# --------------------------------------------------------------------------
# Pure-torch reference
# --------------------------------------------------------------------------
def scatter_segment_ref(segment: torch.Tensor, offsets: Sequence[int], dsts: Sequence[torch.Tensor]) -> None:
    """Reference implementation: one ``copy_`` per destination.

    Validates exactly like :func:`build_scatter_table` first, so bad input
    raises the same error before anything is written.
    """
    infos = _validate(segment, offsets, dsts)
    with torch.no_grad():
        for info, d in zip(infos, dsts):
            n = info.numel
            if n == 0:
                continue
            src = segment[info.offset : info.offset + n].to(d.dtype)
            d.copy_(src.view(d.shape))


# --------------------------------------------------------------------------
# Triton kernel
# --------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _to_f32(x, SRC: tl.constexpr):
        """Exact widening of a segment value (storage type) to float32."""
        if SRC == 0:
            f = x
        elif SRC == 1:
            f = x.to(tl.float32)
        elif SRC == 2:  # bfloat16 bits held as int16
            f = (x.to(tl.int32) << 16).to(tl.float32, bitcast=True)
        elif SRC == 3:
            f = x.to(tl.float32)
        elif SRC == 4:
            f = x.to(tl.float32)
        else:  # float8_e4m3fn bits held as uint8; mirrors c10 fp8e4m3fn_to_fp32_value
            b = x.to(tl.uint32)
            sign = (b & 0x80) << 24
            e = (b >> 3) & 0xF
            m = b & 7
            normal = ((e + 120) << 23) | (m << 20)
            sub = (m.to(tl.float32) * 0.001953125).to(tl.uint32, bitcast=True)  # m * 2**-9, exact
            is_nan = (b & 0x7F) == 0x7F
            bits = tl.where(e == 0, sub, tl.where(is_nan, 0x7FF00000, normal))
            f = (bits | sign).to(tl.float32, bitcast=True)
        return f

    @triton.jit
    def _f32_to_bf16_bits(f):
        """c10 round_to_nearest_even: RNE, NaN -> 0x7FC0."""
        u = f.to(tl.uint32, bitcast=True)
        r = (u + (((u >> 16) & 1) + 0x7FFF)) >> 16
        is_nan = (u & 0x7FFFFFFF) > 0x7F800000
        r = tl.where(is_nan, 0x7FC0, r)
        return r.to(tl.uint16)

    @triton.jit
    def _f32_to_fp8_bits(f, SAT_FP8: tl.constexpr):
        """c10 fp8e4m3fn_from_fp32_value (saturating or NaN-on-overflow, as torch does)."""
        u = f.to(tl.uint32, bitcast=True)
        sign = (u >> 24) & 0x80
        a = u & 0x7FFFFFFF
        # normal range: round to nearest even on the 3 mantissa bits
        mant_odd = (a >> 20) & 1
        norm = ((a - (120 << 23) + 0x7FFFF + mant_odd) >> 20) & 0xFF
        # below 2**-6: let a float add do the rounding into the subnormal range
        den = ((a.to(tl.float32, bitcast=True) + 16384.0).to(tl.uint32, bitcast=True) - (141 << 23)) & 0xFF
        r = tl.where(a < (121 << 23), den, norm)
        is_nan = a > 0x7F800000
        if SAT_FP8:
            r = tl.where(r == 0x7F, 0x7E, r)
            r = tl.where(a >= (1087 << 20), tl.where(is_nan, 0x7F, 0x7E), r)
        else:
            r = tl.where(a >= (1087 << 20), 0x7F, r)
        return (r | sign).to(tl.uint8)

    @triton.jit
    def _dst_ptr(base, elem, DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
        p = base.to(tl.pointer_type(DTYPE))
        if ALIGNED:  # base is 16-byte aligned: let the compiler vectorize
            p = tl.multiple_of(p, 16)
        return p + elem

    @triton.jit
    def _convert_store(x, base, elem, mask, code, SRC: tl.constexpr, SAT_FP8: tl.constexpr, ALIGNED: tl.constexpr):
        """Store segment values ``x`` to ``base`` (int64 address) + ``elem`` elements,
        converted to the destination dtype given by the runtime ``code``."""
        if code == SRC:  # same dtype: bit-exact copy
            tl.store(_dst_ptr(base, elem, x.dtype, ALIGNED), x, mask=mask)
        else:
            f = _to_f32(x, SRC)
            if code == 0:
                tl.store(_dst_ptr(base, elem, tl.float32, ALIGNED), f, mask=mask)
            elif code == 1:
                tl.store(_dst_ptr(base, elem, tl.float16, ALIGNED), f.to(tl.float16), mask=mask)
            elif code == 2:
                tl.store(_dst_ptr(base, elem, tl.uint16, ALIGNED), _f32_to_bf16_bits(f), mask=mask)
            elif code == 3:
                tl.store(_dst_ptr(base, elem, tl.int8, ALIGNED), f.to(tl.int32).to(tl.int8), mask=mask)
            elif code == 4:
                tl.store(_dst_ptr(base, elem, tl.uint8, ALIGNED), f.to(tl.int32).to(tl.uint8), mask=mask)
            else:
                tl.store(_dst_ptr(base, elem, tl.uint8, ALIGNED), _f32_to_fp8_bits(f, SAT_FP8), mask=mask)

    @triton.jit
    def _scatter_kernel(
        seg_ptr,
        tab_ptr,
        n_active,
        SRC: tl.constexpr,
        SAT_FP8: tl.constexpr,
        BLOCK: tl.constexpr,
        SEARCH_STEPS: tl.constexpr,
        VEC: tl.constexpr,
        ROW: tl.constexpr,
    ):
        """One program copies BLOCK elements of one destination.

        tab[0:n_active] holds each destination's first program id (ascending);
        a binary search maps this program to its destination row, stored at
        tab[n_active + i*ROW : n_active + (i+1)*ROW].
        """
        pid = tl.program_id(0).to(tl.int64)
        lo = pid * 0
        hi = lo + n_active
        for _ in tl.static_range(SEARCH_STEPS):
            mid = (lo + hi) // 2
            go_right = tl.load(tab_ptr + mid) <= pid
            lo = tl.where(go_right, mid, lo)
            hi = tl.where(go_right, hi, mid)
        row = tab_ptr + n_active + lo * ROW
        addr = tl.load(row + 0)
        seg_off = tl.load(row + 1)
        numel = tl.load(row + 2)
        prog_start = tl.load(row + 3)
        code = tl.load(row + 4)
        flags = tl.load(row + 5)

        blk = pid - prog_start
        offs = blk * BLOCK + tl.arange(0, BLOCK)
        full = (blk + 1) * BLOCK <= numel
        fast = ((flags & 2) != 0) & full
        if fast:
            # Contiguous, 16-byte aligned on both sides, whole block in range:
            # unmasked accesses whose alignment the compiler can see.
            x = tl.load(seg_ptr + (seg_off // VEC) * VEC + offs)
            _convert_store(x, addr, offs, None, code, SRC, SAT_FP8, True)
        else:
            mask = offs < numel
            x = tl.load(seg_ptr + seg_off + offs, mask=mask)
            if (flags & 1) != 0:
                elem = offs
            else:
                rem = offs
                elem = offs * 0
                for d in tl.static_range(6):
                    size = tl.load(row + (7 + 5 - d))
                    stride = tl.load(row + (13 + 5 - d))
                    elem += (rem % size) * stride
                    rem = rem // size
            _convert_store(x, addr, elem, mask, code, SRC, SAT_FP8, False)

else:
    _scatter_kernel = None


# --------------------------------------------------------------------------
# Validation, table building, launch
# --------------------------------------------------------------------------
class _DstInfo(NamedTuple):
    offset: int
    numel: int
    code: int
    esize: int
    shape: Tuple[int, ...]
    stride: Tuple[int, ...]
    addr: int
    contiguous: bool


class ScatterTable(NamedTuple):
    """Everything one launch needs; build once with :func:`build_scatter_table`.

    table:          int64 tensor on the segment's device: ``n_active`` program
                    starts, then one ``_ROW``-word descriptor row per non-empty
                    destination.
    grid:           number of programs (sum of ceil(numel_i / block)).
    block:          elements per program.
    n_active:       number of non-empty destinations (rows in ``table``).
    search_steps:   ceil(log2(n_active)), the binary-search depth.
    num_dsts:       len(dsts), empty destinations included.
    total_numel:    elements written per call.
    required_numel: minimum segment length (max of offset + numel).
    seg_dtype:      dtype the segment must have.
    device:         device the segment must be on.
    src_code, vec, sat_fp8: kernel constants.
    dsts:           the destination tensors (kept alive while the table lives).
    offsets:        the element offsets, as ints.
    """

    table: torch.Tensor
    grid: int
    block: int
    n_active: int
    search_steps: int
    num_dsts: int
    total_numel: int
    required_numel: int
    seg_dtype: torch.dtype
    device: torch.device
    src_code: int
    vec: int
    sat_fp8: bool
    dsts: Tuple[torch.Tensor, ...]
    offsets: Tuple[int, ...]


_SAT_FP8_CACHE: dict = {}


def _torch_fp8_saturates(device: torch.device) -> bool:
    """Whether torch, on this device type, saturates float32 -> float8_e4m3fn
    overflow to 448 (newer versions) instead of producing NaN (older ones); the
    CPU and CUDA casts changed in different releases. Probed once per device type."""
    key = torch.device(device).type
    if key not in _SAT_FP8_CACHE:
        if _FP8 is None:
            _SAT_FP8_CACHE[key] = True
        else:
            probe = torch.tensor([470.0], dtype=torch.float32, device=device).to(_FP8).view(torch.uint8)
            _SAT_FP8_CACHE[key] = int(probe.cpu()[0]) == 0x7E
    return _SAT_FP8_CACHE[key]


def _may_self_overlap(shape, stride) -> bool:
    """Conservative test: False only when the strides provably give distinct
    addresses to distinct elements (sorted by stride, each stride exceeds the
    extent of the smaller dims)."""
    dims = sorted((st, sz) for sz, st in zip(shape, stride) if sz > 1)
    extent = 0  # max element offset reachable with the dims seen so far
    for st, sz in dims:
        if st <= extent:
            return True
        extent += (sz - 1) * st
    return False


def _validate(segment, offsets, dsts) -> Tuple[_DstInfo, ...]:
    if not isinstance(segment, torch.Tensor):
        raise TypeError(f"segment must be a torch.Tensor, got {type(segment).__name__}")
    if segment.dim() != 1 or not segment.is_contiguous():
        raise ValueError(
            f"segment must be a 1-D contiguous tensor, got shape {tuple(segment.shape)} "
            f"stride {tuple(segment.stride())}"
        )
    if segment.dtype not in _DTYPES:
        raise TypeError(f"segment has unsupported dtype {segment.dtype}; supported: {list(SUPPORTED_DTYPES)}")
    offsets = list(offsets)
    dsts = list(dsts)
    if len(offsets) != len(dsts):
        raise ValueError(f"len(offsets) = {len(offsets)} but len(dsts) = {len(dsts)}; they must match")
    seg_n = segment.numel()
    seg_esize = _DTYPES[segment.dtype][1]
    infos = []
    for i, (off, d) in enumerate(zip(offsets, dsts)):
        if not isinstance(d, torch.Tensor):
            raise TypeError(f"destination {i} must be a torch.Tensor, got {type(d).__name__}")
        if d.device != segment.device:
            raise ValueError(f"destination {i} is on device {d.device} but the segment is on {segment.device}")
        if d.dtype not in _DTYPES:
            raise TypeError(
                f"destination {i} has unsupported dtype {d.dtype}; supported: {list(SUPPORTED_DTYPES)}"
            )
        if d.dim() > MAX_RANK:
            raise ValueError(f"destination {i} has rank {d.dim()} > {MAX_RANK}")
        try:
            off = operator.index(off)
        except TypeError:
            raise TypeError(f"offset {i} must be an int, got {type(off).__name__}") from None
        if off < 0:
            raise ValueError(f"offset {i} is negative ({off})")
        n = d.numel()
        if off + n > seg_n:
            raise ValueError(
                f"destination {i}: slice [{off}, {off + n}) is past the end of the segment (numel {seg_n})"
            )
        shape, stride = tuple(d.shape), tuple(d.stride())
        if any(s < 0 for s in stride):
            raise ValueError(f"destination {i} has a negative stride {stride}")
        if n > 0 and _may_self_overlap(shape, stride):
            raise ValueError(
                f"destination {i} overlaps itself (shape {shape}, stride {stride}; e.g. an expanded tensor)"
            )
        code, esize, _ = _DTYPES[d.dtype]
        infos.append(_DstInfo(off, n, code, esize, shape, stride, d.data_ptr(), d.is_contiguous()))

    # Memory overlap: destinations among themselves and with the segment.
    spans = []
    for i, info in enumerate(infos):
        if info.numel == 0:
            continue
        span = (sum((sz - 1) * st for sz, st in zip(info.shape, info.stride)) + 1) * info.esize
        spans.append((info.addr, info.addr + span, i))
    if spans and seg_n > 0:
        s0 = segment.data_ptr()
        s1 = s0 + seg_n * seg_esize
        for a0, a1, i in spans:
            if a0 < s1 and s0 < a1:
                raise ValueError(f"destination {i} overlaps the segment's memory")
    # sorted by start address, an overlap shows up against the running max end
    spans.sort()
    max_end, max_idx = -1, -1
    for a0, a1, i in spans:
        if a0 < max_end:
            j, k = sorted((i, max_idx))
            raise ValueError(f"destination {k} overlaps destination {j} in memory")
        if a1 > max_end:
            max_end, max_idx = a1, i
    return tuple(infos)


def build_scatter_table(
    segment: torch.Tensor,
    offsets: Sequence[int],
    dsts: Sequence[torch.Tensor],
    block: int = DEFAULT_BLOCK,
) -> ScatterTable:
    """Validate the arguments and build the launch table (once, at plan time).

    The result can be passed to :func:`scatter_segment` / :func:`scatter` for
    any segment of the same dtype and device with at least ``required_numel``
    elements; the destinations are fixed by the table.
    """
    if not isinstance(block, int) or block < 16 or block & (block - 1):
        raise ValueError(f"block must be a power of two >= 16, got {block!r}")
    dsts = tuple(dsts)
    infos = _validate(segment, offsets, dsts)
    src_code, src_esize, _ = _DTYPES[segment.dtype]
    starts, rows = [], []
    prog = 0
    total = 0
    required = 0
    for info in infos:
        required = max(required, info.offset + info.numel)
        if info.numel == 0:
            continue
        pad = MAX_RANK - len(info.shape)
        shape = (1,) * pad + info.shape
        stride = (0,) * pad + info.stride
        flags = 0
        if info.contiguous:
            flags |= _FLAG_CONTIG
            if info.addr % 16 == 0 and (info.offset * src_esize) % 16 == 0:
                flags |= _FLAG_FAST
        row = [info.addr, info.offset, info.numel, prog, info.code, flags, len(info.shape)]
        row += list(shape) + list(stride)
        row += [0] * (_ROW - len(row))
        starts.append(prog)
        rows.extend(row)
        prog += -(-info.numel // block)
        total += info.numel
    if prog >= 2**31:
        raise ValueError(f"{total} elements need {prog} programs of {block}; use a larger block")
    n_active = len(starts)
    host = torch.tensor(starts + rows, dtype=torch.int64)
    table = host.to(segment.device) if segment.device.type != "cpu" else host
    return ScatterTable(
        table=table,
        grid=prog,
        block=block,
        n_active=n_active,
        search_steps=(n_active - 1).bit_length() if n_active > 0 else 0,
        num_dsts=len(dsts),
        total_numel=total,
        required_numel=required,
        seg_dtype=segment.dtype,
        device=segment.device,
        src_code=src_code,
        vec=16 // src_esize,
        sat_fp8=_torch_fp8_saturates(segment.device),
        dsts=dsts,
        offsets=tuple(info.offset for info in infos),
    )


def _require_triton() -> None:
    if triton is None:
        raise ImportError(
            "the Triton scatter path needs the 'triton' package, which could not be imported "
            f"({_TRITON_IMPORT_ERROR!r}); install triton or use backend='ref'"
        )


def _check_segment_for_table(segment: torch.Tensor, table: ScatterTable) -> None:
    if not isinstance(segment, torch.Tensor):
        raise TypeError(f"segment must be a torch.Tensor, got {type(segment).__name__}")
    if segment.dtype != table.seg_dtype:
        raise TypeError(f"segment dtype {segment.dtype} differs from the table's {table.seg_dtype}")
    if segment.device != table.device:
        raise ValueError(f"segment is on {segment.device} but the table was built for {table.device}")
    if segment.dim() != 1 or not segment.is_contiguous():
        raise ValueError("segment must be a 1-D contiguous tensor")
    if segment.numel() < table.required_numel:
        raise ValueError(
            f"segment has {segment.numel()} elements but the table needs {table.required_numel}"
        )


def _launch(segment: torch.Tensor, table: ScatterTable) -> None:
    """Check the segment against the table and launch the kernel once."""
    _require_triton()
    _check_segment_for_table(segment, table)
    if _INTERPRET:
        if segment.device.type != "cpu":
            raise RuntimeError(
                "TRITON_INTERPRET=1 is set: the interpreted scatter kernel only supports CPU tensors"
            )
    elif segment.device.type != "cuda":
        raise RuntimeError(
            f"the Triton scatter kernel needs CUDA tensors (got {segment.device}); "
            "set TRITON_INTERPRET=1 before importing to run it on CPU"
        )
    if table.grid == 0:
        return  # nothing to write (all destinations empty)
    seg_view = segment.view(_DTYPES[segment.dtype][2])
    kernel = _scatter_kernel  # module global looked up per call (tests wrap it to count launches)
    args = (seg_view, table.table, table.n_active)
    meta = dict(
        SRC=table.src_code,
        SAT_FP8=table.sat_fp8,
        BLOCK=table.block,
        SEARCH_STEPS=table.search_steps,
        VEC=table.vec,
        ROW=_ROW,
        num_warps=4,
    )
    if segment.device.type == "cuda":
        # Triton launches on torch's current device and stream: make the
        # segment's device current so a cuda:1 segment is not run on cuda:0.
        with torch.cuda.device(segment.device):
            kernel[(table.grid,)](*args, **meta)
    else:
        kernel[(table.grid,)](*args, **meta)


# --------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------
def scatter_segment(
    segment: torch.Tensor,
    offsets: Optional[Sequence[int]],
    dsts: Optional[Sequence[torch.Tensor]],
    table: Optional[ScatterTable] = None,
) -> None:
    """Triton scatter: one kernel launch per call, whatever the number of
    destinations (none when every destination is empty).

    With ``table`` (from :func:`build_scatter_table`) no per-destination work
    is done: ``offsets``/``dsts`` may be None, and if given only their count is
    checked against the table.
    """
    if table is None:
        table = build_scatter_table(segment, offsets, dsts)
    elif dsts is not None and len(dsts) != table.num_dsts:
        raise ValueError(f"len(dsts) = {len(dsts)} but the table was built for {table.num_dsts}")
    _launch(segment, table)


def triton_available_for(device: torch.device) -> bool:
    """Whether backend='auto' runs the Triton kernel for tensors on ``device``."""
    if triton is None:
        return False
    device = torch.device(device)
    if device.type == "cuda":
        return not _INTERPRET
    if device.type == "cpu":
        return _INTERPRET
    return False


def scatter(
    segment: torch.Tensor,
    offsets: Optional[Sequence[int]],
    dsts: Optional[Sequence[torch.Tensor]],
    table: Optional[ScatterTable] = None,
    backend: str = "auto",
) -> str:
    """Dispatch: ``backend="auto"`` runs Triton on CUDA tensors (compiled) and on
    CPU tensors when ``TRITON_INTERPRET=1`` was set before import, else the
    reference; ``"triton"`` / ``"ref"`` force a path. Returns the path that ran.
    """
    if backend not in ("auto", "triton", "ref"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'ref', got {backend!r}")
    if not isinstance(segment, torch.Tensor):
        raise TypeError(f"segment must be a torch.Tensor, got {type(segment).__name__}")
    if backend == "auto":
        backend = "triton" if triton_available_for(segment.device) else "ref"
    if backend == "triton":
        scatter_segment(segment, offsets, dsts, table=table)
        return "triton"
    if table is not None:
        if dsts is not None and len(dsts) != table.num_dsts:
            raise ValueError(f"len(dsts) = {len(dsts)} but the table was built for {table.num_dsts}")
        _check_segment_for_table(segment, table)
        offsets, dsts = table.offsets, table.dsts
    scatter_segment_ref(segment, offsets, dsts)
    return "ref"
