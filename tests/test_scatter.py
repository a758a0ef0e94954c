"""Tests of triton_kernels/scatter.py (layerwise.triton_kernels.scatter).

Without CUDA the Triton kernel runs under the interpreter on CPU tensors
(TRITON_INTERPRET=1 is set below before the module is imported), so sizes are
kept small.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import importlib.util  # noqa: E402
import sys  # noqa: E402
import uuid  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

SCATTER_PY = Path(__file__).resolve().parents[1] / "triton_kernels" / "scatter.py"


def _load_by_path(name=None):
    name = name or f"_scatter_under_test_{uuid.uuid4().hex}"
    spec = importlib.util.spec_from_file_location(name, SCATTER_PY)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _load():
    try:
        from layerwise.triton_kernels import scatter as mod
    except Exception:  # noqa: BLE001 - package not built/installed yet, or partial
        return _load_by_path()
    # If the package module was imported earlier without the interpreter (but we
    # need it), load a fresh copy so its kernel is the interpreted one.
    if os.environ.get("TRITON_INTERPRET") == "1" and not mod._INTERPRET:
        return _load_by_path()
    return mod


S = _load()

F8 = getattr(torch, "float8_e4m3fn", None)
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.uint8] + ([F8] if F8 is not None else [])
FLOATS = {torch.float32, torch.float16, torch.bfloat16, F8} - {None}
INT_OF_SIZE = {4: torch.int32, 2: torch.int16, 1: torch.uint8}


# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------
@pytest.fixture(params=["cpu", "cuda"])
def device(request):
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("CUDA is not available")
    return request.param


def need_triton(device):
    if not S.triton_available_for(device):
        pytest.skip(f"the Triton path does not run on {device} here (triton missing or TRITON_INTERPRET unset)")


def bits(t):
    """Bit view of t's elements in row-major order (NaN payloads compare bitwise)."""
    return t.contiguous().view(-1).view(INT_OF_SIZE[t.element_size()])


def assert_bitwise(a, b, what=""):
    assert a.dtype == b.dtype and a.shape == b.shape, what
    ba, bb = bits(a).cpu(), bits(b).cpu()
    if not torch.equal(ba, bb):
        bad = (ba != bb).nonzero().view(-1)[:8].tolist()
        raise AssertionError(f"{what}: {len(bad)}+ mismatching elements, first at {bad}: {ba[bad]} vs {bb[bad]}")


def poisoned(n, dtype, device):
    """A 1-D base buffer filled with a sentinel (NaN for floats, 127 for ints)."""
    if dtype in FLOATS:
        return torch.full((n,), float("nan"), dtype=torch.float32, device=device).to(dtype)
    return torch.full((n,), 127, dtype=dtype, device=device)


def make_dsts(specs, device):
    """specs: (dtype, base_numel, view_fn). Returns (bases, views)."""
    bases = [poisoned(n, dt, device) for dt, n, _ in specs]
    views = [fn(b) for b, (_, _, fn) in zip(bases, specs)]
    return bases, views


INT_RANGE = {torch.int8: (-128, 127), torch.uint8: (0, 255)}


