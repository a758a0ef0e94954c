"""Tests of the lossless codec's API and header (layerwise/codec/__init__.py): arguments,
stored segments, dispatch, Triton optional, and the header parsed in one place
per language (C++: csrc/codec/decode.cpp; Python: layerwise.codec.parse_header,
which the Triton launcher and the reference decoder use), both refusing an
encoding of format version 1. The chunk format itself (every dtype, every bit
pattern, malformed chunks, the AVX-512 and Triton decoders):
tests/codec/test_codec_v2.py. Both take their inputs, checks and the kernel
module under test from tests/helpers/codec.py.

Without CUDA the Triton kernel runs under the interpreter on CPU tensors
(TRITON_INTERPRET=1 is set below before the module is imported), so the inputs
it gets are kept small.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import struct  # noqa: E402
import sys  # noqa: E402
import warnings  # noqa: E402

import pytest  # noqa: E402

from layerwise import codec  # noqa: E402
from layerwise._native import codec as native  # noqa: E402

from helpers.codec import D, _load_by_path, assert_bitwise, bits, need_triton, poisoned_like, random_bits, weight_like  # noqa: E402

CODED = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.fixture(autouse=True)
def _quiet_numpy_casts():
    with warnings.catch_warnings():  # the interpreter casts with numpy
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def _set(enc, offset, value, size=8):
    enc = enc.clone()
    enc[offset : offset + size] = torch.tensor(list(int(value).to_bytes(size, "little")), dtype=torch.uint8)
    return enc


# --------------------------------------------------------------------------
# stored segments, arguments
# --------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", CODED, ids=str)
def test_random_bits_travel_as_they_are(dtype):
    """Bytes that do not shrink are stored: the 128-byte header, then the bytes as they are."""
    x = random_bits(10_000, dtype)
    enc = codec.encode(x)
    h = codec.read_header(enc)
    assert h["mode"] == "stored" and h["dtype"] == codec.dtype_name(dtype) and h["n_bytes"] == bits(x).numel()
    assert enc.numel() == -(-(128 + bits(x).numel()) // 16) * 16
    assert torch.equal(enc[128 : 128 + bits(x).numel()], bits(x))
    assert_bitwise(codec.decode(enc), x)
    ref = poisoned_like(x)
    D.decode_segment_ref(enc, ref)
    assert_bitwise(ref, x, "reference decode")


@pytest.mark.parametrize("dtype", [torch.float64, torch.int8, torch.uint8, torch.int32])
def test_other_dtypes_are_stored(dtype):
    x = torch.arange(1001).to(dtype)
    enc = codec.encode(x)
    h = codec.read_header(enc)
    assert h["mode"] == "stored" and h["dtype"] == "bytes" and h["n_bytes"] == x.numel() * x.element_size()
    assert_bitwise(codec.decode(enc), x)


def test_a_uint8_view_is_coded_only_with_its_dtype():
    x = weight_like(5000, torch.bfloat16)
    assert torch.equal(codec.encode(x), codec.encode(bits(x), dtype=torch.bfloat16))
    assert codec.read_header(codec.encode(x))["mode"] == "coded"
    assert codec.read_header(codec.encode(bits(x)))["mode"] == "stored"  # uint8: not coded


def test_decode_into_a_destination_of_another_size_raises():
    x = weight_like(3001, torch.float16)
    enc = codec.encode(x)
    out = torch.empty_like(x)
    assert codec.decode(enc, out) is out
    assert_bitwise(out, x)
    with pytest.raises(ValueError, match="decodes to"):
        codec.decode(enc, torch.empty(3000, dtype=torch.float16))


def test_bad_arguments():
    x = weight_like(100, torch.bfloat16)
    with pytest.raises(ValueError, match="not a whole number of 2-byte values"):
        native.encode(bits(x)[:7], "bfloat16", 1)
    with pytest.raises(ValueError, match="unknown dtype 'bfloat17'"):
        native.encode(bits(x), "bfloat17", 1)
    with pytest.raises(ValueError, match="uint8"):
        native.encode(x, "bfloat16", 1)
    with pytest.raises(ValueError, match="contiguous"):
        codec.encode(torch.zeros(4, 4, dtype=torch.bfloat16).t())
    with pytest.raises(TypeError, match="version"):  # one format: nothing to choose
        codec.encode(x, version=2)
    enc = codec.encode(x)
    with pytest.raises(ValueError, match="overlaps"):
        native.decode(enc, enc[:200], 1)
    with pytest.raises(ValueError, match="backend"):
        codec.decode_segment(enc, x, backend="cuda")
    with pytest.raises(ValueError, match="1-D contiguous uint8"):
        D.decode_segment(enc.view(torch.int16), x)


# --------------------------------------------------------------------------
# the header: one parser per language, the same checks
# --------------------------------------------------------------------------
def version_1_segment():
    """A stored segment of 32 bf16 values in format version 1, as its encoder wrote one:
    magic, version 1, dtype 1, mode 0 (stored), decoded and total sizes, the raw stream
    at byte 128 (its header's offset 56), then the bytes."""
    data = bits(torch.arange(32, dtype=torch.bfloat16))
    head = bytearray(128)
    head[0:4] = b"LWCS"
    head[4], head[5] = 1, 1
    struct.pack_into("<7Q", head, 16, data.numel(), 0, 128 + data.numel(), 0, 0, 128, 0)
    return torch.cat([torch.frombuffer(head, dtype=torch.uint8), data]), data


def test_version_1_is_refused_everywhere(device):
    """An encoding of format version 1 (which never outlives the process that made it) is
    refused by every decoder and by both header parsers with one message that says to
    encode again; the destination is left as it was."""
    enc, data = version_1_segment()
    match = "format version 1 is no longer supported; encodings never outlive the process: encode again"
    out = torch.full_like(data, 0xA5)
    with pytest.raises(ValueError, match=match):
        native.decode(enc, out, 1)
    with pytest.raises(ValueError, match=match):
        codec.decode(enc)
    with pytest.raises(ValueError, match=match):
        codec.read_header(enc)
    with pytest.raises(ValueError, match=match):
        codec.parse_header(enc, enc.numel())
    with pytest.raises(ValueError, match=match):
        D.decode_segment_ref(enc, out)
    for backend in ("native", "ref") + (("triton",) if D.triton_available_for("cpu") else ()):
        with pytest.raises(ValueError, match=match):
            codec.decode_segment(enc, out, backend=backend)
    assert bool((out == 0xA5).all())
    if D.triton_available_for(device):
        dev_out = torch.full_like(data, 0xA5).to(device)
        with pytest.raises(ValueError, match=match):
            D.decode_segment(enc.to(device), dev_out)
        assert bool((dev_out.cpu() == 0xA5).all())


def _header_cases():
    """Segments whose header is wrong in one way each, and the words of the error."""
    coded = codec.encode(weight_like(3000, torch.bfloat16), log2_chunk=10, log2_sub=5)
    stored = codec.encode(random_bits(100, torch.float32))
    h = codec.read_header(coded)
    assert h["mode"] == "coded" and codec.read_header(stored)["mode"] == "stored"
    bad_magic = coded.clone()
    bad_magic[0] = ord("X")
    return {
        "truncated header": (coded[:100], "fewer than its 128-byte header"),
        "truncated body": (coded[:-16].clone(), "truncated"),
        "wrong magic": (bad_magic, "magic 'LWCS'"),
        "version 1": (_set(coded, 4, 1, 1), "format version 1 is no longer supported"),
        "version 3": (_set(coded, 4, 3, 1), "format version 3; this build reads version 2"),
        "reserved byte": (_set(coded, 12, 1, 1), "reserved header byte"),
        "unknown dtype": (_set(coded, 5, 9, 1), "unknown dtype code 9"),
        "unknown mode": (_set(coded, 6, 4, 1), "unknown mode 4"),
        "coded bytes": (_set(coded, 5, 0, 1), "that dtype is only stored"),
        "chunk size": (_set(coded, 7, 30, 1), "out of range"),
        "longest code": (_set(coded, 9, 15, 1), "longest code 15"),
        "chunk count": (_set(coded, 24, h["n_chunks"] + 1), "chunks for"),
        "part of a value": (_set(coded, 16, h["n_bytes"] + 1), "not whole bfloat16 values"),
        "data offset": (_set(coded, 48, h["off_data"] + 16), "chunk index at"),
        "stored with a chunk count": (_set(stored, 24, 1), "stored segment with code fields"),
        "stored size": (_set(stored, 16, 400 + 16), "stored segment of"),
    }


@pytest.mark.parametrize("case", list(_header_cases()))
def test_both_header_parsers_refuse_the_same_headers(case):
    """The C++ parser (behind every C++ decode) and the Python one (behind read_header,
    the reference decoder and the Triton launcher) refuse each broken header, with the
    same words."""
    enc, match = _header_cases()[case]
    with pytest.raises(ValueError, match=match):
        native.decode(enc, torch.empty(6000, dtype=torch.uint8), 1)
    with pytest.raises(ValueError, match=match):
        codec.parse_header(enc, enc.numel())
    with pytest.raises(ValueError, match=match):
        D.decode_segment_ref(enc, torch.empty(6000, dtype=torch.uint8))


def test_the_parsed_header_gives_the_layout():
    """parse_header's fields are the layout the format gives (chunk index at 128, the data
    after one 64-byte entry per chunk; stored: the bytes at 128), and read_header is the
    same as a dict."""
    for x, kw in ((weight_like(5000, torch.bfloat16), dict(log2_chunk=10, log2_sub=5)),
                  (weight_like(70_000, torch.float32), {}), (random_bits(10, torch.bfloat16), {}),
                  (torch.arange(5, dtype=torch.int8), {}), (torch.empty(0, dtype=torch.bfloat16), {})):
        enc = codec.encode(x, **kw)
        h = codec.parse_header(enc, enc.numel())
        assert h == codec.parse_header(bytes(enc[:128].tolist()))  # bytes or a tensor
        n = x.numel() * x.element_size()
        assert (h.n_bytes, h.encoded_bytes) == (n, enc.numel()) and enc.numel() % 16 == 0
        if h.coded:
            chunk = 1 << kw.get("log2_chunk", codec.LOG2_CHUNK)
            assert (h.dtype, h.log2_chunk, h.log2_sub) == (
                codec.dtype_name(x.dtype), kw.get("log2_chunk", codec.LOG2_CHUNK), kw.get("log2_sub", codec.LOG2_SUB))
            assert h.n_chunks == -(-x.numel() // chunk) and h.off_index == 128
            assert h.off_data == -(-(128 + 64 * h.n_chunks) // 16) * 16
        else:
            assert (h.n_chunks, h.off_index, h.off_data, h.log2_chunk, h.log2_sub) == (0, 0, 128, 0, 0)
        assert codec.read_header(enc) == {
            "version": 2, "dtype": h.dtype, "mode": "coded" if h.coded else "stored",
            "chunk_values": 1 << h.log2_chunk if h.coded else 0, "sub_values": 1 << h.log2_sub if h.coded else 0,
            "max_code_bits": 12 if h.coded else 0, "n_bytes": h.n_bytes, "n_chunks": h.n_chunks,
            "encoded_bytes": h.encoded_bytes, "off_index": h.off_index, "off_data": h.off_data}


def test_triton_header_argument(device):
    """decode_segment takes the header parsed on the host and checks it against the
    buffers' sizes before launching."""
    need_triton(device)
    x = weight_like(3000, torch.bfloat16)
    enc = codec.encode(x, log2_chunk=10, log2_sub=5)
    header = codec.parse_header(enc, enc.numel())
    out = torch.empty_like(x, device=device)
    D.decode_segment(enc.to(device), out, header=header)
    assert_bitwise(out, x)
    with pytest.raises(ValueError, match="header is for"):
        D.decode_segment(enc.to(device), out[:-1], header=header)
    with pytest.raises(ValueError, match="header is for"):
        D.decode_segment(enc[:-16].clone().to(device), out, header=header)


# --------------------------------------------------------------------------
# optional triton
# --------------------------------------------------------------------------
def test_import_without_triton(monkeypatch):
    for name in [m for m in sys.modules if m == "triton" or m.startswith("triton.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "triton", None)
    mod = _load_by_path()
    assert mod.triton is None and mod._decode_kernel is None and not mod.triton_available_for("cuda")
    x = weight_like(2000, torch.bfloat16)
    enc = codec.encode(x, log2_chunk=10, log2_sub=5)
    assert codec.read_header(enc)["mode"] == "coded"
    out = torch.empty_like(x)
    mod.decode_segment_ref(enc, out)
    assert_bitwise(out, x)
    with pytest.raises(ImportError, match="triton"):
        mod.decode_segment(enc, out)
