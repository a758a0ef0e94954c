"""The CUDA path as a GPU will see it, checked where the CPU backend or a mock can
show it: stats() and report() never drain the device, copies split at
pinned-registration boundaries stay exact, copy time is measured for GB/s, and
the arena is created for the device it streams to. Hook order and capture are in
contract/test_contract.py.

The checks below the line run on every device (the `device` fixture:
"cpu" here, "cuda" where scripts/gpu_check.sh finds a GPU), each a real check of
the CUDA path there: a reader waiting on a late event does not spin a core, a
freed pinned block keeps its bytes until its copy completes (and costs no device
synchronize), decode regrows its staging under random copy delays, split fetch
shares its group with the model's all-to-all and survives ranks reaching remove
at different times, and the decode path and capture checks say what is wrong."""
import copy
import gc
import os
import random
import sys
import threading
import time
import types

import pytest
import torch
import torch.distributed as dist

import layerwise
from layerwise import _native
from layerwise.configure import managers_of
from layerwise.runtime import gpu_checks
from layerwise.runtime.gpu_checks import check_decode_path
from layerwise.stages.disk.reader import aligned_staging

from helpers.models import TwoGroupModel

GROUPS = ["transformer_blocks", "single_transformer_blocks"]


def configured(**kw):
    torch.manual_seed(0)
    model = TwoGroupModel()
    ref = copy.deepcopy(model)
    layerwise.configure_layerwise_offload(model, GROUPS, device="cpu", **kw)
    return model, ref


def run(model, n=3):
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        return [model(torch.randn(2, 32, generator=g)) for _ in range(n)]


class CountingEngine:
    """Forwards to the real engine, counting the calls that would block the host."""

    def __init__(self, engine):
        self._engine, self.syncs = engine, 0

    def synchronize(self):
        self.syncs += 1
        return self._engine.synchronize()

    def __getattr__(self, name):
        return getattr(self._engine, name)


def test_stats_and_report_never_wait_for_the_device_unless_asked():
    model, ref = configured()
    run(model)
    engines = []
    for m in managers_of(model):
        m._engine = CountingEngine(m._engine)
        engines.append(m._engine)
    for _ in range(3):
        for m in managers_of(model):
            m.stats()
        layerwise.report(model)
    assert [e.syncs for e in engines] == [0, 0]
    for a, b in zip(run(model), run(ref)):
        assert torch.equal(a, b)


def test_per_step_figures_after_the_first_forward_and_gbps_over_copy_time():
    model, ref = configured()
    run(model, n=1)
    for m in managers_of(model):
        st = m.stats(sync=True)
        last = st["last_step"]
        assert last is not None and last["step"] == 1, st
        assert last["bytes_copied"] > 0 and last["copy_s"] is not None and 0 < last["copy_s"] < last["wall_s"] * 10
        assert st["copy_s"] >= last["copy_s"]
    rep = layerwise.report(model, sync=True)
    for row, m in zip(rep["groups"], managers_of(model)):
        last = m.stats()["last_step"]
        assert row["gbps"] == pytest.approx(last["bytes_copied"] / last["copy_s"] / 1e9)


@pytest.mark.parametrize("compress", [None, "lossless"])
@pytest.mark.parametrize("cuts", [[256], [4096, 8192], [1]])
def test_copies_split_at_registration_boundaries_stay_exact(cuts, compress):
    # A layer block larger than one cudaHostRegister can take is registered in pieces
    # (HostArena.split_points); its copy is then one copy per piece, chained. The
    # transfer stage is the only caller of copy_async, so an encoded layer's block
    # (and disk staging, a share) is split the same way.
    model, ref = configured(debug_copy_delay_us=300, prefetch_depth=2, compress=compress)
    for m in managers_of(model):
        for i in m.ring.streamed:
            for h in m.sources[i].holders():
                if hasattr(h, "cuts"):
                    h.cuts = tuple(c for c in cuts if 0 < c < h.block.numel())
        for s in range(m.ring.num_slots):
            m.ring.holder[s] = -1  # reload everything through the split path
    for _ in range(3):
        for a, b in zip(run(model), run(ref)):
            assert torch.equal(a, b)


