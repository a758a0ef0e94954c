"""LayerwiseOffloadManager and configure_layerwise_offload on the CPU backend
(and CUDA, where present): exact outputs, startup order, races, errors."""
import copy
import gc
import itertools
import subprocess
import sys
import textwrap
import weakref

import pytest
import torch

import layerwise
from layerwise.configure import managers_of

from helpers.models import NestedNames, SizedComponent, TiedModel, TwoGroupModel

GROUPS = ["transformer_blocks", "single_transformer_blocks"]


def make(seed=0, **kw):
    torch.manual_seed(seed)
    return TwoGroupModel(**kw)


def resident_outputs(model, xs, device="cpu", **fwd):
    """Outputs of a resident copy of `model` on `device` (same kernels as the streamed run), on the host."""
    ref = copy.deepcopy(model).to(device)
    with torch.no_grad():
        return [ref(x.to(device), **fwd).cpu() for x in xs]


def snapshot(model):
    return {n: (p.data_ptr(), tuple(p.shape), p.device) for n, p in model.named_parameters()}


def hook_count(model):
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


def assert_equal_outputs(model, xs, refs, device, **fwd):
    with torch.no_grad():
        for x, ref in zip(xs, refs):
            out = model(x.to(device), **fwd)
            assert torch.equal(out.cpu(), ref), (out.cpu() - ref).abs().max()


# ------------------------------------------------------- multi-group startup
@pytest.mark.parametrize("order", [["small_blocks", "large_blocks"], ["large_blocks", "small_blocks"]])
def test_largest_group_packs_first_and_model_to_runs_once(order, monkeypatch):
    model = SizedComponent()
    packed = []
    orig = layerwise.LayerwiseOffloadManager._initialize_layer_weights

    def record(self, fill=None):
        packed.append(self.layer_name)
        return orig(self, fill)

    monkeypatch.setattr(layerwise.LayerwiseOffloadManager, "_initialize_layer_weights", record)
    managers = layerwise.configure_layerwise_offload(model, order, device="cpu")
    assert [m.layer_name for m in managers] == order  # declaration order
    assert packed == ["large_blocks", "small_blocks"]  # largest first, whatever the order named
    assert len(model.to_calls) == 1
    call = model.to_calls[0]
    assert call["layer_shapes"] and all(s == (1,) for s in call["layer_shapes"])
    assert call["bytes"] == model.non_layer_bytes()


def test_naive_per_group_order_moves_whole_unpacked_groups():
    # The baseline configure avoids: each manager moves the model right after its own group.
    for order in itertools.permutations(["small_blocks", "large_blocks"]):
        model = SizedComponent()
        for name in order:
            layerwise.LayerwiseOffloadManager(model, name, device="cpu")
        moved = [c["bytes"] for c in model.to_calls]
        assert len(moved) == 2 and moved[0] > model.non_layer_bytes()
        layerwise.remove_layerwise_offload(model)


def test_managed_parameter_bytes_counts_only_matched_layers():
    model = SizedComponent()
    m = layerwise.LayerwiseOffloadManager(model, "large_blocks", num_layers=2, device="cpu", initialize=False)
    assert m.plan.managed_bytes == 2 * (64 * 64 + 64) * 4
    assert m.num_layers == 2 and m.enabled


def test_nested_list_of_the_same_name_is_not_captured():
    torch.manual_seed(0)
    model = NestedNames()
    ref_model = copy.deepcopy(model)
    m = layerwise.LayerwiseOffloadManager(model, "blocks", device="cpu", initialize=False)
    names = {e.qualname for lp in m.plan.layers for e in lp.params}
    assert names == {f"blocks.{i}.{k}" for i in range(3) for k in ("weight", "bias")}
    managers = layerwise.configure_layerwise_offload(model, "blocks", device="cpu")
    assert all(p.shape != (1,) for p in model.encoder.parameters())
    x = torch.randn(2, 8)
    with torch.no_grad():
        assert torch.equal(model(x), ref_model(x))
    assert managers[0].num_layers == 3


