"""The CUDA path as a GPU will see it, checked where the CPU backend or a mock can
show it (issue 12): stats() and report() never drain the device, copies split at
pinned-registration boundaries stay exact, copy time is measured for GB/s, and
the arena is created for the device it streams to. Hook order and capture are in
test_contract.py."""
import copy

import pytest
import torch

import layerwise
from layerwise import _native
from layerwise.configure import managers_of
from models import TwoGroupModel

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
            for h in m._src[i].holders():
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


def test_every_copy_reports_its_duration_on_the_cpu_backend():
    engine = _native.CopyEngine("cpu")
    src, dst = torch.randn(1 << 20), torch.empty(1 << 20)
    ev = engine.copy_async(dst, src)
    ev.synchronize()
    assert ev.copy_ms > 0 and torch.equal(dst, src)
    assert engine.record().copy_ms == -1.0