def test_arena_split_points_are_empty_for_ordinary_blocks():
    arena = _native.HostArena(1 << 20, pinned=True, cuda=False)
    block = arena.allocate(300_000, 4096)
    assert arena.split_points(block.data_ptr() - arena.data_ptr, block.numel()) == []


def test_only_a_timed_copy_has_a_start_and_a_duration_on_the_cpu_backend():
    # The same rule on both backends: a copy issued with timing has a start and a
    # duration; one without has neither (copy_ms -1), so that a stage that loses the
    # timing of a fetch shows on the CPU backend too.
    engine = _native.CopyEngine("cpu")
    src, dst = torch.randn(1 << 20), torch.empty(1 << 20)
    ev = engine.copy_async(dst, src, timing=True)
    ev.synchronize()
    assert ev.start is not None and ev.start.query()
    assert ev.copy_ms > 0 and torch.equal(dst, src)
    untimed = engine.copy_async(dst, src)
    untimed.synchronize()
    assert untimed.start is None and untimed.copy_ms == -1.0
    assert engine.record().copy_ms == -1.0
    later = engine.record()
    later.start = ev.start  # a stage's event timed from the copy's start
    assert later.copy_ms >= ev.copy_ms
    with pytest.raises(TypeError):
        later.start = object()


# ------------------------------------------------------------ Helpers
def gpu_sleep_cycles(seconds: float) -> int:
    """torch.cuda._sleep cycles that keep the current stream busy about `seconds`."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return int(10_000_000 * seconds * 1000 / start.elapsed_time(end))


def late_event(device: str, engine, seconds: float):
    """An event of `engine`'s backend that completes `seconds` from now: a host event
    set by a timer (CPU), an event recorded behind a GPU sleep (CUDA)."""
    if device == "cpu":
        ev = _native._C.host_event()
        threading.Timer(seconds, ev.set).start()
        return ev
    cycles = gpu_sleep_cycles(seconds)
    torch.cuda._sleep(cycles)
    return engine.record(torch.cuda.current_stream().cuda_stream)


def other_threads_cpu_s() -> float:
    """CPU seconds (user + system) of this process's threads but the main one, from /proc."""
    main = threading.main_thread().native_id
    ticks = 0
    for tid in os.listdir("/proc/self/task"):
        if int(tid) == main:
            continue
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        ticks += int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15 of stat(5)
    return ticks / os.sysconf("SC_CLK_TCK")


needs_proc = pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="needs /proc")


# ------------------------------------------------------ item 3: waits that sleep
@needs_proc
def test_a_read_waiting_on_a_late_copy_does_not_spin_a_core(device, tmp_path):
    """A read into a staging slot waits (after=) for the copy out of it. On CUDA that
    copy's event was synchronised on the reader thread with cudaEventSynchronize,
    which spins a core for as long as the copy takes; now it is polled with back-off."""
    path = tmp_path / "wait.bin"
    data = os.urandom(1 << 20)
    path.write_bytes(data)
    engine = _native.CopyEngine(device)
    reader = _native.Reader(num_threads=1)
    staging = aligned_staging(1 << 20)
    dev_buf = torch.empty(1 << 20, dtype=torch.uint8, device=device)
    src = torch.zeros(1 << 20, dtype=torch.uint8)
    src = src.pin_memory() if device == "cuda" else src
    copied = engine.copy_async(dev_buf, src, after=late_event(device, engine, 0.8))  # a copy that lands late
    cpu0, t0 = other_threads_cpu_s(), time.perf_counter()
    ev = reader.read_async(str(path), [(0, 1 << 20, 0)], staging, after=copied)
    while not ev.query():
        time.sleep(0.01)  # the main thread sleeps: what the other threads burn is the reader's
    wall, cpu = time.perf_counter() - t0, other_threads_cpu_s() - cpu0
    assert wall > 0.4, wall  # the read did wait for the copy
    assert cpu < 0.25 * wall, f"the waiting reader used {cpu:.2f} s of CPU in {wall:.2f} s"
    assert staging.numpy().tobytes() == data
    reader.shutdown()


