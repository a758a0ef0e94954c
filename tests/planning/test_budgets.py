"""Budgets kept after configure, and the routed experts' cache sized and kept true:

- the expert cache is counted wherever device bytes are planned (the device-budget
  planner at configure, layerwise.tune) and, on a CPU device, host bytes;
- it holds at most what the streamed experts take (a bigger ask is capped, and
  stats() says so), and nothing where no expert streams;
- a write through a state_dict() tensor reaches it (the source's version grows);
- host_budget is checked wherever the bytes held change after configure: a
  load_state_dict that re-encodes layers larger, set_residency and tune on a
  CPU device (refused before anything changes, naming the budget)."""
import copy
import re

import pytest
import torch
from torch import nn

import layerwise
from layerwise.planning.device_budget import non_layer_bytes

transformers = pytest.importorskip("transformers")

V = 128


def _mixtral(layers=6, seed=0):
    torch.manual_seed(seed)
    cfg = transformers.MixtralConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                                     num_experts_per_tok=2, max_position_embeddings=128)
    return transformers.MixtralForCausalLM(cfg).eval()


def _ids(batch=2, tokens=6, seed=1):
    return torch.randint(3, V, (batch, tokens), generator=torch.Generator().manual_seed(seed))


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def _configure(model, **kw):
    kw.setdefault("debug_copy_delay_us", 200)
    return layerwise.configure_layerwise_offload(model, "model.layers", device="cpu", experts="routed", **kw)


def _expert_bytes(model, layers=None):
    """Bytes of the expert parameters of `layers` (default: all)."""
    out = 0
    for i, layer in enumerate(model.model.layers):
        if layers is None or i in layers:
            out += sum(p.numel() * p.element_size() for p in layer.mlp.experts.parameters())
    return out


def _device_held(model, m) -> int:
    st = m.stats()
    return non_layer_bytes(model, [m]) + st["ring_bytes"] + st["resident_bytes"] + st["experts"]["cache_bytes"]


# ------------------------------------------------------------ the cache's size
def test_expert_cache_is_capped_at_the_streamed_experts():
    ref = _mixtral()
    model = copy.deepcopy(ref)
    ids = _ids()
    (m,) = _configure(model, expert_cache=1 << 30, resident_layers=2)
    st = m.stats()["experts"]
    streamed = _expert_bytes(model, [i for i in range(6) if i not in m.resident])
    assert st["cache_bytes"] == streamed  # (one expert's rows are a multiple of the entry alignment here)
    assert st["cache_asked_bytes"] == 1 << 30
    assert st["cache_entries"] == 8 * (6 - 2)
    assert "capped" in str(layerwise.report(model))
    assert torch.equal(_logits(model, ids), _logits(ref, ids))
    assert torch.equal(_logits(model, ids), _logits(ref, ids))
    assert m.stats()["experts"]["cache_hits"] > 0


def test_an_ample_cache_serves_every_layer_it_holds_after_set_residency():
    ref = _mixtral()
    model = copy.deepcopy(ref)
    ids = _ids()
    (m,) = _configure(model, expert_cache=1 << 30, resident_layers=4)
    assert m.stats()["experts"]["cache_entries"] == 16
    m.set_residency([0])  # five MoE layers stream now: the 16 entries are shared out
    for _ in range(3):
        assert torch.equal(_logits(model, ids), _logits(ref, ids))
    assert m.stats()["experts"]["cache_bytes"] == _expert_bytes(model, [4, 5])  # its size is fixed


@pytest.mark.parametrize("cache", ["auto", 1 << 20])
def test_expert_cache_with_every_layer_resident_holds_nothing(cache):
    ref = _mixtral()
    model = copy.deepcopy(ref)
    ids = _ids()
    (m,) = _configure(model, expert_cache=cache, resident_layers=6)
    st = m.stats()["experts"]
    assert st["cache_bytes"] == 0 and st["cache_entries"] == 0
    assert torch.equal(_logits(model, ids), _logits(ref, ids))