def segment_values(n, dtype, device, seed=0, cast_to=None, int_range=None):
    """Segment of n elements of ``dtype``.

    cast_to None (same-dtype copies) or an integer segment: random bit patterns
    (NaN payloads included). Otherwise values on which torch's ``.to(cast_to)``
    is deterministic: no NaN, and for integer targets (or ``int_range``)
    values that truncate into the target's range.
    """
    g = torch.Generator().manual_seed(seed)
    if cast_to is None or dtype in INT_RANGE:
        esize = torch.empty((), dtype=dtype).element_size()
        raw = torch.randint(0, 256, (n * esize,), generator=g, dtype=torch.uint8)
        return raw.view(dtype).to(device)
    if int_range is None and cast_to in INT_RANGE:
        int_range = INT_RANGE[cast_to]
    if int_range is not None:
        lo, hi = int_range
        v = (torch.rand(n, generator=g, dtype=torch.float64) * (hi + 1 - lo) + lo).float()
    else:
        scale = torch.logspace(-8, 6, n)[torch.randperm(n, generator=g)]
        v = torch.randn(n, generator=g) * scale
        specials = torch.tensor(
            [0.0, -0.0, float("inf"), -float("inf"), 448.0, 464.0, 470.0, 480.0, 1e30, 2.0**-7, 3 * 2.0**-11,
             65520.0, 1e-40]
        )[:n]
        v[: len(specials)] = specials
    vf = v.to(dtype).float()  # values exactly representable in dtype
    vf[torch.isnan(vf)] = 0.0
    if int_range is not None:
        t = vf.trunc()
        vf[(t < int_range[0]) | (t > int_range[1])] = 0.0
    return vf.to(dtype).to(device)


def run_both(segment, offsets, specs, block=S.DEFAULT_BLOCK):
    """Scatter with the Triton kernel and with the reference into identically
    poisoned destinations; compare every destination's whole base buffer."""
    device = segment.device
    tb, tv = make_dsts(specs, device)
    rb, rv = make_dsts(specs, device)
    table = S.build_scatter_table(segment, offsets, tv, block=block)
    assert S.scatter(segment, offsets, tv, table=table, backend="triton") == "triton"
    assert S.scatter(segment, offsets, rv, backend="ref") == "ref"
    for i, (a, b) in enumerate(zip(tb, rb)):
        assert_bitwise(a, b, f"destination {i} base")
    return tb, tv, table


def as_is(b):
    return b


# --------------------------------------------------------------------------
# correctness
# --------------------------------------------------------------------------
SHAPE_SPECS = [
    # (base numel, view fn, segment elements consumed = view numel)
    (1, lambda b: b.view(())),  # rank 0
    (1, lambda b: b.view(1)),  # one element
    (7, lambda b: b),  # rank 1
    (0, lambda b: b.view(0, 3)),  # empty
    (20, lambda b: b.view(4, 5).t()),  # transposed
    (60, lambda b: b.view(3, 4, 5).permute(2, 0, 1)),  # permuted rank 3
    (48, lambda b: b.view(4, 12)[:, ::2]),  # gaps inside the base
    (120, lambda b: b.view(2, 3, 4, 5)[:, 1:, ::2, 1:4]),  # rank 4 sliced
    (96, lambda b: b.view(2, 2, 2, 3, 4).permute(4, 3, 2, 1, 0)),  # rank 5
    (128, lambda b: b.view(2, 2, 2, 2, 2, 4).transpose(0, 5)[..., ::2]),  # rank 6 strided
    (64, lambda b: b.view(1, 1, 1, 1, 1, 64)),  # rank 6 contiguous
    (65, lambda b: b),  # just over the small block
    (140, lambda b: b.view(10, 14)[:, 1:]),  # 130 strided elements, just over 2 blocks
    (1025, lambda b: b),  # just over the default block
    (1040, lambda b: b[16:]),  # contiguous, aligned, 1024 elements (fast path, 1 full block)
    (1030, lambda b: b[1:]),  # contiguous, unaligned start
]


@pytest.mark.parametrize("block", [64, 1024])
def test_shapes_strides_and_gaps(device, block):
    need_triton(device)
    specs = [(torch.float32, n, fn) for n, fn in SHAPE_SPECS]
    numels = [fn(torch.empty(n)).numel() for n, fn in SHAPE_SPECS]
    offsets, pos = [], 3
    for k, n in enumerate(numels):
        offsets.append(pos)
        pos += n + (k % 3) * 5  # gaps of 0, 5, 10 elements between slices
    seg = segment_values(pos + 4, torch.float32, device, seed=block)
    tb, tv, table = run_both(seg, offsets, specs, block=block)
    # explicit check against the definition, independent of the reference
    for i, (v, off) in enumerate(zip(tv, offsets)):
        assert_bitwise(v.contiguous().view(-1), seg[off : off + v.numel()], f"destination {i}")
    # the fast path is taken for some block, and the empty destination has no row
    flags = table.table.cpu()[table.n_active :].view(-1, S._ROW)[:, S._F_FLAGS]
    assert (flags & S._FLAG_FAST).any() and ((flags & S._FLAG_CONTIG) == 0).any()
    assert table.n_active == len(specs) - 1