class SleepyBlock(torch.nn.Module):
    """A block whose compute takes `ms` (a GPU sleep on the compute stream on CUDA):
    the copies wait for it, and the reads into staging wait for the copies."""

    def __init__(self, width, ms, cycles=0):
        super().__init__()
        self.fc = torch.nn.Linear(width, width)
        self.ms, self.cycles = ms, cycles

    def forward(self, x):
        if x.is_cuda:
            torch.cuda._sleep(self.cycles)
        else:
            time.sleep(self.ms / 1000)
        return torch.relu(self.fc(x)) + x


class SleepyNet(torch.nn.Module):
    def __init__(self, width=256, depth=8, ms=15.0, cycles=0):
        super().__init__()
        self.embed = torch.nn.Linear(width, width)
        self.blocks = torch.nn.ModuleList(SleepyBlock(width, ms, cycles) for _ in range(depth))

    def forward(self, x):
        x = self.embed(x)
        for b in self.blocks:
            x = b(x)
        return x


@needs_proc
def test_reader_threads_stay_idle_through_a_disk_tier_forward(device, tmp_path):
    """A compute-bound disk-tier forward: the reader threads spend it waiting for the
    copies out of their staging slots (CUDA events on a GPU). Every thread but the
    main one together stays well under one core (it was one core per waiting reader)."""
    from helpers.disk import budget

    torch.manual_seed(0)
    cycles = gpu_sleep_cycles(0.015) if device == "cuda" else 0
    model = SleepyNet(cycles=cycles)
    ref = copy.deepcopy(model).to(device)
    (m,) = layerwise.configure_layerwise_offload(model, "blocks", device=device, prefetch_depth=1,
                                                 host_budget=budget(model, 1, 1, device=device), spill_dir=tmp_path,
                                                 num_copy_streams=2)
    assert m.stats()["disk"]["layers"] >= 4, m.stats()["disk"]
    xs = [torch.randn(4, 256, generator=torch.Generator().manual_seed(k)).to(device) for k in range(2)]
    with torch.no_grad():
        assert torch.equal(model(xs[0]), ref(xs[0]))  # warm: files open, staging touched
        if device == "cuda":
            torch.cuda.synchronize()
        cpu0, t0 = other_threads_cpu_s(), time.perf_counter()
        outs = [model(xs[k % 2]) for k in range(8)]
        if device == "cuda":
            torch.cuda.synchronize()
        wall, cpu = time.perf_counter() - t0, other_threads_cpu_s() - cpu0
        for k, out in enumerate(outs):
            assert torch.equal(out, ref(xs[k % 2])), k
    assert wall > 8 * 8 * 0.015 * 0.8, wall  # compute-bound, as meant
    assert cpu < 0.5 * wall, f"threads other than the main one used {cpu:.2f} s of CPU in {wall:.2f} s"
    layerwise.remove_layerwise_offload(model)


