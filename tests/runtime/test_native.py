"""HostArena and CopyEngine (layerwise._C), on the CPU backend and, where a GPU
is present, the CUDA backend."""
import gc
import os
import threading
import time

import pytest
import torch

import layerwise

PAGE = os.sysconf("SC_PAGESIZE")


def test_build_info():
    info = layerwise.build_info()
    assert set(info) >= {"with_cuda", "cuda_version", "torch_version"}
    assert info["torch_version"] == torch.__version__
    assert isinstance(info["with_cuda"], bool)
    assert (info["cuda_version"] is None) == (not info["with_cuda"])


# ---------------------------------------------------------------- HostArena
@pytest.mark.parametrize("nbytes", [1, PAGE, PAGE + 1, 5 * 2**20 + 1, 3 * 2**20 + 12345])
def test_arena_capacity_is_exact_up_to_a_page(nbytes):
    arena = layerwise.HostArena(nbytes, pinned=False)
    assert arena.capacity == (nbytes + PAGE - 1) // PAGE * PAGE  # never rounded to a power of two
    assert arena.used == 0


@pytest.mark.parametrize("alignment", [1, 64, 256, 4096])
def test_arena_alignment_and_disjoint_allocations(alignment):
    arena = layerwise.HostArena(1 << 20, pinned=False)
    spans = []
    for n in [1, 3, 100, 1000, 4097]:
        t = arena.allocate(n, alignment=alignment)
        assert t.dtype == torch.uint8 and t.numel() == n and t.is_contiguous()
        assert t.data_ptr() % alignment == 0
        spans.append((t.data_ptr(), t.data_ptr() + n))
        assert arena.used == t.data_ptr() + n - arena.data_ptr
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


def test_arena_rejects_bad_alignment_and_sizes():
    arena = layerwise.HostArena(4096, pinned=False)
    with pytest.raises(ValueError, match="power of two"):
        arena.allocate(16, alignment=48)
    with pytest.raises(ValueError, match=">= 0"):
        arena.allocate(-1)
    with pytest.raises(ValueError, match=">= 0"):
        layerwise.HostArena(-5)


def test_arena_tensors_outlive_the_arena():
    arena = layerwise.HostArena(1 << 20, pinned=False)
    t = arena.allocate(1 << 19)
    t.copy_(torch.arange(1 << 19, dtype=torch.int64).to(torch.uint8))
    del arena
    gc.collect()
    scratch = [torch.full((1 << 19,), 7, dtype=torch.uint8) for _ in range(8)]  # reuse freed memory, if any
    assert torch.equal(t, torch.arange(1 << 19, dtype=torch.int64).to(torch.uint8))
    del scratch


def test_arena_exhaustion_names_sizes_and_stays_usable():
    arena = layerwise.HostArena(10000, pinned=False)  # capacity 12288
    arena.allocate(8000)
    with pytest.raises(RuntimeError, match=r"exhausted: asked for 5000 bytes .* 4288 of 12288 bytes are free"):
        arena.allocate(5000)
    t = arena.allocate(4000, alignment=64)
    t.fill_(3)
    assert int(t.sum()) == 12000


def test_arena_many_small_allocations():
    arena = layerwise.HostArena(1 << 20, pinned=False)
    ts = [arena.allocate(1 + i % 97, alignment=64) for i in range(2000)]
    for i, t in enumerate(ts):
        t.fill_(i % 251)
    assert all(int(t[0]) == i % 251 and int(t[-1]) == i % 251 for i, t in enumerate(ts))
    assert all(t.data_ptr() % 64 == 0 for t in ts)


def test_arena_pinning_on_cpu_is_mlock_or_plain():
    arena = layerwise.HostArena(1 << 20, pinned=True, cuda=False)
    assert arena.pin_kind == "mlock"
    t = arena.allocate(1 << 19)
    t.fill_(1)
    assert isinstance(arena.pinned, bool)  # False where mlock is not allowed: plain memory, silently
    assert layerwise.HostArena(4096, pinned=False).pinned is False


def test_arena_cuda_pinning_without_cuda_is_a_clear_error():
    if layerwise.build_info()["with_cuda"] and layerwise.build_info()["cuda_devices"]:
        pytest.skip("a CUDA device is present")
    with pytest.raises(RuntimeError, match="built without CUDA|no CUDA device"):
        layerwise.HostArena(4096, pinned=True, cuda=True)


# --------------------------------------------------------------- CopyEngine
def host_and_device(nbytes, device, arena=None):
    src = (arena.allocate(nbytes) if arena is not None else torch.empty(nbytes, dtype=torch.uint8))
    src.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
    dst = torch.full((nbytes,), 0xAB, dtype=torch.uint8, device=device)
    if device == "cuda":  # the fill runs on torch's stream; the engine's copy stream is not ordered after it
        torch.cuda.synchronize()
    return src, dst


@pytest.mark.parametrize("nbytes", [0, 1, 7, 4096, (1 << 20) + 3, 16 << 20])
def test_copy_data_for_many_sizes(device, nbytes):
    engine = layerwise.CopyEngine(device)
    arena = layerwise.HostArena(max(nbytes, 1), pinned=True, cuda=device == "cuda")
    src, dst = host_and_device(nbytes, device, arena)
    ev = engine.copy_async(dst, src)
    ev.synchronize()
    assert ev.query()
    assert torch.equal(dst.cpu(), src)