# ---------------------------------------------------------- bitwise outputs
@pytest.mark.parametrize("depth", [0, 1, 2, 3, 4])
def test_outputs_bitwise_for_every_prefetch_depth(device, depth):
    model = make()
    xs = [torch.randn(3, 32) for _ in range(3)]
    refs = resident_outputs(model, xs, device)
    layerwise.configure_layerwise_offload(model, GROUPS, device=device, prefetch_depth=depth)
    for _ in range(2):
        assert_equal_outputs(model, xs, refs, device)


@pytest.mark.parametrize("resident,policy", [(1, "leading"), (2, "strided"), (0.5, "leading"), (0.4, "strided"),
                                             (10, "leading")])
def test_outputs_bitwise_with_resident_layers(device, resident, policy):
    model = make(n_a=6)
    xs = [torch.randn(2, 32) for _ in range(2)]
    refs = resident_outputs(model, xs, device)
    managers = layerwise.configure_layerwise_offload(model, GROUPS, device=device, prefetch_depth=1,
                                                     resident_layers=resident, residency_policy=policy)
    a = managers[0]
    expected = {(1, "leading"): [0], (2, "strided"): [0, 3], (0.5, "leading"): [0, 1, 2],
                (0.4, "strided"): [0, 3], (10, "leading"): list(range(6))}[(resident, policy)]
    assert a.resident == expected
    for _ in range(3):
        assert_equal_outputs(model, xs, refs, device)
    copies = a.stats()["copies"]
    assert_equal_outputs(model, xs[:1], refs[:1], device)
    assert a.stats()["copies"] - copies <= 6 - len(expected)  # resident layers are never copied


@pytest.mark.parametrize("order_a", [[0, 2, 4], [4, 3, 2, 1, 0], [1, 1, 1, 3], [2], [0, 1, 2, 3, 4, 0, 1]])
def test_out_of_order_calls_load_synchronously_and_stay_exact(device, order_a):
    model = make(n_a=6)  # 6 layers, depth 1: two slots shared by three layers each
    xs = [torch.randn(2, 32) for _ in range(2)]
    refs = resident_outputs(model, xs, device, order_a=order_a, order_b=[2, 0])
    managers = layerwise.configure_layerwise_offload(model, GROUPS, device=device, prefetch_depth=1)
    for _ in range(2):
        assert_equal_outputs(model, xs, refs, device, order_a=order_a, order_b=[2, 0])
    if order_a != [0, 2, 4]:
        assert managers[0].stats()["sync_loads"] > 0


def test_a_single_layer_called_alone(device):
    model = make()
    x = torch.randn(2, 32)
    resident = copy.deepcopy(model).to(device)
    with torch.no_grad():
        ref = [resident.transformer_blocks[i](x.to(device)).cpu() for i in (3, 1, 3)]
    layerwise.configure_layerwise_offload(model, GROUPS, device=device)
    with torch.no_grad():
        for i, r in zip((3, 1, 3), ref):
            assert torch.equal(model.transformer_blocks[i](x.to(device)).cpu(), r)


def test_inference_mode_and_no_grad_then_autograd(device):
    model = make()
    xs = [torch.randn(2, 32)]
    refs = resident_outputs(model, xs, device)
    layerwise.configure_layerwise_offload(model, GROUPS, device=device)
    with torch.inference_mode():
        for _ in range(2):
            out = model(xs[0].to(device))
            assert torch.equal(out.cpu(), refs[0])
    # Weights reloaded under inference_mode are not inference tensors: autograd still works.
    assert not any(p.is_inference() for p in model.parameters())
    out = model(xs[0].to(device))
    assert out.requires_grad and torch.equal(out.detach().cpu(), refs[0])


def test_tied_weights_stay_resident_and_exact(caplog):
    torch.manual_seed(0)
    model = TiedModel()
    x = torch.randn(3, 16)
    with torch.no_grad():
        ref = model(x)
    with caplog.at_level("INFO", logger="layerwise"):
        managers = layerwise.configure_layerwise_offload(model, "blocks", device="cpu", prefetch_depth=1)
    assert "tied parameter" in caplog.text and "blocks.1.weight" in caplog.text
    managed = {e.qualname for lp in managers[0].plan.layers for e in lp.params}
    assert not any(n.startswith(("blocks.0.0", "blocks.2.0", "blocks.1.weight")) for n in managed)
    assert "blocks.1.bias" in managed and "blocks.3.weight" in managed
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(model(x), ref)