# -------------------------------------------- item 5: freed pinned host blocks
def test_a_freed_pinned_block_keeps_its_bytes_until_its_copy_completes(device):
    """A host block (a layer rewritten in place drops the old one) freed while a copy
    still reads it: the copy's bytes are exact, and the free does not wait for the
    device (it ran cudaDeviceSynchronize, in a prefetch)."""
    engine = _native.CopyEngine(device)
    n = 4 << 20
    data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    for drop_event in (False, True):
        arena = _native.HostArena(n, pinned=True, cuda=device == "cuda")
        block = arena.allocate(n, 4096)
        block.copy_(data)
        dst = torch.zeros(n, dtype=torch.uint8, device=device)
        ev = engine.copy_async(dst, block, after=late_event(device, engine, 0.6))
        t0 = time.perf_counter()
        del block, arena
        if drop_event:
            del ev  # the last reference to the block goes with the copy still queued
        freed_s = time.perf_counter() - t0  # (a reference count reaching zero frees it: no gc)
        gc.collect()
        # new blocks, filled with other bytes, where the freed mapping could be handed out again
        others = [_native.HostArena(n, pinned=True, cuda=device == "cuda").allocate(n, 4096).fill_(0xA5)
                  for _ in range(3)]
        assert freed_s < 0.3, f"freeing the block waited {freed_s:.2f} s for the device"
        engine.synchronize()
        assert drop_event or ev.query()
        assert torch.equal(dst.cpu(), data), drop_event
        del others
    engine.synchronize()


# ------------------------------------- decode: staging regrow under copy delays
class DelayedCudaEngine:
    """A CUDA copy engine whose copies start after a random delay on every copy
    stream (torch.cuda._sleep): the GPU's stand-in for debug_copy_delay_us."""

    def __init__(self, engine, max_cycles, seed=0):
        self._engine, self._max, self._rng = engine, max_cycles, random.Random(seed)
        dev = torch.device(engine.device)
        self._streams = [torch.cuda.ExternalStream(engine.stream_handle(k), device=dev)
                         for k in range(engine.num_streams)]

    def copy_async(self, dst, src, after=None, timing=False):
        for s in self._streams:
            with torch.cuda.stream(s):
                torch.cuda._sleep(self._rng.randrange(self._max))
        return self._engine.copy_async(dst, src, after, timing)

    def __getattr__(self, name):
        return getattr(self._engine, name)


def delayed_copies(device, monkeypatch) -> dict:
    """Random copy delays on `device`: the option on CPU, sleeps on the copy streams on CUDA."""
    if device == "cpu":
        return {"debug_copy_delay_us": 400}
    real = _native.CopyEngine
    cycles = gpu_sleep_cycles(200e-6)  # up to ~200 us per copy
    monkeypatch.setattr(_native, "CopyEngine", lambda *a, **k: DelayedCudaEngine(real(*a, **k), cycles))
    return {}


def lagging_compute(model, device, seed=0):
    """Rule 1's debug mode: the compute side runs behind the host by a random delay
    before each block (a sleep on the compute stream on CUDA: the host queues the
    next fetches and frees activations the stream still uses; a host sleep on CPU,
    where compute is synchronous and only the hooks' order is exercised)."""
    rng = random.Random(seed)
    if device == "cuda":
        cycles = gpu_sleep_cycles(300e-6)
        lag = lambda: torch.cuda._sleep(rng.randrange(cycles))  # noqa: E731
    else:
        lag = lambda: time.sleep(rng.random() * 300e-6)  # noqa: E731
    return [b.register_forward_pre_hook(lambda *a: lag()) for b in model.blocks]