def test_strided_gaps_keep_poison(device):
    need_triton(device)
    seg = torch.arange(40, dtype=torch.float32, device=device)
    base = poisoned(6 * 8, torch.float32, device)
    grid = base.view(6, 8)
    dst = grid[:, ::2]
    S.scatter(seg, [10], [dst], backend="triton")
    assert torch.equal(dst.reshape(-1), seg[10:34])
    gaps = grid[:, 1::2]
    assert torch.isnan(gaps).all(), "elements between the strided destination's elements were written"
    assert_bitwise(gaps, torch.full_like(gaps, float("nan")), "gaps")


CAST_PAIRS = [(s, d) for s in DTYPES for d in DTYPES]


@pytest.mark.parametrize("src,dst", CAST_PAIRS, ids=[f"{s}-{d}".replace("torch.", "") for s, d in CAST_PAIRS])
def test_dtypes_and_casts(device, src, dst):
    need_triton(device)
    n = 300
    if src == dst:
        seg = segment_values(n, src, device)  # random bits, NaN payloads included
    else:
        seg = segment_values(n, src, device, cast_to=dst)
    specs = [
        (dst, 128, as_is),  # contiguous, aligned: fast path
        (dst, 40, lambda b: b.view(5, 8)[:, ::2]),  # strided
        (dst, 101, lambda b: b[1:]),  # contiguous, unaligned
        (dst, 0, as_is),
    ]
    run_both(seg, [0, 128 + 3, 160, 260], specs, block=64)


def test_cast_edge_values(device):
    """fp32 values at rounding ties, overflow, infinities and subnormal edges,
    into every dtype that keeps them deterministic; fp8 and bf16 bit patterns out."""
    need_triton(device)
    ties_bf16 = (torch.arange(-40, 40, dtype=torch.int32) * 0x8000 + 0x3F800000).view(torch.float32)
    ties_f16 = (torch.arange(-40, 40, dtype=torch.int32) * 0x1000 + 0x3F800000).view(torch.float32)
    edges = torch.tensor(
        [0.0, -0.0, float("inf"), -float("inf"), 448.0, 449.0, 456.0, 464.0, 464.1, 470.0, 479.9, 480.0, 1e6,
         -470.0, 2.0**-6, 2.0**-7, 2.0**-9, 2.0**-10, 3 * 2.0**-10, 3 * 2.0**-11, 1e-45, 65504.0, 65519.0,
         65520.0, 3.0e38, 6.0e-8, 2.98e-8]
    )
    seg = torch.cat([edges, ties_bf16, ties_f16]).to(device)
    n = seg.numel()
    for dt in [torch.float16, torch.bfloat16] + ([F8] if F8 is not None else []):
        run_both(seg, [0, 0], [(dt, n, as_is), (torch.float32, n, as_is)], block=64)
    if F8 is not None:  # every fp8 bit pattern out to the wider floats (NaN patterns only as copies)
        all8 = torch.arange(256, dtype=torch.int32).to(torch.uint8)
        all8 = all8[(all8 & 0x7F) != 0x7F].view(F8).to(device)
        k = all8.numel()
        run_both(all8, [0] * 4, [(dt, k, as_is) for dt in (torch.float32, torch.float16, torch.bfloat16, F8)])