def test_strides_and_alignment_survive():
    model = make()
    layerwise.configure_layerwise_offload(model, GROUPS, device="cpu")
    for blk in model.transformer_blocks:
        assert blk.down_t.stride() == (1, 64)
        assert blk.up.weight.is_contiguous()
    for p in model.parameters():
        assert p.data_ptr() % 64 == 0


# ------------------------------------------------------------------- races
@pytest.mark.parametrize("depth,streams", [(1, 1), (2, 2), (3, 1)])
def test_random_copy_delays_never_change_outputs(depth, streams):
    model = make(n_a=7, n_b=4)
    xs = [torch.randn(2, 32) for _ in range(4)]
    refs = resident_outputs(model, xs)
    layerwise.configure_layerwise_offload(model, GROUPS, device="cpu", prefetch_depth=depth,
                                          num_copy_streams=streams, debug_copy_delay_us=1500)
    for _ in range(6):
        assert_equal_outputs(model, xs, refs, "cpu")
    with torch.no_grad():  # out of order under delays too
        ref = resident_outputs(make(n_a=7, n_b=4), xs[:1], order_a=[6, 0, 3, 3], order_b=[3, 1])[0]
        assert torch.equal(model(xs[0], order_a=[6, 0, 3, 3], order_b=[3, 1]), ref)


def test_delay_mode_from_the_environment(monkeypatch):
    monkeypatch.setenv("LAYERWISE_DEBUG_COPY_DELAY_US", "800")
    model = make()
    xs = [torch.randn(2, 32)]
    refs = resident_outputs(model, xs)
    managers = layerwise.configure_layerwise_offload(model, GROUPS, device="cpu", prefetch_depth=2)
    assert managers[0]._engine.debug_delay_us == 800
    for _ in range(5):
        assert_equal_outputs(model, xs, refs, "cpu")


# ---------------------------------------------------- stats, leaks, remove
def test_stats_count_copies_and_steps():
    model = make(n_a=6, n_b=3)
    layerwise.configure_layerwise_offload(model, GROUPS, device="cpu", prefetch_depth=1)
    a, b = managers_of(model)
    x = torch.randn(2, 32)
    with torch.no_grad():
        for _ in range(4):
            model(x)
    s = a.stats()
    assert s["steps"] == 4 and s["sync_loads"] == 0 and s["stall_s"] >= 0
    per_layer = a.plan.layers[0].nbytes
    # 6 layers in 2 slots: every layer is copied once per step.
    assert s["slots"] == 2 and s["last_step"]["copies"] == 6
    assert s["last_step"]["bytes_copied"] == 6 * per_layer
    assert s["ring_bytes"] == 2 * per_layer and s["arena_bytes"] >= 6 * per_layer
    # 3 layers at depth 1 need 3 slots (a cycle of odd length): each keeps its own, no copies after the first.
    assert b.stats()["slots"] == 3 and b.stats()["last_step"]["copies"] == 0


@pytest.mark.parametrize("n", range(1, 40))
@pytest.mark.parametrize("depth", [0, 1, 2, 3, 5])
def test_slot_assignment_keeps_every_prefetch_window_distinct(n, depth):
    from layerwise.planning.layout import assign_slots

    slots, count = assign_slots(n, depth)
    assert len(slots) == n and set(slots) == set(range(count))
    window = min(depth + 1, n)
    for i in range(n):  # cyclic: the last layers prefetch the first ones of the next step
        w = [slots[(i + k) % n] for k in range(window)]
        assert len(set(w)) == window, (i, w)
    assert count >= window and count <= max(window, 2 * depth + 1)
    if n % (depth + 1) == 0:
        assert count == depth + 1


def test_memory_flat_over_500_forwards():
    psutil = pytest.importorskip("psutil")
    model = make(d=64, n_a=4, n_b=2)
    layerwise.configure_layerwise_offload(model, GROUPS, device="cpu", prefetch_depth=2)
    x = torch.randn(4, 64)
    proc = psutil.Process()
    with torch.no_grad():
        for _ in range(50):
            model(x)
        rss0 = proc.memory_info().rss
        for _ in range(500):
            model(x)
        rss1 = proc.memory_info().rss
    assert rss1 - rss0 < 4 << 20, (rss0, rss1)