@pytest.mark.parametrize("lag", ["copies", "compute", "both"])
def test_decode_regrows_its_staging_under_random_copy_delays(device, monkeypatch, lag):
    """Layers of zeros at configure (the codec's smallest encoding), then rewritten
    with real weights that encode larger than the device staging sized at start:
    it regrows in a fetch while copies and decodes of other layers are in flight.
    `lag`: random delays on the copy side, on the compute side (rule 1: a staging
    buffer or slot written before the compute stream is done with that memory
    gives wrong outputs), or both."""
    from helpers.compress import linear_stack, xs_for

    if device == "cuda":
        check_decode_path(device)  # the Triton decoder, compiled for the GPU
    model = linear_stack(torch.bfloat16, n=6, d=256)
    with torch.no_grad():
        for p in model.parameters():
            if p.dtype == torch.bfloat16:
                p.zero_()
    zeros = copy.deepcopy(model).to(device)
    real = linear_stack(torch.bfloat16, n=6, d=256, seed=1).to(device)
    delays = delayed_copies(device, monkeypatch) if lag in ("copies", "both") else {}
    (m,) = layerwise.configure_layerwise_offload(model, "blocks", device=device, prefetch_depth=2,
                                                 compress="lossless", num_copy_streams=2, **delays)
    if lag in ("compute", "both"):
        lagging_compute(model, device)
    xs = [x.to(device) for x in xs_for(256, torch.bfloat16)]
    with torch.no_grad():
        for x in xs:
            assert torch.equal(model(x), zeros(x))
        before = m.stats()["compress"]
        model.load_state_dict(real.state_dict())
        after = m.stats()["compress"]
        assert before["layers_raw"] == after["layers_raw"] == [], (before, after)
        # the zero layers all encoded to one size, which sized the staging: the real
        # layers encode larger on average, so some outgrow it and staging regrows
        assert after["stored_bytes"] > 1.1 * before["stored_bytes"], (before, after)
        rng = random.Random(0)
        for _ in range(8):
            x = xs[rng.randrange(len(xs))]
            assert torch.equal(model(x), real(x))
        for i in (4, 1, 1, 5):  # blocks called alone, out of order
            h = xs[0]
            assert torch.equal(model.blocks[i](h), real.blocks[i](h))
        model.load_state_dict(zeros.state_dict())  # and small again: the grown staging serves them
        for x in xs:
            assert torch.equal(model(x), zeros(x))
    layerwise.remove_layerwise_offload(model)


# ----------------------------------------------- the GPU behind the host
def behind_the_host(blocks, device, ms=1.0):
    """On CUDA, a GPU sleep of about `ms` queued on the compute stream before each
    block's kernels: a pre-hook registered after configure runs after layerwise's
    (which made the stream wait for the block's copy and queued the next fetches),
    so the sleep lies between that wait and the block's kernels. The host then runs
    ahead of the GPU through the whole step, as it does with real blocks: every
    fetch, slot reuse and decode is ordered by events alone, and a missing edge
    gives a wrong output instead of passing because the GPU was idle. On the CPU
    (compute is synchronous) nothing: the copy side's random delays stand in."""
    if device != "cuda":
        return []
    cycles = gpu_sleep_cycles(ms / 1000)
    return [b.register_forward_pre_hook(lambda *a: torch.cuda._sleep(cycles)) for b in blocks]


def smallest_host_budget(configure, start=32 << 10, step=16 << 10):
    """configure(host_budget) at the smallest budget it takes: most layers on disk."""
    budget = start
    while True:
        try:
            return configure(budget)
        except ValueError as e:
            assert "too small" in str(e), e
            budget += step


@pytest.mark.parametrize("tier", ["raw", "encoded", "disk", "encoded-disk"])
@pytest.mark.parametrize("depth", [1, 2])
def test_bitwise_with_the_gpu_behind_the_host(device, tier, depth, tmp_path):
    """Two groups (the prefetch crosses from one to the other and wraps to the next
    step), two copy streams, each tier, the compute stream slowed before every block
    (behind_the_host); blocks called out of order too: bitwise the resident model."""
    torch.manual_seed(0)
    model = TwoGroupModel(d=256).eval()
    ref = copy.deepcopy(model).to(device)
    options = dict(prefetch_depth=depth, num_copy_streams=2)
    if device == "cpu":
        options["debug_copy_delay_us"] = 300
    if tier.startswith("encoded"):
        options["compress"] = "lossless"

    def configure(budget=None):
        extra = {} if budget is None else dict(host_budget=budget, spill_dir=tmp_path)
        return layerwise.configure_layerwise_offload(model, GROUPS, device=device, **options, **extra)

    managers = smallest_host_budget(configure, 1 << 20, 64 << 10) if tier.endswith("disk") else configure()
    plan = [r for m in managers for r in m.stats()["tier_plan"]]
    if tier.endswith("disk"):
        assert any(r.startswith("spill") for r in plan), plan
    if tier.startswith("encoded"):
        assert any(r.endswith("encoded") for r in plan), plan
    behind_the_host([*model.transformer_blocks, *model.single_transformer_blocks], device)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(4, 256, generator=g).to(device) for _ in range(3)]
    with torch.no_grad():
        for _ in range(3):
            for x in xs:
                assert torch.equal(model(x), ref(x))
        order = dict(order_a=[4, 0, 3, 3], order_b=[2, 1])
        assert torch.equal(model(xs[0], **order), ref(xs[0], **order))
        assert torch.equal(model(xs[1]), ref(xs[1]))
    layerwise.remove_layerwise_offload(model)
    for k, v in ref.state_dict().items():
        assert torch.equal(model.state_dict()[k].to(device), v), k


