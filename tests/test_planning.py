"""Device-memory planner (device_budget) and layerwise.report, on the CPU engine's accounting."""
import pytest
import torch

import layerwise
from layerwise.budget import non_layer_bytes
from models import TwoGroupModel

GROUPS = ["transformer_blocks", "single_transformer_blocks"]


def make():
    torch.manual_seed(0)
    return TwoGroupModel(n_a=8, n_b=4)


def used_device_bytes(model, managers):
    return non_layer_bytes(model, managers) + sum(m.stats()["ring_bytes"] + m.stats()["resident_bytes"]
                                                  for m in managers)


def layer_bytes(model):
    probe = layerwise.LayerwiseOffloadManager(model, GROUPS[0], device="cpu", initialize=False)
    return probe.plan.layers[0].nbytes


@pytest.mark.parametrize("extra_layers", [0, 3, 7, 100])
def test_budget_picks_the_most_resident_layers_that_fit(extra_layers):
    model, ref = make(), make()
    lb = layer_bytes(model)
    probe = [layerwise.LayerwiseOffloadManager(model, g, device="cpu", initialize=False) for g in GROUPS]
    floor = non_layer_bytes(model, probe) + sum(m._device_bytes([], 1) for m in probe)
    budget = floor + extra_layers * lb
    managers = layerwise.configure_layerwise_offload(model, GROUPS, device="cpu", prefetch_depth=1,
                                                     device_budget=budget)
    used = used_device_bytes(model, managers)
    assert used <= budget
    resident = sum(len(m.resident) for m in managers)
    if extra_layers == 0:
        assert resident == 0
    elif extra_layers >= 100:
        assert resident == 12  # everything fits: everything stays
    else:
        assert resident > 0
    x = torch.randn(2, 32)
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))


def test_budget_too_small_names_the_bytes_and_changes_nothing():
    model = make()
    before = {n: p.data_ptr() for n, p in model.named_parameters()}
    with pytest.raises(RuntimeError, match=r"device_budget of 1000 bytes is too small: .* needs \d+ bytes"):
        layerwise.configure_layerwise_offload(model, GROUPS, device="cpu", device_budget=1000)
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == before


def test_budget_lowers_the_prefetch_depth_before_giving_up():
    model = make()
    probe = [layerwise.LayerwiseOffloadManager(model, g, device="cpu", initialize=False) for g in GROUPS]
    need_depth0 = non_layer_bytes(model, probe) + sum(m._device_bytes([], 0) for m in probe)
    need_depth2 = non_layer_bytes(model, probe) + sum(m._device_bytes([], 2) for m in probe)
    assert need_depth0 < need_depth2
    managers = layerwise.configure_layerwise_offload(model, GROUPS, device="cpu", prefetch_depth=2,
                                                     device_budget=need_depth0)
    assert all(m.prefetch_depth == 0 for m in managers)
    assert used_device_bytes(model, managers) <= need_depth0


def test_auto_budget_and_bad_values(monkeypatch):
    import layerwise.budget as B

    monkeypatch.setattr(B, "free_device_bytes", lambda dev: (10 << 30, 16 << 30))
    assert B.resolve_budget(torch.device("cpu"), "auto", None) == (10 << 30) - int(0.1 * (16 << 30))
    assert B.resolve_budget(torch.device("cpu"), "auto", 1 << 30) == 9 << 30
    for bad in ("lots", -1, True):
        with pytest.raises(ValueError, match="device_budget"):
            B.resolve_budget(torch.device("cpu"), bad, None)
    model = make()
    managers = layerwise.configure_layerwise_offload(model, GROUPS, device="cpu", device_budget="auto")
    assert sum(len(m.resident) for m in managers) == 12  # a tiny model fits in 10 GiB


def test_report_is_a_table_and_a_dict():
    model = make()
    lb = layer_bytes(model)
    layerwise.configure_layerwise_offload(model, GROUPS, device="cpu", prefetch_depth=1)
    x = torch.randn(2, 32)
    with torch.no_grad():
        for _ in range(3):
            model(x)
    r = layerwise.report(model)
    a, b = r["groups"]
    assert a["group"] == GROUPS[0] and a["copies_per_step"] == 8 and a["bytes_per_step"] == 8 * lb
    assert r["total"]["bytes_per_step"] == a["bytes_per_step"] + b["bytes_per_step"]
    assert r["total"]["ring_bytes"] == a["ring_bytes"] + b["ring_bytes"] > 0
    assert a["gbps"] > 0 and r["total"]["sync_loads"] == 0
    text = str(r)
    assert "transformer_blocks" in text and "total" in text and "GB/s" in text
    with pytest.raises(RuntimeError, match="not configured"):
        layerwise.report(make())
