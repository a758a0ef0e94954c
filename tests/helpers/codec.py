"""The codec's inputs and checks, and the Triton decode kernel module under test
(tests/codec/test_codec.py, test_codec_v2.py): `D` is this checkout's
triton_kernels/decode.py, loaded by path and registered as
layerwise.triton_kernels.decode where that name resolves to another checkout.

Without CUDA the Triton kernel runs under the interpreter on CPU tensors
(TRITON_INTERPRET=1 is set below before the module is imported)."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import importlib.util  # noqa: E402
import sys  # noqa: E402
import uuid  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

DECODE_PY = Path(__file__).resolve().parents[2] / "triton_kernels" / "decode.py"
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
    """n values of `dtype` whose bytes are uniformly random (nothing to code)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n * dtype.itemsize,), generator=g, dtype=torch.int32).to(torch.uint8).view(dtype)


def specials(dtype):
    """Bit patterns a float codec likes to lose: NaN payloads, infinities, signed zeros, subnormals."""
    if dtype == torch.bfloat16:
        bits = [0x7FC0, 0x7FC1, 0x7F81, 0xFFFF, 0xFFC0, 0x7FFF, 0x7F80, 0xFF80, 0x0000, 0x8000, 0x0001, 0x8001,
                0x007F, 0x807F, 0x0080, 0x7F7F, 0xFF7F, 0x3F80]
    else:
        bits = [0x7E00, 0x7E01, 0x7C01, 0xFFFF, 0xFE00, 0x7FFF, 0x7C00, 0xFC00, 0x0000, 0x8000, 0x0001, 0x8001,
                0x03FF, 0x83FF, 0x0400, 0x7BFF, 0xFBFF, 0x3C00]
    return torch.tensor(bits, dtype=torch.int32).to(INT16).view(dtype)


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


def need_triton(device):
    if not D.triton_available_for(device):
        pytest.skip(f"the Triton path does not run on {device} here (triton missing or TRITON_INTERPRET unset)")