# --------------------------------------------- item 6: capture on which device
def test_capture_check_asks_the_stream_of_the_managed_device(monkeypatch):
    """gpu_checks.stream_capturing(device) looks at `device`'s current stream, not the current
    device's: a graph captured on cuda:1 while cuda:0 is current must be seen."""
    current = [0]
    capturing = {1}

    class FakeDevice:
        def __init__(self, d):
            self.index = torch.device(d).index

        def __enter__(self):
            self.prev, current[0] = current[0], self.index

        def __exit__(self, *exc):
            current[0] = self.prev

    monkeypatch.setattr(torch.cuda, "device", FakeDevice)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: current[0] in capturing)
    assert gpu_checks.stream_capturing(torch.device("cuda:1"))
    assert not gpu_checks.stream_capturing(torch.device("cuda:0"))
    assert current == [0]  # the current device is given back


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (scripts/gpu_check.sh)")
def test_capture_check_on_the_gpu():
    def captured_on(index, probe):
        s = torch.cuda.Stream(index)
        g = torch.cuda.CUDAGraph()
        seen = {}
        with torch.cuda.device(index):
            x = torch.zeros(1, device=f"cuda:{index}")
            with torch.cuda.graph(g, stream=s, capture_error_mode="thread_local"):
                with torch.cuda.device(probe):  # another device current while cuda:index captures
                    seen = {d: gpu_checks.stream_capturing(torch.device(f"cuda:{d}"))
                            for d in range(torch.cuda.device_count())}
                x += 1
        return seen

    assert not gpu_checks.stream_capturing(torch.device("cuda:0"))
    assert captured_on(0, 0)[0]
    if torch.cuda.device_count() >= 2:
        seen = captured_on(1, 0)
        assert seen[1] and not seen[0], seen


# -------------------------------------------------- item 8: the gather stream
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (scripts/gpu_check.sh)")
def test_the_dedicated_stream_is_none_of_torchs_pool_streams():
    s = _native.dedicated_cuda_stream(torch.device("cuda"))
    pool = {torch.cuda.Stream().cuda_stream for _ in range(80)}
    pool |= {torch.cuda.Stream(priority=-1).cuda_stream for _ in range(80)}
    assert s.cuda_stream not in pool and s.cuda_stream != 0
    with torch.cuda.stream(s):
        x = torch.ones(1 << 20, device="cuda") * 2
    torch.cuda.current_stream().wait_stream(s)
    assert x.sum().item() == 2 << 20


# ------------------------------------ split fetch: several ranks (workers)
def split_ranks(device: str, scenario: str, tmp_path, world: int = 2):
    from helpers.ranks import run_ranks

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch built without gloo")
    if device == "cuda" and torch.cuda.device_count() < world:
        pytest.skip(f"NCCL needs a GPU per rank: {world} GPUs, {torch.cuda.device_count()} here")
    run_ranks(world, tmp_path, scenario, device, worker="cuda_path_worker.py")


def test_split_fetch_beside_an_all_to_all_on_the_same_group(device, tmp_path):
    """The model's all-to-all and the slot gathers on one group, in program order; on
    CUDA the gather stream is a dedicated one (torch's pool could hand it out again)."""
    split_ranks(device, "alltoall", tmp_path)


