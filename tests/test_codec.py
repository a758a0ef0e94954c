"""Tests of the lossless codec's format version 1 (layerwise/codec.py; what
``encode(..., version=1)`` writes and every decoder still reads): the C++
encoder/decoder (csrc/codec.cpp, layerwise._C.codec), the pure-torch reference
and the Triton kernel (triton_kernels/decode.py). Version 2 (the default):
tests/test_codec_v2.py.

Every decoder is checked bitwise against the input (NaN payloads included) and
against each other. Without CUDA the Triton kernel runs under the interpreter
on CPU tensors (TRITON_INTERPRET=1 is set below before the module is
imported), so the inputs it gets are kept small.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import importlib.util  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
import uuid  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from layerwise import codec  # noqa: E402
from layerwise._native import codec as native  # noqa: E402

DECODE_PY = Path(__file__).resolve().parents[1] / "triton_kernels" / "decode.py"


def encode1(*args, **kwargs):
    """The version-1 encoder (the default writes version 2)."""
    return codec.encode(*args, version=1, **kwargs)
MODULE = "layerwise.triton_kernels.decode"


def _load_by_path(name=None):
    name = name or f"_decode_under_test_{uuid.uuid4().hex}"
    spec = importlib.util.spec_from_file_location(name, DECODE_PY)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _load():
    """The kernel module of this checkout, interpreted when there is no GPU.

    layerwise.triton_kernels may resolve to another checkout (an editable
    install made elsewhere): then this file's module is loaded by path and
    registered under the package name, so layerwise.codec's dispatch finds it.
    """
    try:
        from layerwise.triton_kernels import decode as mod
    except ImportError:
        mod = None
    if (mod is None or Path(mod.__file__).resolve() != DECODE_PY
            or (os.environ.get("TRITON_INTERPRET") == "1" and not mod._INTERPRET)):
        mod = _load_by_path(MODULE)
    return mod


D = _load()
INT16 = torch.int16
DTYPES = [torch.bfloat16, torch.float16]
IDS = {torch.bfloat16: "bf16", torch.float16: "fp16"}


# --------------------------------------------------------------------------
# inputs
# --------------------------------------------------------------------------
def weight_like(n, dtype, seed=0, cols=256, outliers=1e-4):
    """Rows of normal values with log-normal per-row scales and a few large outliers."""
    g = torch.Generator().manual_seed(seed)
    rows = -(-n // cols)
    scale = torch.exp(torch.randn(rows, 1, generator=g) * 0.5) * 0.02
    w = (torch.randn(rows, cols, generator=g) * scale).view(-1)[:n].clone()
    k = max(1, int(n * outliers)) if n else 0
    w[torch.randint(0, max(n, 1), (k,), generator=g)] *= 50
    return w.to(dtype)


def random_bits(n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**15), 2**15, (n,), generator=g, dtype=torch.int32).to(INT16).view(dtype)


def specials(dtype):
    """Bit patterns a float codec likes to lose: NaN payloads, infinities, signed zeros, subnormals."""
    if dtype == torch.bfloat16:
        bits = [0x7FC0, 0x7FC1, 0x7F81, 0xFFFF, 0xFFC0, 0x7FFF, 0x7F80, 0xFF80, 0x0000, 0x8000, 0x0001, 0x8001,
                0x007F, 0x807F, 0x0080, 0x7F7F, 0xFF7F, 0x3F80]
    else:
        bits = [0x7E00, 0x7E01, 0x7C01, 0xFFFF, 0xFE00, 0x7FFF, 0x7C00, 0xFC00, 0x0000, 0x8000, 0x0001, 0x8001,
                0x03FF, 0x83FF, 0x0400, 0x7BFF, 0xFBFF, 0x3C00]
    return torch.tensor(bits, dtype=torch.int32).to(INT16).view(dtype)


def with_specials(n, dtype, seed=0):
    """Weight-like values with the special patterns sprinkled in (still coded)."""
    x = weight_like(n, dtype, seed).clone()
    sp = specials(dtype)
    if n:
        pos = torch.arange(0, n, 37)[: 4 * sp.numel()]
        x[pos] = sp.repeat(4)[: pos.numel()]
    return x


def every_pattern(dtype, extra=None):
    """All 65536 bit patterns, shuffled among `extra` times as many weight-like values: enough
    that the segment is still coded (fp16 saves at most 2 of 16 bits: it needs more of them)."""
    extra = extra or {torch.bfloat16: 1, torch.float16: 7}[dtype]
    g = torch.Generator().manual_seed(11)
    allbits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(INT16).view(dtype)
    x = torch.cat([allbits, weight_like(extra * 65536, dtype, seed=3)])
    return x[torch.randperm(x.numel(), generator=g)]


def bits(t):
    return t.contiguous().view(-1).view(torch.uint8)


def assert_bitwise(got, want, what=""):
    a, b = bits(got).cpu(), bits(want).cpu()
    assert a.numel() == b.numel(), f"{what}: {a.numel()} bytes vs {b.numel()}"
    if not torch.equal(a, b):
        bad = (a != b).nonzero().view(-1)[:8].tolist()
        raise AssertionError(f"{what}: bytes differ, first at {bad}: {a[bad].tolist()} vs {b[bad].tolist()}")


def poisoned_like(x):
    return torch.full((x.numel() * x.element_size(),), 0xA5, dtype=torch.uint8)


def roundtrip_cpu(x, threads=0):
    """Encode with C++, decode with C++ and with the reference; both bitwise equal to x."""
    enc = encode1(x, threads=threads)
    out = codec.decode(enc, threads=threads)
    assert_bitwise(out, x, "C++ decode")
    ref = poisoned_like(x)
    D.decode_segment_ref(enc, ref)
    assert_bitwise(ref, x, "reference decode")
    return enc


def need_triton(device):
    if not D.triton_available_for(device):
        pytest.skip(f"the Triton path does not run on {device} here (triton missing or TRITON_INTERPRET unset)")


@pytest.fixture(params=["cpu", "cuda"])
def device(request):
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("CUDA is not available")
    return request.param


@pytest.fixture(autouse=True)
def _quiet_numpy_casts():
    with warnings.catch_warnings():  # the interpreter casts with numpy
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def triton_decode(enc, x, device, block=D.DEFAULT_BLOCK):
    """Decode with the kernel on `device` into a poisoned destination; bitwise equal to x."""
    enc_d = enc.to(device)
    out = poisoned_like(x).to(device)
    D.decode_segment(enc_d, out, block=block)
    assert_bitwise(out, x, f"Triton decode on {device} (block {block})")
    return out


# --------------------------------------------------------------------------
# round trips (C++ encode -> C++ decode, reference decode)
# --------------------------------------------------------------------------
SIZES = [0, 1, 2, 7, 1023, 1024, 1025, 2047, 3000, 70001]


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
@pytest.mark.parametrize("n", SIZES)
def test_roundtrip_sizes(dtype, n):
    for make in (weight_like, with_specials, random_bits):
        roundtrip_cpu(make(n, dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
def test_every_bit_pattern_coded(dtype):
    x = every_pattern(dtype)
    enc = roundtrip_cpu(x)
    assert codec.read_header(enc)["mode"] == "coded"  # every pattern went through the code path


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
def test_every_bit_pattern_alone_is_stored(dtype):
    allbits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(INT16).view(dtype)
    enc = roundtrip_cpu(allbits)
    assert codec.read_header(enc)["mode"] == "stored"


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
def test_specials_are_coded_and_exact(dtype):
    x = with_specials(5000, dtype)
    enc = roundtrip_cpu(x)
    h = codec.read_header(enc)
    assert h["mode"] == "coded" and h["n_exceptions"] > 0


def test_ratio_weight_like_bf16():
    x = weight_like(1024 * 1024, torch.bfloat16, cols=1024)
    enc = roundtrip_cpu(x)
    ratio = enc.numel() / (2 * x.numel())
    assert ratio <= 0.80, ratio


def test_ratio_weight_like_fp16():
    x = weight_like(1024 * 1024, torch.float16, cols=1024)
    enc = roundtrip_cpu(x)
    ratio = enc.numel() / (2 * x.numel())
    assert ratio <= 0.95, ratio


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
def test_random_bits_travel_raw(dtype):
    x = random_bits(100_000, dtype)
    enc = roundtrip_cpu(x)
    h = codec.read_header(enc)
    assert h["mode"] == "stored" and h["dtype"] == codec.dtype_name(dtype)
    assert enc.numel() == -(-(128 + 2 * x.numel()) // 16) * 16
    assert torch.equal(enc[128 : 128 + 2 * x.numel()], bits(x))  # the bytes as they are


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8, torch.uint8, torch.float64])
def test_other_dtypes_are_stored(dtype):
    x = torch.arange(1001).to(dtype)
    enc = roundtrip_cpu(x)
    h = codec.read_header(enc)
    assert h["mode"] == "stored" and h["dtype"] == "bytes" and h["n_bytes"] == x.numel() * x.element_size()


def test_uint8_view_with_dtype_argument():
    x = weight_like(5000, torch.bfloat16)
    a = encode1(x)
    b = encode1(bits(x), dtype=torch.bfloat16)
    assert torch.equal(a, b)
    assert codec.read_header(encode1(bits(x)))["mode"] == "stored"  # uint8: not coded


def test_decode_into_any_dtype_destination():
    x = weight_like(3001, torch.float16)
    enc = encode1(x)
    out = torch.empty_like(x)
    assert codec.decode(enc, out) is out
    assert_bitwise(out, x)
    with pytest.raises(ValueError, match="decodes to"):
        codec.decode(enc, torch.empty(3000, dtype=torch.float16))


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
def test_threads_give_identical_bytes(dtype):
    x = with_specials(300_000, dtype)  # ~290 blocks: two threads get work
    encs = [encode1(x, threads=t) for t in (1, 2, 0)]
    assert all(torch.equal(encs[0], e) for e in encs[1:])
    for t in (1, 2, 0):
        assert_bitwise(codec.decode(encs[0], threads=t), x, f"{t} threads")


def test_encoder_picks_the_smallest_width():
    # exponents spread over ~7 values: W = 3; over 2: W = 1 needs exceptions, 2 does not
    x = weight_like(1 << 16, torch.bfloat16)
    h = codec.read_header(encode1(x))
    assert h["mode"] == "coded" and h["width"] == 3 and len(h["table"]) == 7
    one = torch.tensor([1.0, -1.5], dtype=torch.bfloat16).repeat(5000)  # one exponent: W = 1
    h = codec.read_header(roundtrip_cpu(one))
    assert (h["width"], h["table"], h["n_exceptions"]) == (1, [127], 0)
    two = torch.tensor([1.0, 2.0], dtype=torch.bfloat16).repeat(5000)  # W = 1 would need 5000 exceptions
    h = codec.read_header(roundtrip_cpu(two))
    assert (h["width"], sorted(h["table"]), h["n_exceptions"]) == (2, [127, 128], 0)


def test_header_fields_match_the_python_parser():
    for x in (weight_like(4000, torch.bfloat16), weight_like(4000, torch.float16), random_bits(10, torch.bfloat16),
              torch.arange(5, dtype=torch.float32), torch.empty(0, dtype=torch.bfloat16)):
        enc = encode1(x)
        c = codec.read_header(enc)
        p = D.parse_header(enc, enc.numel())
        assert (p.dtype, "coded" if p.coded else "stored", p.width, p.field_bits, list(p.table), p.n_bytes,
                p.n_exceptions, p.encoded_bytes, p.off_index, p.off_fields, p.off_raw, p.off_exceptions) == (
            c["dtype"], c["mode"], c["width"], c["field_bits"], c["table"], c["n_bytes"], c["n_exceptions"],
            c["encoded_bytes"], c["off_index"], c["off_fields"], c["off_raw"], c["off_exceptions"])
        assert enc.numel() % 16 == 0 and p.encoded_bytes == enc.numel()
        if p.coded:  # the layout the format docstring gives
            assert (p.off_index, p.off_fields, p.off_raw, p.off_exceptions, p.encoded_bytes) == D.coded_layout(
                p.n_bytes // 2, p.field_bits, p.n_exceptions)


# --------------------------------------------------------------------------
# malformed input: a clear error, no read outside the buffer
# --------------------------------------------------------------------------
def _coded(dtype=torch.bfloat16, n=5000):
    enc = encode1(with_specials(n, dtype))
    assert codec.read_header(enc)["mode"] == "coded"
    return enc


def _set(enc, offset, value, size=8):
    enc = enc.clone()
    enc[offset : offset + size] = torch.tensor(list(int(value).to_bytes(size, "little")), dtype=torch.uint8)
    return enc


def _malformed():
    enc = _coded()
    h = codec.read_header(enc)
    nblocks = -(-h["n_bytes"] // 2 // 1024)
    bad_magic = enc.clone()
    bad_magic[0] = ord("X")
    index_non_monotone = _set(enc, h["off_index"] + 4, 10**6, 4)
    index_total = _set(enc, h["off_index"] + 4 * nblocks, h["n_exceptions"] - 1, 4)
    # the escape code in a value that had a table code: the block holds one exception more than its index says
    fields = enc.clone()
    first = int(fields[h["off_fields"]])
    esc = (1 << h["width"]) - 1
    code0 = first & ((1 << h["field_bits"]) - 1) & esc
    fields[h["off_fields"]] = (first | esc) if code0 != esc else (first & ~esc)
    return {
        "truncated header": (enc[:100], "fewer than its 128-byte header"),
        "truncated body": (enc[:-16].clone(), "truncated"),
        "trailing bytes": (torch.cat([enc, torch.zeros(16, dtype=torch.uint8)]), "truncated, or not the whole"),
        "wrong magic": (bad_magic, "magic"),
        "wrong version": (_set(enc, 4, 9, 1), "version 9"),
        "unknown dtype": (_set(enc, 5, 7, 1), "dtype code 7"),
        "unknown mode": (_set(enc, 6, 5, 1), "mode 5"),
        "width too large": (_set(enc, 7, 7, 1), "code width 7"),
        "field bits": (_set(enc, 8, 2, 1), "field of 2 bits"),
        "block size": (_set(enc, 9, 12, 1), "block size 2\\^12"),
        "reserved byte": (_set(enc, 13, 1, 1), "reserved"),
        "decoded size": (_set(enc, 16, h["n_bytes"] + 2), "layout|decodes to"),
        "huge decoded size": (_set(enc, 16, 2**63), "values"),
        "exception count": (_set(enc, 24, h["n_exceptions"] + 1), "layout|exception index ends at"),
        "raw offset": (_set(enc, 56, h["off_raw"] + 16), "layout"),
        "offset past the end": (_set(enc, 64, 2**62), "layout"),
        "index not monotone": (index_non_monotone, "exception index entry"),
        "index total": (index_total, "exception index ends at|exception index entry"),
        "codes vs index": (fields, "exception codes but its index entry says"),
    }


MALFORMED = list(_malformed())


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_input_raises(case):
    enc, match = _malformed()[case]
    n_bytes = 10_000
    with pytest.raises(ValueError, match=match):
        native.decode(enc, torch.empty(n_bytes, dtype=torch.uint8), 1)
    with pytest.raises(ValueError):
        D.decode_segment_ref(enc, torch.empty(n_bytes, dtype=torch.uint8))


def test_code_past_the_table_raises():
    # five exponents, equally frequent: W = 3 with a table of 5; codes 5 and 6 are not in it
    vals = torch.tensor([1.0, 2.0, 4.0, 8.0, 16.0], dtype=torch.bfloat16).repeat(400)
    enc = encode1(vals)
    h = codec.read_header(enc)
    assert (h["width"], len(h["table"])) == (3, 5)
    bad = enc.clone()
    bad[h["off_fields"]] = (int(bad[h["off_fields"]]) & ~7) | 5
    with pytest.raises(ValueError, match="past the table"):
        codec.decode(bad)
    with pytest.raises(ValueError, match="past the table"):
        D.decode_segment_ref(bad, torch.empty(vals.numel() * 2, dtype=torch.uint8))


def test_fp16_exception_that_is_not_an_exponent_raises():
    enc = _coded(torch.float16)
    h = codec.read_header(enc)
    assert h["n_exceptions"] > 0
    bad = enc.clone()
    bad[h["off_exceptions"]] = 200
    with pytest.raises(ValueError, match="not a float16 exponent"):
        codec.decode(bad)


def test_random_corruption_never_crashes():
    """Flipped bytes anywhere: the C++ decoder raises ValueError or decodes something; never reads out of bounds
    (run under a sanitizer to be sure; here: no crash, and a checked header)."""
    rng = random.Random(5)
    encs = [_coded(torch.bfloat16, 3000), _coded(torch.float16, 3000), encode1(random_bits(300, torch.bfloat16))]
    outcomes = {"raised": 0, "decoded": 0}
    for k in range(600):
        enc = encs[k % len(encs)].clone()
        for _ in range(rng.randint(1, 4)):
            pos = rng.randrange(0, 128) if rng.random() < 0.5 else rng.randrange(0, enc.numel())
            enc[pos] = rng.randrange(256)
        dst = torch.empty(int.from_bytes(bytes(enc[16:24].tolist()), "little") % (1 << 20), dtype=torch.uint8)
        try:
            native.decode(enc, dst, 1)
            outcomes["decoded"] += 1
        except ValueError:
            outcomes["raised"] += 1
    assert outcomes["raised"] > 0 and outcomes["decoded"] > 0, outcomes


def test_bad_arguments():
    x = weight_like(100, torch.bfloat16)
    with pytest.raises(ValueError, match="not a whole number of 2-byte values"):
        native.encode(bits(x)[:7], "bfloat16", 1)
    with pytest.raises(ValueError, match="unknown dtype 'bfloat17'"):
        native.encode(bits(x), "bfloat17", 1)
    with pytest.raises(ValueError, match="uint8"):
        native.encode(x, "bfloat16", 1)
    with pytest.raises(ValueError, match="contiguous"):
        encode1(torch.zeros(4, 4, dtype=torch.bfloat16).t())
    enc = encode1(x)
    with pytest.raises(ValueError, match="overlaps"):
        native.decode(enc, enc[:200], 1)
    with pytest.raises(ValueError, match="backend"):
        codec.decode_segment(enc, x, backend="cuda")


# --------------------------------------------------------------------------
# Triton kernel (interpreter on CPU, compiled on CUDA): bitwise against the input,
# the reference and the C++ decoder
# --------------------------------------------------------------------------
TRITON_SIZES = [0, 1, 1023, 1025, 2049]


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
def test_triton_sizes(device, dtype):
    need_triton(device)
    for n in TRITON_SIZES:
        for make in (weight_like, with_specials, random_bits):
            x = make(n, dtype)
            enc = encode1(x)
            triton_decode(enc, x, device)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
def test_triton_every_bit_pattern(device, dtype):
    need_triton(device)
    x = every_pattern(dtype)
    enc = encode1(x)
    assert codec.read_header(enc)["mode"] == "coded"
    out = triton_decode(enc, x, device)
    ref = poisoned_like(x)
    D.decode_segment_ref(enc, ref)
    assert_bitwise(out, ref, "Triton vs reference")
    assert_bitwise(out, codec.decode(enc), "Triton vs C++")


@pytest.mark.parametrize("block", [2048, 4096])
def test_triton_programs_spanning_several_index_blocks(device, block):
    need_triton(device)
    x = with_specials(3 * 4096 + 5, torch.bfloat16, seed=2)
    enc = encode1(x)
    assert codec.read_header(enc)["n_exceptions"] > 0
    triton_decode(enc, x, device, block=block)


def test_triton_widths(device):
    """Every code width the encoder can pick, both dtypes."""
    need_triton(device)
    seen = set()
    for dtype in DTYPES:
        for spread in (0.0, 0.3, 1.5, 4.0):
            g = torch.Generator().manual_seed(int(spread * 10))
            x = (torch.randn(4000, generator=g) * torch.exp(torch.randn(4000, generator=g) * spread)).to(dtype)
            if spread == 0.0:
                x = torch.tensor([1.0, -1.5], dtype=dtype).repeat(2000)
            enc = encode1(x)
            h = codec.read_header(enc)
            seen.add((IDS[dtype], h["mode"], h["width"]))
            triton_decode(enc, x, device)
    assert {w for _, m, w in seen if m == "coded"} >= {1, 3, 4}, seen


class _CountingKernel:
    def __init__(self, kernel):
        self.kernel, self.launches, self.grids = kernel, 0, []

    def __getitem__(self, grid):
        launcher = self.kernel[grid]

        def launch(*args, **kwargs):
            self.launches += 1
            self.grids.append(grid)
            return launcher(*args, **kwargs)

        return launch


def test_one_launch_per_segment(device, monkeypatch):
    need_triton(device)
    counter = _CountingKernel(D._decode_kernel)
    monkeypatch.setattr(D, "_decode_kernel", counter)
    x = with_specials(5000, torch.float16)
    enc = encode1(x).to(device)
    out = torch.empty(5000, dtype=torch.float16, device=device)
    D.decode_segment(enc, out)
    assert counter.launches == 1 and counter.grids[-1] == (-(-5000 // D.DEFAULT_BLOCK),)
    D.decode_segment(encode1(x[:0]).to(device), out[:0])
    assert counter.launches == 1  # empty: nothing to launch
    with pytest.raises(ValueError, match="decodes to"):
        D.decode_segment(enc, out[:10], header=D.parse_header(enc.cpu()))
    assert counter.launches == 1  # bad input: no launch
    assert_bitwise(out, x)


def test_triton_header_argument(device):
    need_triton(device)
    x = weight_like(3000, torch.bfloat16)
    enc = encode1(x)
    header = D.parse_header(enc, enc.numel())
    out = torch.empty_like(x, device=device)
    D.decode_segment(enc.to(device), out, header=header)
    assert_bitwise(out, x)
    with pytest.raises(ValueError, match="decodes to"):
        D.decode_segment(enc.to(device), out[:-1], header=header)
    with pytest.raises(ValueError, match="not the whole segment"):
        D.decode_segment(enc[:-16].clone().to(device), out, header=header)


def test_kernel_guards_itself_against_bad_headers(device):
    """Launched without host checks, the kernel writes nothing when the header does
    not fit the buffer or the destination (and reads nothing outside the buffer)."""
    need_triton(device)
    x = with_specials(3000, torch.bfloat16)
    enc = encode1(x)
    h = codec.read_header(enc)
    cases = {
        "magic": _set(enc, 0, 0, 4),
        "decoded size": _set(enc, 16, h["n_bytes"] + 2),
        "encoded size": _set(enc, 32, h["encoded_bytes"] + 16),
        "raw offset past the end": _set(enc, 56, 2**40),
        "exceptions past the end": _set(enc, 64, h["encoded_bytes"]),
        "huge exception count": _set(enc, 24, 2**40),
        "negative field offset": _set(enc, 48, 2**64 - 16),
        "raw offset that overflows": _set(enc, 56, 2**63 - 16),
        "exception offset that overflows": _set(enc, 64, 2**63 - 16),
        "width": _set(enc, 7, 6, 1),
    }
    for what, bad in cases.items():
        out = poisoned_like(x).to(device)
        D._launch(bad.to(device), out, D.DEFAULT_BLOCK)
        assert torch.equal(out.cpu(), poisoned_like(x)), f"{what}: the kernel wrote"
    stored = encode1(random_bits(100, torch.bfloat16))
    out = poisoned_like(torch.empty(100, dtype=torch.bfloat16)).to(device)
    D._launch(_set(stored, 16, 10**9).to(device), out, D.DEFAULT_BLOCK)
    assert torch.equal(out.cpu(), poisoned_like(torch.empty(100, dtype=torch.bfloat16)))


def test_launcher_checks(device):
    need_triton(device)
    enc = encode1(weight_like(100, torch.bfloat16)).to(device)
    out = torch.empty(100, dtype=torch.bfloat16, device=device)
    with pytest.raises(ValueError, match="block"):
        D._launch(enc, out.view(torch.uint8), block=1000)
    with pytest.raises(ValueError, match="16-byte aligned"):
        D._launch(torch.cat([enc[:1], enc])[1:], out.view(torch.uint8), D.DEFAULT_BLOCK)
    with pytest.raises(ValueError, match="fewer than its 128-byte header"):
        D._launch(enc[:64], out.view(torch.uint8), D.DEFAULT_BLOCK)
    with pytest.raises(ValueError, match="1-D contiguous uint8"):
        D.decode_segment(enc.view(torch.int16), out)


# --------------------------------------------------------------------------
# dispatch and optional triton
# --------------------------------------------------------------------------
def test_dispatch_on_cpu():
    x = with_specials(2000, torch.bfloat16)
    enc = encode1(x)
    for backend in ("auto", "native", "ref"):
        out = torch.empty_like(x)
        ran = codec.decode_segment(enc, out, backend=backend)
        assert ran == ("native" if backend == "auto" else backend)
        assert_bitwise(out, x, backend)
    if D.triton_available_for("cpu"):
        out = torch.empty_like(x)
        assert codec.decode_segment(enc, out, backend="triton") == "triton"
        assert_bitwise(out, x, "triton")


def test_import_without_triton(monkeypatch):
    for name in [m for m in sys.modules if m == "triton" or m.startswith("triton.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "triton", None)
    mod = _load_by_path()
    assert mod.triton is None and mod._decode_kernel is None and not mod.triton_available_for("cuda")
    x = with_specials(1500, torch.float16)
    out = torch.empty_like(x)
    mod.decode_segment_ref(encode1(x), out)
    assert_bitwise(out, x)
    with pytest.raises(ImportError, match="triton"):
        mod.decode_segment(encode1(x), out)


_COMPILE_SCRIPT = r"""
import importlib.util, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
spec = importlib.util.spec_from_file_location("_decode_compiled", sys.argv[1])
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
assert not mod._INTERPRET
sig = {"enc_ptr": "*u8", "enc_len": "i64", "dst_ptr": "*u8", "dst_len": "i64", "BLOCK": "constexpr",
       "HEADER": "constexpr", "TABLE": "constexpr", "BLOCK_VALUES": "constexpr", "MAGIC_INT": "constexpr"}
