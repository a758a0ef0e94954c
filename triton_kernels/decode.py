"""Decode one losslessly encoded segment straight into its destination, in one launch.

The encoded format (written by the C++ encoder, ``layerwise._C.codec.encode``)
is specified in ``layerwise/codec.py``. In short: a 128-byte header (with a
table of up to 31 exponent symbols), an index of exceptions before each block
of 1024 values, a field stream (value ``i``'s W-bit code, plus fp16's 3 raw
high bits, at bit ``i * F``), a raw-byte stream (one byte per value: bf16's
sign and 7 mantissa bits, fp16's low 8 mantissa bits) and an exception stream
(the symbols whose code is the escape ``2**W - 1``, in value order). A segment
that did not shrink is *stored*: header, then the bytes as they are.

Layout of this file: the header parser and the pure-torch reference
(:func:`parse_header`, :func:`decode_segment_ref`), the Triton kernel
(``_decode_kernel``), the launcher (``_launch``), then the public entry points
(:func:`decode_segment`, :func:`triton_available_for`).

The kernel never trusts the encoded bytes for memory safety: it reads the
header on the device (no host synchronisation), checks it against the buffer's
length and the destination's size, masks every load to the streams the header
declares, and writes nothing when the header does not fit. It does not report
*why* (a kernel cannot raise): validate encoded bytes on the host once, where
they are produced (``layerwise.codec.read_header``, or pass the parsed
``header=`` here). Values are handled as 16-bit integers throughout, so the
same kernel runs under the Triton interpreter (``TRITON_INTERPRET=1``, CPU
tensors) and compiled on a GPU, and the result is bitwise whatever the bits
(NaN payloads, infinities, signed zeros, subnormals).

Performance (one program per BLOCK values; no GPU was available when this was
written, so nothing here is measured yet: ``python -m layerwise.bench compress
--device cuda`` measures it): per value the kernel reads its raw byte
(contiguous, vectorisable), two bytes of the field stream (gathered, L1 hits)
and one table byte, and writes 2 bytes; a program whose blocks hold exceptions
adds one ``tl.cumsum`` over its BLOCK escape flags to find each exception's
place in the exception stream, so no exception needs a position of its own.
"""

from __future__ import annotations

import os
import struct
from typing import NamedTuple, Optional

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

# Format constants (layerwise/codec.py has the table).
MAGIC = b"LWCS"
MAGIC_INT = int.from_bytes(MAGIC, "little")
VERSION = 1
HEADER_BYTES = 128
TABLE_OFFSET = 96
MAX_TABLE = 32
LOG2_BLOCK = 10
BLOCK_VALUES = 1 << LOG2_BLOCK
ALIGN = 16
DTYPE_NAMES = {0: "bytes", 1: "bfloat16", 2: "float16"}
_EXTRA_BITS = {1: 0, 2: 3}  # raw bits riding with the code: bf16 none, fp16 sign + 2 mantissa bits
_MAX_WIDTH = {1: 5, 2: 4}
_SYMBOLS = {1: 256, 2: 32}

DEFAULT_BLOCK = 1024  # values per program: a multiple of BLOCK_VALUES