def test_split_fetch_remove_under_rank_skew(device, tmp_path):
    split_ranks(device, "remove_skew", tmp_path)


# -------------------------------------------------------- item 9: decode path
def test_decode_path_check_names_what_is_missing(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
    check_decode_path("cpu")  # the C++ decoder: nothing to check
    check_decode_path(torch.device("cpu"))
    with pytest.raises(RuntimeError, match=r"TRITON_INTERPRET='1' is set.*Unset TRITON_INTERPRET"):
        check_decode_path("cuda")
    monkeypatch.setenv("TRITON_INTERPRET", "true")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET='true'"):
        check_decode_path(torch.device("cuda", 1))
    monkeypatch.delenv("TRITON_INTERPRET")
    # the decode module imported while it was set (what conftest does on a machine without a GPU)
    monkeypatch.setitem(sys.modules, "layerwise.triton_kernels.decode", types.SimpleNamespace(_INTERPRET=True))
    with pytest.raises(RuntimeError, match="imported while TRITON_INTERPRET=1 was set"):
        check_decode_path("cuda:0")
    monkeypatch.setitem(sys.modules, "layerwise.triton_kernels.decode", types.SimpleNamespace(_INTERPRET=False))
    with pytest.raises(RuntimeError, match=r"needs triton >= 3\.6.*import triton. failed.*pip install 'triton>=3\.6'"):
        check_decode_path("cuda")
    old = types.ModuleType("triton")
    old.__version__ = "3.5.1"
    monkeypatch.setitem(sys.modules, "triton", old)
    with pytest.raises(RuntimeError, match=r"this process has triton 3\.5\.1.*Upgrade"):
        check_decode_path("cuda")
    new = types.ModuleType("triton")
    new.__version__ = "3.6.0+git1234"
    monkeypatch.setitem(sys.modules, "triton", new)
    check_decode_path("cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (scripts/gpu_check.sh)")
def test_decode_path_is_ready_on_this_gpu_host():
    check_decode_path("cuda")  # triton >= 3.6 there, TRITON_INTERPRET unset


# ------------------------------------------- decode on a lane of its own
def encoded_stack(device, n=4, **options):
    """A bf16 stack streamed with compress="lossless" (every layer encoded), its
    resident twin on `device`, and inputs there."""
    from helpers.compress import linear_stack, xs_for

    model = linear_stack(torch.bfloat16, n=n, d=256)
    ref = copy.deepcopy(model).to(device)
    (m,) = layerwise.configure_layerwise_offload(model, "blocks", device=device, compress="lossless", **options)
    assert m.stats()["compress"]["layers_raw"] == []
    return model, ref, m, [x.to(device) for x in xs_for(256, torch.bfloat16)]


def test_the_next_copy_overlaps_a_decode_that_waits_for_its_slot(device, monkeypatch):
    """With one copy stream (the default), the copy of layer b's encoded bytes must
    not queue behind the decode of layer a, which waits for its slot to be free (the
    compute still using it): decodes run on a lane of their own (CPU: a worker of
    their own; CUDA: a stream of their own), ordered by events only, so the bus
    carries the next layer while a decode waits or runs. Structural: the slot of a
    is freed by an event the test holds back (CPU: a host event it sets; CUDA: an
    event behind a 3 s GPU sleep), and the copy of b must complete meanwhile."""
    from layerwise.stages.transfer import Transfer

    if device == "cuda":
        check_decode_path(device)
    model, ref, m, xs = encoded_stack(device, prefetch_depth=1)
    with torch.no_grad():
        assert torch.equal(model(xs[0]), ref(xs[0]))  # warm: kernels compiled, staging in use
    m.stats(sync=True)
    assert m._engine.num_streams == 1
    a, b = (m.sources[i] for i in m.ring.streamed[1:3])
    assert a.encoded and b.encoded
    copies = []
    real = Transfer.copy

    def copy_logged(self, *args, **kwargs):
        copies.append(real(self, *args, **kwargs))
        return copies[-1]

    monkeypatch.setattr(Transfer, "copy", copy_logged)
    gate = _native._C.host_event() if device == "cpu" else late_event(device, m._engine, 3.0)
    t_gate = time.perf_counter()
    dst_a = torch.zeros(a.nbytes, dtype=torch.uint8, device=device)
    dst_b = torch.zeros(b.nbytes, dtype=torch.uint8, device=device)
    try:
        decode_a = a.tier.fetch(a, a.index, dst_a, gate, timing=False)  # its slot frees at the gate
        decode_b = b.tier.fetch(b, b.index, dst_b, None, timing=False)
        copy_b = copies[-1]
        deadline = time.perf_counter() + (1.5 if device == "cuda" else 60.0)
        while not copy_b.query() and time.perf_counter() < deadline:
            time.sleep(0.002)
        assert copy_b.query(), "the copy of the next layer queued behind a decode waiting for its slot"
        if device == "cpu" or time.perf_counter() - t_gate < 2.5:  # (CUDA: the gate is still closed)
            assert not decode_a.query(), "the decode did not wait for its slot"
    finally:
        if device == "cpu" and not gate.query():
            gate.set()
    decode_a.synchronize()
    decode_b.synchronize()
    assert torch.equal(dst_a.cpu(), a.read()) and torch.equal(dst_b.cpu(), b.read())
    monkeypatch.undo()
    with torch.no_grad():
        for x in xs:
            assert torch.equal(model(x), ref(x))
    layerwise.remove_layerwise_offload(model)


# --------------------------------- every fetch timed from its first copy
@pytest.mark.parametrize("kind", ["raw", "encoded", "disk", "encoded-disk"])
def test_every_fetch_is_timed_from_its_first_copy(device, kind, tmp_path):
    """The meter (stats()' copy_s, report's GB/s, tune's bus samples) times each fetch
    from its first copy's start to the event it ends in: the copy itself (raw), the
    decode after it (encoded: CUDA had no start there, copy_ms -1, no copy time and
    no bus samples for compressed groups; the CPU timed the decode alone), the last
    of a disk read's copies. Checked structurally (tests/helpers/fetch_timing.py): each
    timed fetch's start is a copy's start, on every step, with 2 copy streams."""
    from helpers.compress import linear_stack, xs_for
    from helpers.fetch_timing import FetchLog

    model = linear_stack(torch.bfloat16, n=6, d=256)
    ref = copy.deepcopy(model).to(device)
    options = dict(prefetch_depth=1, num_copy_streams=2)
    if kind.startswith("encoded"):
        options["compress"] = "lossless"

    def configure(budget=None):
        extra = {} if budget is None else dict(host_budget=budget, spill_dir=tmp_path)
        return layerwise.configure_layerwise_offload(model, "blocks", device=device, **options, **extra)

    (m,) = smallest_host_budget(configure) if kind.endswith("disk") else configure()
    plan = m.stats()["tier_plan"]
    if kind == "disk":
        assert "spill" in plan, plan
    if kind == "encoded-disk":
        assert "spill, encoded" in plan, plan
    xs = [x.to(device) for x in xs_for(256, torch.bfloat16)]
    with FetchLog() as log:
        m.meter.listen(True)  # every step timed (CUDA times one in 8 otherwise)
        with torch.no_grad():
            for x in xs:
                assert torch.equal(model(x), ref(x))
        log.check([m])
        samples = m.meter.listen(False)
    assert {layer for layer, nbytes, s in samples if s > 0} == set(m.ring.streamed), samples
    assert m.stats()["copy_s"] > 0
    layerwise.remove_layerwise_offload(model)


def test_split_fetch_times_every_gather_from_its_local_copy(device, tmp_path):
    """A split fetch ends in a gather (a host event on gloo, an event on the gather
    stream on NCCL): it is timed from the local copy's start (the first copy of the
    fetch), on every rank."""
    split_ranks(device, "timed", tmp_path)