attrs = {(0,): [["tt.divisibility", 16]], (2,): [["tt.divisibility", 16]]}
for block in (1024, 4096):
    const = {"BLOCK": block, "HEADER": mod.HEADER_BYTES, "TABLE": mod.TABLE_OFFSET,
             "BLOCK_VALUES": mod.BLOCK_VALUES, "MAGIC_INT": mod.MAGIC_INT}
    src = ASTSource(fn=mod._decode_kernel, signature=sig, constexprs=const, attrs=attrs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    # full programs use vector accesses: the raw bytes, the stored copy, the 16-bit stores
    assert ptx.count("ld.global.v") >= 2 and "ld.global.v4.b32" in ptx and "st.global.v4.b32" in ptx, block
print("compiled", triton.__version__)
"""


def test_kernel_compiles_for_sm90_without_a_gpu():
    """The interpreter runs Python and misses what the compiler refuses (one type per name
    across branches, pointer casts, scan lowering): compile to a cubin for an H100/H200
    target, with the specialisation a real launch gets (16-byte aligned pointers). In a
    fresh interpreter: triton's own jit functions are decorated once per process."""
    import subprocess

    if D.triton is None:
        pytest.skip("triton is not importable")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT, str(DECODE_PY)], env=env, capture_output=True,
                          text=True, timeout=600)
    if proc.returncode and ("GPUTarget" in proc.stderr or "ptxas" in proc.stderr) and "ImportError" in proc.stderr:
        pytest.skip(f"triton cannot compile for CUDA here: {proc.stderr[-500:]}")
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-4000:]