def test_mixed_destination_dtypes_in_one_call(device):
    need_triton(device)
    seg = segment_values(600, torch.float32, device, cast_to=torch.int8, int_range=(0, 127))
    specs = []
    for k, dt in enumerate(DTYPES * 2):
        specs.append((dt, 40, (lambda b: b.view(5, 8).t()) if k % 2 else as_is))
    offsets = [k * 41 + (k % 4) for k in range(len(specs))]
    run_both(seg, offsets, specs, block=16)


def test_many_small_destinations(device):
    need_triton(device)
    g = torch.Generator().manual_seed(3)
    specs, offsets, pos = [], [], 0
    for k in range(200):
        shape = tuple(int(s) for s in torch.randint(0, 4, (int(torch.randint(0, 4, (1,), generator=g)),), generator=g))
        numel = 1
        for s in shape:
            numel *= s
        dt = DTYPES[k % len(DTYPES)] if k % 3 == 0 else torch.float16
        fn = (lambda b, shape=shape: b.view(shape).transpose(0, -1)) if len(shape) >= 2 else (lambda b, shape=shape: b.view(shape))
        specs.append((dt, numel, fn))
        offsets.append(pos)
        pos += numel + k % 2
    seg = segment_values(pos + 1, torch.float16, device, seed=5, cast_to=torch.int8, int_range=(0, 127))
    _, _, table = run_both(seg, offsets, specs, block=16)
    assert table.num_dsts == 200


def test_table_built_once_reused_for_two_segments(device):
    need_triton(device)
    specs = [(torch.float32, 30, lambda b: b.view(5, 6).t()), (torch.bfloat16, 17, as_is), (torch.float16, 0, as_is)]
    offsets = [2, 40, 57]
    bases, views = make_dsts(specs, device)
    table = S.build_scatter_table(torch.empty(60, device=device), offsets, views, block=16)
    for seed in (1, 2):
        seg = segment_values(70, torch.float32, device, seed=seed, cast_to=torch.float16)
        S.scatter_segment(seg, None, None, table=table)  # no per-destination work
        for i, (v, off) in enumerate(zip(views, offsets)):
            assert_bitwise(v.contiguous().view(-1), seg[off : off + v.numel()].to(v.dtype), f"seed {seed} dst {i}")
    # the same table also drives the reference path
    seg = segment_values(60, torch.float32, device, seed=9, cast_to=torch.float16)
    assert S.scatter(seg, None, views, table=table, backend="ref") == "ref"
    assert_bitwise(views[1], seg[40:57].to(torch.bfloat16), "ref with table")
    # a table refuses a segment it was not built for
    with pytest.raises(TypeError, match="dtype"):
        S.scatter_segment(seg.half(), None, None, table=table)
    with pytest.raises(ValueError, match="needs 57"):
        S.scatter_segment(seg[:50], None, None, table=table)


class _CountingKernel:
    """Stands in for S._scatter_kernel and counts real launches."""

    def __init__(self, kernel):
        self.kernel, self.launches, self.grids = kernel, 0, []

    def __getitem__(self, grid):
        launcher = self.kernel[grid]

        def launch(*args, **kwargs):
            self.launches += 1
            self.grids.append(grid)
            return launcher(*args, **kwargs)

        return launch