def test_remove_restores_state_dict_and_leaves_no_hooks(device):
    model = make()
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    strides = {n: p.stride() for n, p in model.named_parameters()}
    hooks = hook_count(model)
    managers = layerwise.configure_layerwise_offload(model, GROUPS, device=device, prefetch_depth=2)
    assert hook_count(model) > hooks
    with torch.no_grad():
        model(torch.randn(2, 32, device=device))
    held = [weakref.ref(t) for m in managers for t in m.ring.slots + [b for b in m._host.blocks if b is not None]]
    out = layerwise.remove_layerwise_offload(model)
    assert out is model and hook_count(model) == hooks and not managers_of(model)
    assert all(m._host.arena is None and m.ring is None for m in managers)
    gc.collect()
    assert not any(r() is not None for r in held)  # ring and arena freed, though the managers live on
    for k, v in model.state_dict().items():
        assert torch.equal(v.cpu(), sd[k]), k
    assert {n: p.stride() for n, p in model.named_parameters()} == strides
    # configurable again after removal
    layerwise.configure_layerwise_offload(model, GROUPS, device=device)


def test_host_memory_while_packing_stays_within_two_layers():
    # A ~1.5 GB model packed in a subprocess: peak RSS may rise by about one
    # layer (the ring's first slot) plus a few percent, not by a second model.
    code = textwrap.dedent("""
        import psutil, torch, layerwise
        import torch._dynamo  # a one-time ~150 MB import (the hooks use torch.compiler.disable): not per model
        from torch import nn
        L, D = 12, 3200                      # 12 layers x 3 x (3200 x 3200 fp32) = 1.47 GB
        class B(nn.Module):
            def __init__(self):
                super().__init__()
                self.a, self.b, self.c = (nn.Linear(D, D, bias=False) for _ in range(3))
        m = nn.Module(); m.blocks = nn.ModuleList(B() for _ in range(L))
        layer = 3 * D * D * 4
        base = psutil.Process().memory_info().rss
        layerwise.configure_layerwise_offload(m, "blocks", device="cpu", prefetch_depth=1)
        # VmHWM: this process's own high-water mark (ru_maxrss can carry the parent's over exec)
        peak = int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM:")).split()[1]) * 1024
        print((peak - base) / layer, base / 2**30)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rise_in_layers, model_gib = map(float, out.stdout.split())
    assert model_gib > 1.3
    assert rise_in_layers <= 2 + 0.05 * 12, rise_in_layers


# --------------------------------------------------------- bad configuration
BAD = [
    (dict(layer_names="nope"), ValueError, "'nope' does not exist"),
    (dict(layer_names="embed"), TypeError, "'embed' is a Linear, not an nn.ModuleList"),
    (dict(layer_names=GROUPS + ["transformer_blocks"]), ValueError, "named twice"),
    (dict(layer_names=["transformer_blocks", "transformer_blocks.0"]), TypeError, "not an nn.ModuleList"),
    (dict(layer_names=[]), ValueError, "empty"),
    (dict(layer_names=5), TypeError, "layer_names must be"),
    (dict(layer_names=GROUPS, prefetch_depth=-1), ValueError, "prefetch_depth must be >= 0, got -1"),
    (dict(layer_names=GROUPS, prefetch_depth=1.5), TypeError, "prefetch_depth must be an int"),
    (dict(layer_names=GROUPS, device="cuda:7"), RuntimeError, "cuda:7"),
    (dict(layer_names=GROUPS, device="tpu"), ValueError, "'tpu'"),
    (dict(layer_names=GROUPS, resident_layers=-1), ValueError, "resident_layers must be >= 0"),
    (dict(layer_names=GROUPS, resident_layers=-0.5), ValueError, r"\[0, 1\]"),  # (1.5: every layer, a WARNING)
    (dict(layer_names=GROUPS, residency_policy="random"), ValueError, "residency_policy"),
]


@pytest.mark.parametrize("kwargs,exc,match", BAD)
def test_bad_configuration_fails_before_touching_the_model(kwargs, exc, match):
    model = make()
    before, hooks = snapshot(model), hook_count(model)
    with pytest.raises(exc, match=match):
        layerwise.configure_layerwise_offload(model, device=kwargs.pop("device", "cpu"), **kwargs)
    assert snapshot(model) == before and hook_count(model) == hooks and not managers_of(model)


def test_nested_and_overlapping_groups_are_rejected():
    model = NestedNames()
    model.alias = model.blocks  # the same ModuleList under a second name
    before = snapshot(model)
    with pytest.raises(ValueError, match="'blocks' and 'alias' are the same module"):
        layerwise.configure_layerwise_offload(model, ["blocks", "alias"], device="cpu")
    outer = torch.nn.Module()
    outer.blocks = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(4, 4)) for _ in range(2)])
    outer.blocks_inner = outer.blocks[0]  # a Sequential inside another group
    with pytest.raises(ValueError, match="overlap"):
        layerwise.configure_layerwise_offload(outer, ["blocks", "blocks_inner"], device="cpu")
    deep = TwoGroupModel()
    deep.transformer_blocks[0].inner = torch.nn.ModuleList([torch.nn.Linear(4, 4)])
    with pytest.raises(ValueError, match="nested inside"):
        layerwise.configure_layerwise_offload(deep, ["transformer_blocks", "transformer_blocks.0.inner"],
                                              device="cpu")
    assert snapshot(model) == before


def test_configuring_twice_is_rejected():
    model = make()
    layerwise.configure_layerwise_offload(model, GROUPS, device="cpu")
    before = snapshot(model)
    with pytest.raises(RuntimeError, match="already configured"):
        layerwise.configure_layerwise_offload(model, GROUPS, device="cpu")
    with pytest.raises(RuntimeError, match="already offloaded"):
        layerwise.LayerwiseOffloadManager(model, "transformer_blocks", device="cpu")
    assert snapshot(model) == before


def test_failure_half_way_puts_the_model_back(monkeypatch):
    model = make()
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    before, hooks = snapshot(model), hook_count(model)
    calls = []
    orig = layerwise.LayerwiseOffloadManager._finalize_initialization

    def fail_second(self):
        calls.append(self.layer_name)
        if len(calls) == 2:
            raise MemoryError("simulated: no room for the ring")
        return orig(self)

    monkeypatch.setattr(layerwise.LayerwiseOffloadManager, "_finalize_initialization", fail_second)
    with pytest.raises(MemoryError, match="simulated"):
        layerwise.configure_layerwise_offload(model, GROUPS, device="cpu")
    assert hook_count(model) == hooks and not managers_of(model)
    assert {n: (s, d) for n, (_, s, d) in snapshot(model).items()} == {n: (s, d) for n, (_, s, d) in before.items()}
    for k, v in model.state_dict().items():
        assert torch.equal(v, sd[k]), k
    assert all(getattr(m, "_layerwise_manager", None) is None for m in model.modules())


@pytest.mark.parametrize("depth", [1, 2])
def test_the_next_layers_copies_are_queued_before_a_layer_is_waited_for(depth, monkeypatch):
    """Found with the simulated bus (python -m layerwise.bench bus): at prefetch
    depth 1 a transfer-bound step took 1.13-1.25x the floor, because the pre-hook queued
    the next layer's copy only after waiting for this layer's; on the CPU backend that
    wait blocks the host, so the bus idled between layers. At each wait, the copies of
    the next `depth` layers must already be queued."""
    from layerwise.runtime.meter import Meter

    torch.manual_seed(0)
    model = TwoGroupModel(n_a=6, n_b=1)
    ref = copy.deepcopy(model)
    (m,) = layerwise.configure_layerwise_offload(model, "transformer_blocks", device="cpu", prefetch_depth=depth)
    queued_at_wait = []
    real = Meter.wait

    def wait(self, engine, ev, stream):
        if self is m.meter:
            queued_at_wait.append(sum(f is not None for f in m.ring.fetched))
        return real(self, engine, ev, stream)

    monkeypatch.setattr(Meter, "wait", wait)
    x = torch.randn(2, 32)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(model(x), ref(x))
    assert queued_at_wait and min(queued_at_wait) >= depth + 1, queued_at_wait  # this layer's and the next depth
