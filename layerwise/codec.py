"""Lossless compression of 16-bit float segments for the transfer to the device.

A layer's bf16 (or fp16) segment crosses the host link encoded and is decoded
on the device, by a Triton kernel, straight into its slot; the CPU backend
decodes on the host. Lossless means every bit pattern: NaN payloads,
infinities, signed zeros and subnormals come back as they went in.

API (host tensors unless said otherwise)::

    enc = encode(tensor)                      # uint8 tensor: header + streams
    hdr = read_header(enc)                    # dict, checked (raises ValueError)
    out = decode(enc)                         # uint8 tensor of the original bytes
    decode(enc, out=dst)                      # into dst's bytes (any dtype, contiguous)
    decode_segment(enc_dev, dst_dev)          # dispatch: Triton on CUDA, C++ on CPU
    layerwise.triton_kernels.decode.decode_segment(enc_dev, dst_dev, header=...)
                                              # the kernel itself, one launch, no sync

The C++ side is ``csrc/codec.cpp`` (``layerwise._C.codec``; multi-threaded,
GIL released); ``decode_into(enc, n, dst, dst_n, threads)`` in ``csrc/codec.h``
is the same decoder for C++ callers (the CPU copy engine). The Triton kernel
and its pure-torch reference are ``triton_kernels/decode.py``.

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
BENCHMARKS.md): bf16 about 0.71x (W = 3), fp16 about 0.90x (W = 3).
"""
from __future__ import annotations

from typing import Optional

import torch

from ._native import codec as _codec

HEADER_BYTES = 128
BLOCK_VALUES = 1024
CODED_DTYPES = (torch.bfloat16, torch.float16)


def dtype_name(dtype: torch.dtype) -> str:
    """The codec's name of a torch dtype ("bfloat16", "float16": coded; others stored)."""
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


def encode(src: torch.Tensor, dtype: Optional[torch.dtype] = None, threads: int = 0) -> torch.Tensor:
    """Encode the contiguous host tensor ``src`` into a new 1-D uint8 tensor.

    ``dtype``: what the bytes hold (default ``src.dtype``; pass it when ``src``
    is a uint8 view of a segment). bf16 and fp16 are coded when that saves at
    least 3%, everything else is stored. ``threads`` <= 0: all hardware threads.
    """
    dtype = src.dtype if dtype is None else dtype
    name = dtype_name(dtype) if dtype in CODED_DTYPES else "bytes"
    return _codec.encode(_host_bytes(src, "src"), name, threads)


def read_header(encoded: torch.Tensor) -> dict:
    """The header of a whole encoded segment (host), checked against its length:
    dtype, mode ("coded" / "stored"), width, field_bits, table, n_bytes,
    n_exceptions, encoded_bytes and the stream offsets. Raises ValueError."""
    return _codec.read_header(_host_bytes(encoded, "encoded"))


def decode(encoded: torch.Tensor, out: Optional[torch.Tensor] = None, threads: int = 0) -> torch.Tensor:
    """Decode on the host (C++). Into ``out`` (contiguous, any dtype, exactly the
    decoded size in bytes) when given, else into a new uint8 tensor; returns it.
    Malformed input raises ValueError (no read outside ``encoded``)."""
    enc = _host_bytes(encoded, "encoded")
    if out is None:
        out = torch.empty(read_header(enc)["n_bytes"], dtype=torch.uint8)
    _codec.decode(enc, _host_bytes(out, "out"), threads)
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