def test_exactly_one_launch_per_call(device, monkeypatch):
    need_triton(device)
    counter = _CountingKernel(S._scatter_kernel)
    monkeypatch.setattr(S, "_scatter_kernel", counter)
    seg = torch.arange(2500, dtype=torch.float32, device=device)
    views = [torch.empty(k % 5 + 1, 3, device=device).t() for k in range(150)] + [torch.empty(300, device=device)]
    offsets = [13 * k for k in range(151)]
    S.scatter_segment(seg, offsets, views)
    assert counter.launches == 1
    assert counter.grids[0] == (sum(-(-v.numel() // S.DEFAULT_BLOCK) for v in views),)
    table = S.build_scatter_table(seg, offsets, views, block=64)
    assert counter.launches == 1  # building a table launches nothing
    S.scatter(seg, offsets, views, table=table, backend="triton")
    S.scatter(seg, offsets, views, table=table, backend="triton")
    assert counter.launches == 3
    assert counter.grids[-1] == (table.grid,)
    with pytest.raises(ValueError):
        S.scatter_segment(seg, [2490], [torch.empty(20, device=device)])
    assert counter.launches == 3  # bad input: no launch
    S.scatter_segment(seg, [0, 5], [torch.empty(0, device=device), torch.empty(2, 0, device=device)])
    assert counter.launches == 3  # all destinations empty: nothing to launch
    for v, off in zip(views, offsets):
        assert torch.equal(v.contiguous().view(-1), seg[off : off + v.numel()])


# --------------------------------------------------------------------------
# bad input
# --------------------------------------------------------------------------
def _bad_cases(device):
    """name -> (build(seg) -> (offsets, dsts), exception, match)."""

    def past_end(seg):
        return [0, 10, 95], [torch.empty(5, device=device), torch.empty(3, device=device), torch.empty(2, 3, device=device)]

    def two_overlap(seg):
        base = poisoned(40, torch.float32, device)
        return [0, 10, 20], [base[:10], torch.empty(4, device=device), base[5:15]]

    def interleaved(seg):  # address ranges overlap (conservative rejection)
        base = poisoned(40, torch.float32, device).view(4, 10)
        return [0, 30], [base[:, ::2], base[:, 1::2]]

    def self_overlap(seg):
        return [0, 10], [torch.empty(3, device=device), poisoned(4, torch.float32, device)[:1].expand(2, 4)]

    def other_device(seg):
        return [0, 10], [torch.empty(3, device=device), torch.empty(3, device="meta")]

    def bad_dtype(seg):
        return [0, 10], [torch.empty(3, device=device), torch.empty(3, dtype=torch.float64, device=device)]

    def rank7(seg):
        return [0, 10], [torch.empty(3, device=device), torch.empty((1,) * 7, device=device)]

    def length_mismatch(seg):
        return [0, 10, 20], [torch.empty(3, device=device), torch.empty(3, device=device)]

    def negative_offset(seg):
        return [0, -1], [torch.empty(3, device=device), torch.empty(3, device=device)]

    def overlaps_segment(seg):
        return [0, 50], [torch.empty(3, device=device), seg[20:30]]

    return {
        "past_end": (past_end, ValueError, r"destination 2.*past the end"),
        "two_overlap": (two_overlap, ValueError, r"destination 2 overlaps destination 0"),
        "interleaved": (interleaved, ValueError, r"destination 1 overlaps destination 0"),
        "self_overlap": (self_overlap, ValueError, r"destination 1 overlaps itself"),
        "other_device": (other_device, ValueError, r"destination 1 is on device meta"),
        "bad_dtype": (bad_dtype, TypeError, r"destination 1 has unsupported dtype torch.float64"),
        "rank7": (rank7, ValueError, r"destination 1 has rank 7"),
        "length_mismatch": (length_mismatch, ValueError, r"len\(offsets\) = 3 but len\(dsts\) = 2"),
        "negative_offset": (negative_offset, ValueError, r"offset 1 is negative"),
        "overlaps_segment": (overlaps_segment, ValueError, r"destination 1 overlaps the segment"),
    }


BAD_NAMES = list(_bad_cases("cpu"))


@pytest.mark.parametrize("backend", ["triton", "ref"])
@pytest.mark.parametrize("name", BAD_NAMES)
def test_bad_input_raises_before_writing(device, name, backend):
    if backend == "triton":
        need_triton(device)
    build, exc, match = _bad_cases(device)[name]
    seg = torch.arange(100, dtype=torch.float32, device=device)
    offsets, dsts = build(seg)
    for d in dsts:
        if d.device.type != "meta" and d.numel() and not (d.data_ptr() >= seg.data_ptr() and d.data_ptr() < seg.data_ptr() + 400):
            d.fill_(float("nan") if d.dtype.is_floating_point else 127)
    before = [bits(d).clone() if d.device.type != "meta" and d.dtype in S._DTYPES else None for d in dsts]
    seg_before = seg.clone()
    with pytest.raises(exc, match=match):
        S.scatter(seg, offsets, dsts, backend=backend)
    with pytest.raises(exc, match=match):
        S.build_scatter_table(seg, offsets, dsts)
    for i, (d, b) in enumerate(zip(dsts, before)):
        if b is not None:
            assert torch.equal(bits(d), b), f"destination {i} was written"
    assert torch.equal(seg, seg_before)


def test_bad_segment_and_block():
    seg = torch.arange(10, dtype=torch.float64)
    with pytest.raises(TypeError, match="segment has unsupported dtype"):
        S.scatter(seg, [0], [torch.empty(2)], backend="ref")
    with pytest.raises(ValueError, match="1-D contiguous"):
        S.build_scatter_table(torch.zeros(4, 4), [0], [torch.empty(2)])
    with pytest.raises(ValueError, match="power of two"):
        S.build_scatter_table(torch.zeros(4), [0], [torch.empty(2)], block=100)
    with pytest.raises(ValueError, match="backend"):
        S.scatter(torch.zeros(4), [0], [torch.empty(2)], backend="cuda")


# --------------------------------------------------------------------------
# dispatch and optional triton
# --------------------------------------------------------------------------
def test_dispatch(device):
    seg = torch.arange(10, dtype=torch.float32, device=device)
    d = torch.empty(2, 3, device=device)
    assert S.scatter(seg, [1], [d], backend="ref") == "ref"
    assert torch.equal(d.view(-1), seg[1:7])
    d.zero_()
    ran = S.scatter(seg, [2], [d])
    expected = "triton" if S.triton_available_for(device) else "ref"
    assert ran == expected
    if device == "cpu":
        assert ran == ("triton" if (S.triton is not None and os.environ.get("TRITON_INTERPRET") == "1") else "ref")
    else:
        assert ran == ("triton" if S.triton is not None else "ref")
    assert torch.equal(d.view(-1), seg[2:8])


def test_import_without_triton(monkeypatch):
    for name in [m for m in sys.modules if m == "triton" or m.startswith("triton.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "triton", None)  # makes `import triton` raise ImportError
    mod = _load_by_path()
    assert mod.triton is None and mod._scatter_kernel is None
    seg = torch.arange(10, dtype=torch.float32)
    d = torch.empty(4, dtype=torch.bfloat16)
    assert mod.scatter(seg, [3], [d]) == "ref"
    assert torch.equal(d, seg[3:7].bfloat16())
    with pytest.raises(ImportError, match="triton"):
        mod.scatter(seg, [3], [d], backend="triton")
    with pytest.raises(ImportError, match="triton"):
        mod.scatter_segment(seg, [3], [d])
    assert not mod.triton_available_for("cuda")


@pytest.fixture(autouse=True)
def _quiet_numpy_casts():
    # the interpreter casts with numpy, which warns on overflow to inf
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def test_layerwise_dispatch_runs_the_kernel_and_imports_triton_lazily():
    import subprocess
    import sys

    import layerwise

    seg = torch.arange(40, dtype=torch.float32)
    want = [torch.zeros(3, 4).t(), torch.zeros(5, dtype=torch.bfloat16)]
    got = [torch.full_like(t, float("nan")) for t in want]
    S.scatter_segment_ref(seg, [0, 20], want)
    path = layerwise.scatter_segment(seg, [0, 20], got)
    assert path == ("triton" if S.triton is not None and os.environ.get("TRITON_INTERPRET") == "1" else "ref")  # CPU tensors
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    out = subprocess.run([sys.executable, "-c", "import sys, layerwise; print('triton' in sys.modules)"],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