def test_a_write_through_state_dict_reaches_the_expert_cache():
    ref = _mixtral()
    model = copy.deepcopy(ref)
    ids = _ids()
    (m,) = _configure(model, expert_cache=1 << 30)
    assert torch.equal(_logits(model, ids), _logits(ref, ids))  # warm: every expert used is cached
    assert m.stats()["experts"]["cached"] > 0
    key = "model.layers.1.mlp.experts.gate_up_proj"
    sd = model.state_dict()
    with torch.no_grad():
        sd[key].mul_(1.5)  # a state_dict() tensor aliases the arena: documented to reach the model
        ref.model.layers[1].mlp.experts.gate_up_proj.mul_(1.5)
    for _ in range(2):
        assert torch.equal(_logits(model, ids), _logits(ref, ids))
    assert torch.equal(model.state_dict()[key], ref.state_dict()[key])


# ------------------------------------------------------- device budgets count it
@pytest.mark.parametrize("auto", [False, True])
def test_configure_counts_the_expert_cache_in_its_device_budget(auto):
    model = _mixtral()
    ids = _ids()
    ref = copy.deepcopy(model)
    probe = copy.deepcopy(model)
    (p,) = _configure(probe)
    fixed, ring, layer = non_layer_bytes(probe, [p]), p.device_bytes([], 1), max(lp.nbytes for lp in p.plan.layers)
    layerwise.remove_layerwise_offload(probe)
    cache = _expert_bytes(model, [0, 1])
    budget = fixed + ring + 3 * layer  # three layers resident, were it not for the cache
    (m,) = _configure(model, expert_cache="auto" if auto else cache, device_budget=budget)
    held = m.stats()["experts"]["cache_bytes"]
    if auto:  # a quarter of the experts, at most a quarter of what the rings leave of the budget
        assert 0 < held <= min(_expert_bytes(model) // 4, 3 * layer // 4)
    else:
        assert held == cache
    assert _device_held(model, m) <= budget
    assert len(m.resident) < 3
    assert torch.equal(_logits(model, ids), _logits(ref, ids))


@pytest.fixture
def slow_bus(monkeypatch):
    """The CPU backend's simulated bus at 0.02 GB/s (csrc/sim_bus.h: read by each engine
    when it is created), so that a copy costs more than the compute it overlaps and
    tune makes layers resident; turned off again for the engines created after."""
    monkeypatch.setenv("LAYERWISE_SIM_BUS_GBPS", "0.02")
    yield
    monkeypatch.delenv("LAYERWISE_SIM_BUS_GBPS")
    layerwise._native.CopyEngine("cpu")  # (the bus is one per process: this engine turns it off)


def test_tune_counts_the_expert_cache_in_its_device_budget(slow_bus):
    ref = _mixtral()
    model = copy.deepcopy(ref)
    ids = _ids()
    (m,) = _configure(model, expert_cache=1 << 30, debug_copy_delay_us=None)  # every expert: all hits when warm
    cache = m.stats()["experts"]["cache_bytes"]
    fixed = non_layer_bytes(model, [m])
    layer = max(lp.nbytes for lp in m.plan.layers)
    budget = fixed + m.device_bytes([], 1) + cache + layer  # the cache and one layer resident
    plan = layerwise.tune(model, lambda mm: mm(ids), device_budget=budget, depths=(1,), repeats=1)
    held = _device_held(model, m)
    assert held <= budget and plan.device_bytes == held
    assert len(m.resident) <= 1 and m.stats()["experts"]["cache_bytes"] == cache
    assert torch.equal(_logits(model, ids), _logits(ref, ids))


# ------------------------------------------------- host budgets after configure
class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.fc2 = nn.Linear(width, width)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc(x))) + x


class Net(nn.Module):
    def __init__(self, width=256, depth=6):
        super().__init__()
        self.embed = nn.Linear(width, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))

    def forward(self, x):
        x = self.embed(x)
        for b in self.blocks:
            x = b(x)
        return x


def _net(zeros=False, seed=0):
    torch.manual_seed(seed)
    net = Net().to(torch.bfloat16)
    if zeros:
        with torch.no_grad():
            for p in net.blocks.parameters():
                p.zero_()
    return net


def _host_used(model) -> int:
    return layerwise.report(model)["host_budget"]["used_bytes"]


def _configured_at_its_need(model, slack: int, **kw):
    """`model` offloaded (CPU device) with a host_budget of what it needs (found on a
    copy: what report() counts plus the packing scratch, one layer) plus `slack`."""
    probe = copy.deepcopy(model)
    (p,) = layerwise.configure_layerwise_offload(probe, "blocks", device="cpu", host_budget=1 << 40, **kw)
    need = _host_used(probe) + max(lp.nbytes for lp in p.plan.layers) + 4096 * p.num_layers  # (page-rounded blocks)
    layerwise.remove_layerwise_offload(probe)
    budget = need + slack
    (m,) = layerwise.configure_layerwise_offload(model, "blocks", device="cpu", host_budget=budget, **kw)
    return m, budget