def test_copy_views_of_other_dtypes(device):
    engine = layerwise.CopyEngine(device)
    src = torch.randn(1000, dtype=torch.float32)
    dst = torch.empty(2000, dtype=torch.bfloat16, device=device)  # same bytes, another dtype
    engine.copy_async(dst, src).synchronize()
    assert torch.equal(dst.cpu().view(torch.float32), src)


def test_after_orders_copies_across_streams(device):
    # Stream 0 fills `mid`; stream 1 copies `mid` on, only after stream 0's event.
    delay = 3000 if device == "cpu" else -1
    engine = layerwise.CopyEngine(device, num_streams=2, debug_delay_us=delay)
    for _ in range(10):
        src = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8)
        mid = torch.zeros(1 << 20, dtype=torch.uint8, device=device)
        out = torch.zeros(1 << 20, dtype=torch.uint8)
        if device == "cuda":
            torch.cuda.synchronize()
        first = engine.copy_async(mid, src)
        second = engine.copy_async(out, mid, after=first)
        second.synchronize()
        assert first.query()
        assert torch.equal(out, src)


def test_copy_rejects_bad_inputs(device):
    engine = layerwise.CopyEngine(device)
    src = torch.zeros(64, 64, dtype=torch.uint8)
    dst = torch.zeros(64, 64, dtype=torch.uint8, device=device)
    with pytest.raises(ValueError, match="dst is not contiguous"):
        engine.copy_async(dst.t(), src)
    with pytest.raises(ValueError, match="src is not contiguous"):
        engine.copy_async(dst, src.t())
    with pytest.raises(ValueError, match="dst has 4096 bytes but src has 4095"):
        engine.copy_async(dst, src.view(-1)[:4095])
    with pytest.raises(ValueError, match="is on meta"):
        engine.copy_async(dst, torch.empty(4096, dtype=torch.uint8, device="meta"))
    with pytest.raises(TypeError):
        engine.copy_async(dst, src, after="not an event")


def test_engine_device_errors():
    with pytest.raises(ValueError, match="unsupported device"):
        layerwise.CopyEngine("meta")
    with pytest.raises(RuntimeError):
        layerwise.CopyEngine("not-a-device")
    with pytest.raises(ValueError, match="num_streams"):
        layerwise.CopyEngine("cpu", num_streams=0)
    if not (layerwise.build_info()["with_cuda"] and layerwise.build_info()["cuda_devices"]):
        with pytest.raises(RuntimeError, match="built without CUDA|no CUDA device"):
            layerwise.CopyEngine("cuda")


def test_copy_runs_off_thread_with_the_gil_released():
    engine = layerwise.CopyEngine("cpu")
    src = torch.ones(256 << 20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst[:1 << 20].zero_()
    big = engine.copy_async(dst, src)
    after = engine.copy_async(torch.empty(1, dtype=torch.uint8), torch.ones(1, dtype=torch.uint8), after=big)
    assert not after.query()  # a 256 MB memcpy takes far longer than submitting it
    ticks = 0
    while not big.query():  # Python keeps running while the copy is in flight
        ticks += 1
    assert ticks > 0
    counter = [0]
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            counter[0] += 1

    th = threading.Thread(target=spin)
    th.start()
    slow = engine.copy_async(dst, src)
    before = counter[0]
    slow.synchronize()  # releases the GIL: the other thread keeps counting
    stop.set()
    th.join()
    assert counter[0] > before
    assert torch.equal(dst, src)


def test_delay_mode_changes_timing_never_data(monkeypatch):
    monkeypatch.setenv("LAYERWISE_DEBUG_COPY_DELAY_US", "2000")
    slow = layerwise.CopyEngine("cpu", num_streams=2)
    assert slow.debug_delay_us == 2000
    fast = layerwise.CopyEngine("cpu", num_streams=2, debug_delay_us=0)
    srcs = [torch.randint(0, 256, (4096 + i,), dtype=torch.uint8) for i in range(60)]

    def run(engine):
        dsts = [torch.zeros_like(s) for s in srcs]
        t0 = time.perf_counter()
        evs = [engine.copy_async(d, s) for d, s in zip(dsts, srcs)]
        for e in evs:
            e.synchronize()
        return time.perf_counter() - t0, dsts

    _, d_fast = run(fast)
    t_slow, d_slow = run(slow)
    assert all(torch.equal(a, s) and torch.equal(b, s) for a, b, s in zip(d_fast, d_slow, srcs))
    # A lower bound only (a loaded machine makes both runs slower, never the delays shorter):
    # 60 copies of up to 2 ms each on 2 workers take ~30 ms on average.
    assert t_slow > 0.01, t_slow


def test_delay_env_must_be_a_number(monkeypatch):
    monkeypatch.setenv("LAYERWISE_DEBUG_COPY_DELAY_US", "soon")
    with pytest.raises(ValueError, match="LAYERWISE_DEBUG_COPY_DELAY_US"):
        layerwise.CopyEngine("cpu")


def test_record_wait_and_elapsed(device):
    engine = layerwise.CopyEngine(device)
    stream = torch.cuda.current_stream().cuda_stream if device == "cuda" else 0
    a = engine.record(stream, timing=True)
    src = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8)
    dst = torch.empty(1 << 20, dtype=torch.uint8, device=device)
    ev = engine.copy_async(dst, src)
    engine.wait(ev, stream)
    b = engine.record(stream, timing=True)
    b.synchronize()
    assert a.query() and b.query()
    assert a.elapsed_ms(b) >= 0.0
    assert torch.equal(dst.cpu(), src)
    engine.synchronize()