class SegmentHeader(NamedTuple):
    """The checked header of an encoded segment."""

    dtype: str  # "bfloat16", "float16" or "bytes"
    coded: bool  # False: stored (raw bytes after the header)
    width: int  # W, bits of a code; 0 when stored
    field_bits: int  # F = W + raw bits riding with the code
    table: tuple  # symbols of codes 0..len-1
    n_bytes: int  # decoded size
    n_exceptions: int
    encoded_bytes: int  # total, header and padding included
    off_index: int
    off_fields: int
    off_raw: int
    off_exceptions: int


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def coded_layout(n_values: int, field_bits: int, n_exceptions: int) -> tuple:
    """(off_index, off_fields, off_raw, off_exceptions, total) of a coded segment."""
    nblocks = -(-n_values // BLOCK_VALUES)
    off_index = HEADER_BYTES
    off_fields = _align(off_index + 4 * (nblocks + 1))
    off_raw = _align(off_fields + -(-(n_values * field_bits) // 8))
    off_exc = _align(off_raw + n_values)
    return off_index, off_fields, off_raw, off_exc, _align(off_exc + n_exceptions)


def _bad(msg: str) -> ValueError:
    return ValueError(f"layerwise codec: {msg}")


def parse_header(head, length: Optional[int] = None) -> SegmentHeader:
    """Parse and check the first 128 bytes of an encoded segment (``bytes`` or a
    uint8 tensor holding at least them). With ``length`` (the whole encoded
    buffer's size) the header must also say exactly that size. Raises
    ValueError naming the problem, like the C++ decoder."""
    if isinstance(head, torch.Tensor):
        if head.dtype != torch.uint8:
            raise TypeError(f"encoded segment must be a uint8 tensor, got {head.dtype}")
        head = bytes(head[:HEADER_BYTES].cpu().numpy().tobytes())
    head = bytes(head[:HEADER_BYTES])
    if len(head) < HEADER_BYTES:
        raise _bad(f"encoded segment has {len(head)} bytes, fewer than its {HEADER_BYTES}-byte header (truncated?)")
    if head[:4] != MAGIC:
        raise _bad("encoded segment does not start with the magic 'LWCS' (not an encoded segment, or the wrong offset)")
    version, dt, mode, width, fbits, log2b, tsize = head[4:11]
    if version != VERSION:
        raise _bad(f"encoded segment has format version {version}; this build reads version {VERSION}")
    if dt not in DTYPE_NAMES:
        raise _bad(f"unknown dtype code {dt} in the header")
    if mode not in (0, 1):
        raise _bad(f"unknown mode {mode} in the header")
    if any(head[11:16]) or any(head[72:TABLE_OFFSET]):
        raise _bad("reserved header bytes are not zero")
    n_bytes, n_exc, total, off_index, off_fields, off_raw, off_exc = struct.unpack_from("<7Q", head, 16)
    table = head[TABLE_OFFSET : TABLE_OFFSET + MAX_TABLE]
    if length is not None and total != length:
        raise _bad(f"header says the encoded segment has {total} bytes, the buffer has {length} "
                   "(truncated, or not the whole segment)")
    if mode == 0:
        if width or fbits or tsize or log2b or n_exc or any(table):
            raise _bad("stored segment with code fields set in its header")
        want = (0, 0, HEADER_BYTES, 0, _align(HEADER_BYTES + n_bytes))
    else:
        if dt == 0:
            raise _bad("coded segment of dtype 'bytes' (only bfloat16 and float16 are coded)")
        if n_bytes % 2:
            raise _bad(f"coded segment of {n_bytes} bytes, not whole 16-bit values")
        n_values = n_bytes // 2
        if n_values >= 1 << 32:
            raise _bad(f"coded segment of {n_values} values (>= 2^32)")
        if log2b != LOG2_BLOCK:
            raise _bad(f"block size 2^{log2b}; this build reads 2^{LOG2_BLOCK}")
        if not 1 <= width <= _MAX_WIDTH[dt]:
            raise _bad(f"code width {width} out of range 1..{_MAX_WIDTH[dt]} for {DTYPE_NAMES[dt]}")
        if fbits != width + _EXTRA_BITS[dt]:
            raise _bad(f"field of {fbits} bits for {width}-bit codes of {DTYPE_NAMES[dt]}")
        if tsize > (1 << width) - 1:
            raise _bad(f"table of {tsize} symbols for {width}-bit codes")
        if n_exc > n_values:
            raise _bad(f"{n_exc} exceptions in {n_values} values")
        if any(table[tsize:]):
            raise _bad("table entries past the table are set")
        if any(s >= _SYMBOLS[dt] for s in table):
            raise _bad(f"table holds a symbol that is not a {DTYPE_NAMES[dt]} exponent")
        want = coded_layout(n_values, fbits, n_exc)
    have = (off_index, off_fields, off_raw, off_exc, total)
    if have != want:
        raise _bad(f"stream offsets (index, fields, raw, exceptions, total) {have} differ from the layout the "
                   f"header's sizes imply {want}")
    return SegmentHeader(DTYPE_NAMES[dt], mode == 1, width, fbits, tuple(table[:tsize]), n_bytes, n_exc, total,
                         off_index, off_fields, off_raw, off_exc)


def _dst_bytes(dst: torch.Tensor, what: str = "dst") -> torch.Tensor:
    if not isinstance(dst, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(dst).__name__}")
    if not dst.is_contiguous():
        raise ValueError(f"{what} must be contiguous (the segment decodes to its bytes in order)")
    return dst.reshape(-1).view(torch.uint8)


def _check_encoded(encoded: torch.Tensor) -> None:
    if not isinstance(encoded, torch.Tensor):
        raise TypeError(f"encoded must be a torch.Tensor, got {type(encoded).__name__}")
    if encoded.dtype != torch.uint8 or encoded.dim() != 1 or not encoded.is_contiguous():
        raise ValueError(f"encoded must be a 1-D contiguous uint8 tensor, got {encoded.dtype} of shape "
                         f"{tuple(encoded.shape)}")


# --------------------------------------------------------------------------
# Pure-torch reference
# --------------------------------------------------------------------------
def decode_segment_ref(encoded: torch.Tensor, dst: torch.Tensor) -> None:
    """Reference decoder: whole-tensor torch integer ops on ``encoded``'s device.

    Checks everything the C++ decoder checks (header, block index, exception
    counts, codes past the table) and raises ValueError before writing ``dst``.
    """
    _check_encoded(encoded)
    h = parse_header(encoded, encoded.numel())
    out = _dst_bytes(dst)
    if out.numel() != h.n_bytes:
        raise ValueError(f"dst has {out.numel()} bytes but the segment decodes to {h.n_bytes}")
    if out.device != encoded.device:
        raise ValueError(f"dst is on {out.device} but the encoded segment on {encoded.device}")
    if not h.coded:
        out.copy_(encoded[h.off_raw : h.off_raw + h.n_bytes])
        return
    dev = encoded.device
    n = h.n_bytes // 2
    f_bits, width = h.field_bits, h.width
    esc = (1 << width) - 1
    i = torch.arange(n, device=dev, dtype=torch.int64)
    bitpos = i * f_bits
    byte = bitpos >> 3
    n_field_bytes = -(-(n * f_bits) // 8)
    fields = torch.cat([encoded[h.off_fields : h.off_fields + n_field_bytes].to(torch.int32),
                        torch.zeros(1, dtype=torch.int32, device=dev)])
    field = ((fields[byte] | (fields[byte + 1] << 8)) >> (bitpos & 7)) & ((1 << f_bits) - 1)
    code = field & esc
    extra = field >> width
    if bool(((code >= len(h.table)) & (code != esc)).any()):
        raise _bad(f"a code past the table's {len(h.table)} entries: corrupt encoded segment")
    table = torch.zeros(1 << width, dtype=torch.int32, device=dev)
    if h.table:
        table[: len(h.table)] = torch.tensor(h.table, dtype=torch.int32, device=dev)
    sym = table[code]
    is_exc = code == esc
    if int(is_exc.sum()) != h.n_exceptions:
        raise _bad(f"{int(is_exc.sum())} exception codes but the header counts {h.n_exceptions} exceptions: "
                   "corrupt encoded segment")
    # the block index: exceptions before each block
    nblocks = -(-n // BLOCK_VALUES)
    index = encoded[h.off_index : h.off_index + 4 * (nblocks + 1)].view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    per_block = torch.bincount(i[is_exc] // BLOCK_VALUES, minlength=nblocks)
    want = torch.cat([torch.zeros(1, dtype=torch.int64, device=dev), per_block.cumsum(0)])
    if not torch.equal(index, want):
        raise _bad("the block index does not match the exception codes: corrupt encoded segment")
    exc = encoded[h.off_exceptions : h.off_exceptions + h.n_exceptions].to(torch.int32)
    if bool((exc >= _SYMBOLS[1 if h.dtype == "bfloat16" else 2]).any()):
        raise _bad(f"an exception that is not a {h.dtype} exponent: corrupt encoded segment")
    sym[is_exc] = exc  # in value order: the k-th escape takes the k-th exception
    raw = encoded[h.off_raw : h.off_raw + n].to(torch.int32)
    if h.dtype == "bfloat16":  # s eeeeeeee mmmmmmm; raw byte = s mmmmmmm
        v = ((raw & 0x80) << 8) | (sym << 7) | (raw & 0x7F)
    else:  # s eeeee mm mmmmmmmm; extra = s m9 m8, raw byte = m7..m0
        v = ((extra & 4) << 13) | (sym << 10) | ((extra & 3) << 8) | raw
    v = v - ((v >> 15) << 16)  # into int16's range, same bits
    out.copy_(v.to(torch.int16).view(torch.uint8))


# --------------------------------------------------------------------------
# Triton kernel
# --------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _copy_stored(enc_ptr, dst_ptr, pid, limit, BLOCK: tl.constexpr, HEADER: tl.constexpr, FULL: tl.constexpr):
        """Bytes [pid * 2 * BLOCK, ...) of a stored segment: they follow the header."""
        offs = pid * (2 * BLOCK) + tl.arange(0, 2 * BLOCK)
        if FULL:  # no mask: 16-byte vector loads and stores (both bases are 16-byte aligned)
            tl.store(dst_ptr + offs, tl.load(enc_ptr + HEADER + offs))
        else:
            m = offs < limit
            tl.store(dst_ptr + offs, tl.load(enc_ptr + HEADER + offs, mask=m, other=0), mask=m)

    @triton.jit
    def _decode_values(enc_ptr, dst_ptr, pid, limit, dtype, width, fbits, n_exc, n_field_bytes, nblocks,
                       off_index, off_fields, off_raw, off_exc,
                       BLOCK: tl.constexpr, TABLE: tl.constexpr, BLOCK_VALUES: tl.constexpr, FULL: tl.constexpr):
        """Values [pid * BLOCK, (pid + 1) * BLOCK) of a coded segment, those below `limit`.

        FULL: the whole range is below `limit` and the header was checked (streams
        inside the buffer, the raw stream 16-byte aligned): no masks, so the raw
        bytes and the stores become vector accesses.
        """
        i = pid * BLOCK + tl.arange(0, BLOCK)
        # value i's field: bits [i * F, i * F + F) of the field stream, F <= 8: within two bytes
        bitpos = i * fbits
        byte = bitpos >> 3
        fields = enc_ptr + off_fields
        if FULL:
            m = i >= 0
            # byte + 1 may be one past the field stream (the last value): the raw stream follows, in bounds
            b0 = tl.load(fields + byte).to(tl.int32)
            b1 = tl.load(fields + byte + 1).to(tl.int32)
            raw = tl.load(tl.multiple_of(enc_ptr + off_raw, 16) + i).to(tl.int32)
        else:
            m = i < limit
            b0 = tl.load(fields + byte, mask=m, other=0).to(tl.int32)
            b1 = tl.load(fields + byte + 1, mask=m & (byte + 1 < n_field_bytes), other=0).to(tl.int32)
            raw = tl.load(enc_ptr + off_raw + i, mask=m, other=0).to(tl.int32)
        field = ((b0 | (b1 << 8)) >> (bitpos & 7).to(tl.int32)) & ((1 << fbits) - 1)
        esc = (1 << width) - 1
        code = field & esc
        hi = field >> width
        sym = tl.load(enc_ptr + TABLE + code).to(tl.int32)  # code < 32: inside the header
        is_exc = (code == esc) & m
        # exceptions before this program's first block, and before the next program's
        idx = (enc_ptr + off_index).to(tl.pointer_type(tl.uint32))
        blk = pid * (BLOCK // BLOCK_VALUES)
        blk_end = tl.minimum(blk + BLOCK // BLOCK_VALUES, nblocks)
        e0 = tl.load(idx + blk, mask=(limit > 0) & (blk <= nblocks), other=0).to(tl.int64)
        e1 = tl.load(idx + blk_end, mask=(limit > 0) & (blk <= nblocks), other=0).to(tl.int64)
        if e1 > e0:
            # the k-th escape of the program takes exception e0 + k: a prefix count, no positions stored
            rank = tl.cumsum(is_exc.to(tl.int32), axis=0) - 1
            ei = e0 + rank
            xm = is_exc & (ei >= 0) & (ei < n_exc)
            xs = tl.load(enc_ptr + off_exc + ei, mask=xm, other=0).to(tl.int32)
            sym = tl.where(is_exc, xs, sym)
        v_bf16 = ((raw & 0x80) << 8) | ((sym & 0xFF) << 7) | (raw & 0x7F)
        v_fp16 = ((hi & 4) << 13) | ((sym & 0x1F) << 10) | ((hi & 3) << 8) | raw
        v = tl.where(dtype == 1, v_bf16, v_fp16)
        v = (v - ((v >> 15) << 16)).to(tl.int16)  # into int16's range, same bits
        out = dst_ptr.to(tl.pointer_type(tl.int16)) + i
        if FULL:
            tl.store(out, v)
        else:
            tl.store(out, v, mask=m)

    @triton.jit
    def _decode_kernel(enc_ptr, enc_len, dst_ptr, dst_len, BLOCK: tl.constexpr, HEADER: tl.constexpr,
                       TABLE: tl.constexpr, BLOCK_VALUES: tl.constexpr, MAGIC_INT: tl.constexpr):
        """One program decodes values [pid * BLOCK, (pid + 1) * BLOCK) of a coded
        segment, or copies bytes [pid * 2 * BLOCK, ...) of a stored one."""
        pid = tl.program_id(0).to(tl.int64)
        # The header, read by every program (cached): 16-byte aligned base (checked by the launcher).
        h32 = enc_ptr.to(tl.pointer_type(tl.int32))
        h64 = enc_ptr.to(tl.pointer_type(tl.int64))
        magic = tl.load(h32)
        info = tl.load(h32 + 1)  # version, dtype, mode, width
        info2 = tl.load(h32 + 2)  # field bits, log2 block, table size, reserved
        version = info & 0xFF
        dtype = (info >> 8) & 0xFF
        mode = (info >> 16) & 0xFF
        width = (info >> 24) & 0xFF
        fbits = info2 & 0xFF
        log2b = (info2 >> 8) & 0xFF
        n_bytes = tl.load(h64 + 2)
        n_exc = tl.load(h64 + 3)
        total = tl.load(h64 + 4)
        off_index = tl.load(h64 + 5)
        off_fields = tl.load(h64 + 6)
        off_raw = tl.load(h64 + 7)
        off_exc = tl.load(h64 + 8)
        ok = (magic == MAGIC_INT) & (version == 1) & (n_bytes == dst_len) & (total == enc_len)
        # A condition that fails folds into a bound of 0: nothing is read or written.
        # (Scalar conditions become bounds because `vector & scalar` is int32 in the interpreter.)
        if mode == 0:
            ok_stored = ok & (off_raw == HEADER) & (n_bytes >= 0) & (n_bytes <= enc_len - HEADER)
            s_limit = tl.where(ok_stored, n_bytes, 0)
            if (pid + 1) * (2 * BLOCK) <= s_limit:
                _copy_stored(enc_ptr, dst_ptr, pid, s_limit, BLOCK, HEADER, True)
            else:
                _copy_stored(enc_ptr, dst_ptr, pid, s_limit, BLOCK, HEADER, False)
        else:
            nv = n_bytes // 2
            nblocks = (nv + BLOCK_VALUES - 1) // BLOCK_VALUES
            n_field_bytes = (nv * fbits + 7) // 8
            extra = tl.where(dtype == 2, 3, 0)
            # Every stream must lie inside the buffer (the loads are masked to them or, FULL, proven
            # inside). Upper bounds are written `off <= enc_len - size`: nv, n_field_bytes and enc_len
            # are small (nv is the destination's size), so nothing overflows whatever the header says.
            ok_coded = (ok & (mode == 1) & ((dtype == 1) | (dtype == 2)) & (width >= 1) & (width <= 5)
                        & (fbits == width + extra) & (log2b == 10) & (nv >= 1) & (n_bytes % 2 == 0)
                        & (n_exc >= 0) & (n_exc <= nv) & (off_index == HEADER)
                        & (off_fields >= HEADER + 4 * (nblocks + 1)) & (off_fields <= enc_len - n_field_bytes)
                        & (off_raw >= off_fields + n_field_bytes) & (off_raw <= enc_len - nv) & (off_raw % 16 == 0)
                        & (off_exc >= off_raw + nv) & (off_exc <= enc_len - n_exc))
            limit = tl.where(ok_coded, nv, 0)
            if (pid + 1) * BLOCK <= limit:
                _decode_values(enc_ptr, dst_ptr, pid, limit, dtype, width, fbits, n_exc, n_field_bytes, nblocks,
                               off_index, off_fields, off_raw, off_exc, BLOCK, TABLE, BLOCK_VALUES, True)
            else:
                _decode_values(enc_ptr, dst_ptr, pid, limit, dtype, width, fbits, n_exc, n_field_bytes, nblocks,
                               off_index, off_fields, off_raw, off_exc, BLOCK, TABLE, BLOCK_VALUES, False)

else:  # pragma: no cover - without triton
    _decode_kernel = None


# --------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------
def _require_triton() -> None:
    if triton is None:
        raise ImportError(
            "the Triton decode path needs the 'triton' package, which could not be imported "
            f"({_TRITON_IMPORT_ERROR!r}); install triton or use decode_segment_ref"
        )


def _launch(encoded: torch.Tensor, out: torch.Tensor, block: int) -> None:
    """Check what can be checked without reading device memory, then launch once."""
    _require_triton()
    if not isinstance(block, int) or block < BLOCK_VALUES or block % BLOCK_VALUES or block & (block - 1):
        raise ValueError(f"block must be a power of two multiple of {BLOCK_VALUES}, got {block!r}")
    if out.device != encoded.device:
        raise ValueError(f"dst is on {out.device} but the encoded segment on {encoded.device}")
    if _INTERPRET:
        if encoded.device.type != "cpu":
            raise RuntimeError("TRITON_INTERPRET=1 is set: the interpreted decode kernel only supports CPU tensors")
    elif encoded.device.type != "cuda":
        raise RuntimeError(
            f"the Triton decode kernel needs CUDA tensors (got {encoded.device}); set TRITON_INTERPRET=1 before "
            "importing to run it on CPU, or decode on the host with layerwise.codec.decode"
        )
    if encoded.numel() < HEADER_BYTES:
        raise ValueError(f"layerwise codec: encoded segment has {encoded.numel()} bytes, fewer than its "
                         f"{HEADER_BYTES}-byte header (truncated?)")
    if encoded.data_ptr() % ALIGN:
        raise ValueError(f"the encoded segment must start at a {ALIGN}-byte aligned address (the kernel reads its "
                         f"header as 8-byte words); got one at {encoded.data_ptr():#x}")
    if out.data_ptr() % 2:
        raise ValueError("dst must start at an even address (values are stored as 16-bit words)")
    grid = -(-out.numel() // (2 * block))
    if grid == 0:
        return  # nothing to write
    kernel = _decode_kernel  # module global looked up per call (tests wrap it to count launches)
    args = (encoded, encoded.numel(), out, out.numel())
    meta = dict(BLOCK=block, HEADER=HEADER_BYTES, TABLE=TABLE_OFFSET, BLOCK_VALUES=BLOCK_VALUES,
                MAGIC_INT=MAGIC_INT, num_warps=4)
    if encoded.device.type == "cuda":
        with torch.cuda.device(encoded.device):
            kernel[(grid,)](*args, **meta)
    else:
        kernel[(grid,)](*args, **meta)


# --------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------
def decode_segment(encoded: torch.Tensor, dst: torch.Tensor, header: Optional[SegmentHeader] = None,
                   block: int = DEFAULT_BLOCK) -> None:
    """Decode the encoded segment ``encoded`` (1-D uint8, 16-byte aligned) into
    ``dst`` (contiguous, any dtype, exactly the decoded size in bytes) with one
    kernel launch on the current stream; nothing is synchronised.

    ``header`` (from :func:`parse_header` or ``layerwise.codec.read_header`` on
    the host copy, once) is checked against the sizes without touching device
    memory. Without it, a CPU segment (interpreter) is parsed and checked here;
    a CUDA segment is checked by the kernel only (memory-safe, silent).
    """
    _check_encoded(encoded)
    out = _dst_bytes(dst)
    if header is None and encoded.device.type == "cpu":
        header = parse_header(encoded, encoded.numel())
    if header is not None:
        if header.encoded_bytes != encoded.numel():
            raise ValueError(f"layerwise codec: header says the encoded segment has {header.encoded_bytes} bytes, "
                             f"the buffer has {encoded.numel()} (truncated, or not the whole segment)")
        if header.n_bytes != out.numel():
            raise ValueError(f"dst has {out.numel()} bytes but the segment decodes to {header.n_bytes}")
    _launch(encoded, out, block)


def triton_available_for(device) -> bool:
    """Whether the Triton kernel runs for tensors on ``device`` here."""
    if triton is None:
        return False
    device = torch.device(device)
    if device.type == "cuda":
        return not _INTERPRET
    if device.type == "cpu":
        return _INTERPRET
    return False