def test_the_host_planner_counts_the_blocks_resident_layers_keep():
    model = _net()
    with pytest.raises(ValueError, match="host memory needs") as err:
        layerwise.configure_layerwise_offload(copy.deepcopy(model), "blocks", device="cpu", host_budget=1,
                                              resident_layers=2)
    need = int(re.search(r"host memory needs [^(]*\((\d+) bytes", str(err.value))[1])
    layerwise.configure_layerwise_offload(model, "blocks", device="cpu", host_budget=need, resident_layers=2)
    assert _host_used(model) <= need  # (a resident layer's host block stays, besides its device copy)


def test_a_load_that_re_encodes_layers_larger_is_refused_within_the_host_budget():
    model = _net(zeros=True)  # encodes to almost nothing: the budget is planned on that
    m, budget = _configured_at_its_need(model, 0, compress="lossless")
    assert m.stats()["compress"]["layers_raw"] == []
    ckpt = _net().state_dict()  # random weights: they encode to most of their bytes
    with pytest.raises(RuntimeError, match="host_budget") as err:
        model.load_state_dict(ckpt)
    assert "raise host_budget" in str(err.value) and "layer blocks[" in str(err.value)
    assert _host_used(model) <= budget
    # what was refused kept its bytes; the model computes with what it holds, exactly
    held = {k: v.clone() for k, v in model.state_dict().items()}
    assert any(not torch.equal(held[k], ckpt[k]) for k in ckpt)
    twin = _net()
    twin.load_state_dict(held)
    x = torch.randn(4, 256).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(model(x), twin(x))


def test_a_load_that_fits_the_host_budget_is_taken():
    model = _net(zeros=True)
    _, budget = _configured_at_its_need(model, 6 * 2 * 256 * 258 * 2, compress="lossless")  # room for raw layers
    ckpt = _net().state_dict()
    model.load_state_dict(ckpt)
    assert _host_used(model) <= budget
    twin = _net()
    x = torch.randn(4, 256).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(model(x), twin(x))


def test_set_residency_on_a_cpu_device_keeps_the_host_budget():
    model = _net()
    ref = _net()
    layer = sum(p.numel() * p.element_size() for p in model.blocks[0].parameters())
    m, budget = _configured_at_its_need(model, int(1.5 * layer))
    with pytest.raises(RuntimeError, match="host_budget") as err:
        m.set_residency([0, 1, 2])
    assert "set_residency" in str(err.value)
    assert m.resident == [] and _host_used(model) <= budget
    m.set_residency([0])  # one layer fits
    assert m.resident == [0] and _host_used(model) <= budget
    x = torch.randn(4, 256).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))


def test_tune_on_a_cpu_device_keeps_the_host_budget(slow_bus):
    """On a slow bus with every expert cached tune makes every layer it may resident;
    on a CPU device they are host memory, so the host budget caps them."""
    ref = _mixtral()
    model = copy.deepcopy(ref)
    ids = _ids()
    cache = _expert_bytes(model)  # every expert: all hits when warm

    def host_held(mm, m):  # (on a CPU device: arenas, non-layer weights, rings, resident layers, the cache)
        st = m.stats()
        return st["arena_bytes"] + _device_held(mm, m)

    kw = {"expert_cache": cache, "debug_copy_delay_us": None}
    probe = copy.deepcopy(model)
    (p,) = _configure(probe, host_budget=1 << 40, **kw)
    layer = max(lp.nbytes for lp in p.plan.layers)
    # its need (with the packing scratch and page-rounded blocks), and room for 1.5 layers more
    budget = host_held(probe, p) + layer + 4096 * 6 + layer + layer // 2
    layerwise.remove_layerwise_offload(probe)
    (m,) = _configure(model, host_budget=budget, **kw)
    plan = layerwise.tune(model, lambda mm: mm(ids), device_budget=1 << 40, depths=(1,), repeats=1)
    assert host_held(model, m) <= budget
    assert len(m.resident) <= 2 and plan.groups[0]["resident"] == m.resident  # (the packing scratch is free again)
    assert layerwise.report(model)["host_budget"]["used_bytes"] <= budget
    assert torch.equal(_logits(model, ids), _logits(ref, ids))
