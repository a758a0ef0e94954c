"""Device-memory planner (device_budget), on the CPU engine's accounting: it never
overrides an explicit argument, and every change it makes is a WARNING with the figures."""
import logging

import pytest
import torch

import layerwise
from layerwise.planning.device_budget import fmt_bytes, non_layer_bytes

from helpers.doors import front_door, save_checkpoint
from helpers.models import TwoGroupModel

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


def needs(model, depth):
    """(non-layer bytes, ring bytes with nothing resident at `depth`) of the two groups."""
    probe = [layerwise.LayerwiseOffloadManager(model, g, device="cpu", initialize=False) for g in GROUPS]
    return non_layer_bytes(model, probe), sum(m.device_bytes([], depth) for m in probe)


def warnings_of(caplog):
    """The planner's warnings (a group where streaming saves nothing has a WARNING of its own: test_report)."""
    return [r for r in caplog.records if r.name == "layerwise" and r.levelno >= logging.WARNING
            and "streaming saves no device memory" not in r.getMessage()]


def infos_of(caplog):
    return [r for r in caplog.records if r.name == "layerwise" and r.levelno == logging.INFO]


@pytest.mark.parametrize("extra_layers", [0, 3, 7, 100])
def test_budget_picks_the_most_resident_layers_that_fit(extra_layers, caplog):
    model, ref = make(), make()
    lb = layer_bytes(model)
    fixed, ring = needs(model, 1)
    budget = fixed + ring + extra_layers * lb
    with caplog.at_level(logging.INFO, logger="layerwise"):
        managers = layerwise.configure_layerwise_offload(model, GROUPS, device="cpu", prefetch_depth=1,
                                                         device_budget=budget)
    used = used_device_bytes(model, managers)
    assert used <= budget
    assert all(m.prefetch_depth == 1 for m in managers)
    resident = sum(len(m.resident) for m in managers)
    if extra_layers == 0:
        assert resident == 0
        # Nothing changed from what was asked: INFO only, no warning.
        assert warnings_of(caplog) == []
        assert any("as asked" in r.getMessage() for r in infos_of(caplog))
    elif extra_layers >= 100:
        assert resident == 12  # everything fits: everything stays
    else:
        assert resident > 0
    if resident:
        # Residency the planner chose is a WARNING with the figures behind it.
        (w,) = warnings_of(caplog)
        msg = w.getMessage()
        assert f"made {resident} layer(s) resident" in msg
        for m in managers:
            assert f"{m.layer_name}: {len(m.resident)} of {m.num_layers}" in msg
        assert f"device_budget {fmt_bytes(budget)} ({budget} bytes)" in msg
        assert f"non-layer weights and buffers {fmt_bytes(fixed)}" in msg
        assert f"{fmt_bytes(ring)} at depth 1" in msg
        assert f"{fmt_bytes(used)} of {fmt_bytes(budget)} used" in msg
    x = torch.randn(2, 32)
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))


def test_budget_too_small_names_the_bytes_and_changes_nothing():
    model = make()
    before = {n: p.data_ptr() for n, p in model.named_parameters()}
    with pytest.raises(RuntimeError, match=r"device_budget of 1000 bytes is too small: .* needs \d+ bytes"):
        layerwise.configure_layerwise_offload(model, GROUPS, device="cpu", device_budget=1000)
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == before


def test_budget_lowering_the_prefetch_depth_is_a_warning_with_the_ring_bytes(caplog):
    model = make()
    fixed, ring2 = needs(model, 2)
    _, ring1 = needs(model, 1)
    _, ring0 = needs(model, 0)
    assert ring0 < ring1 < ring2
    with caplog.at_level(logging.INFO, logger="layerwise"):
        managers = layerwise.configure_layerwise_offload(model, GROUPS, device="cpu", prefetch_depth=2,
                                                         device_budget=fixed + ring1)
    assert all(m.prefetch_depth == 1 for m in managers)
    assert sum(len(m.resident) for m in managers) == 0
    (w,) = warnings_of(caplog)
    msg = w.getMessage()
    assert "prefetch_depth=2 does not fit" in msg and "lowered to 1" in msg
    for d, r in ((2, ring2), (1, ring1), (0, ring0)):
        assert f"{fmt_bytes(r)} at depth {d}" in msg
    assert "synchronously" not in msg  # depth 1 still overlaps


def test_budget_dropping_to_depth_0_warns_that_every_load_is_synchronous(caplog):
    model = make()
    fixed, ring0 = needs(model, 0)
    _, ring1 = needs(model, 1)
    with caplog.at_level(logging.INFO, logger="layerwise"):
        managers = layerwise.configure_layerwise_offload(model, GROUPS, device="cpu", prefetch_depth=2,
                                                         device_budget=fixed + ring0)
    assert all(m.prefetch_depth == 0 for m in managers)
    assert used_device_bytes(model, managers) <= fixed + ring0
    (w,) = warnings_of(caplog)
    msg = w.getMessage()
    assert "lowered to 0" in msg
    assert "every layer loads synchronously" in msg and "no overlap" in msg
    assert f"a budget of {fixed + ring1} bytes would allow prefetch depth 1" in msg
    x = torch.randn(2, 32)
    with torch.no_grad():
        model(x)
        model(x)
    assert sum(m.stats()["sync_loads"] for m in managers) > 0  # what the warning said


@pytest.mark.parametrize("resident", [2, 0.5])
def test_budget_and_explicit_resident_layers_is_an_error(resident):
    model = make()
    before = {n: p.data_ptr() for n, p in model.named_parameters()}
    for budget in (10 << 30, "auto"):
        with pytest.raises(ValueError, match=r"device_budget=.* and resident_layers=.* were both given: pass one"):
            layerwise.configure_layerwise_offload(model, GROUPS, device="cpu", resident_layers=resident,
                                                  device_budget=budget)
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == before
    assert not layerwise.configure.managers_of(model)
    # Without a budget the explicit residency is used as given.
    managers = layerwise.configure_layerwise_offload(model, GROUPS, device="cpu", resident_layers=resident)
    assert [len(m.resident) for m in managers] == ([2, 2] if resident == 2 else [4, 2])


@pytest.mark.parametrize("zero", [0, 0.0])
def test_budget_with_resident_layers_zero_is_the_default(zero):
    model = make()
    managers = layerwise.configure_layerwise_offload(model, GROUPS, device="cpu", resident_layers=zero,
                                                     device_budget=10 << 30)
    assert sum(len(m.resident) for m in managers) == 12


def test_load_offloaded_refuses_budget_with_explicit_resident_layers(tmp_path):
    from safetensors.torch import save_file

    sd = {k: v.contiguous() for k, v in make().state_dict().items()}
    path = tmp_path / "model.safetensors"
    save_file(sd, str(path))
    with torch.device("meta"):
        model = TwoGroupModel(n_a=8, n_b=4)
    with pytest.raises(ValueError, match="pass one of them"):
        layerwise.load_offloaded(model, path, GROUPS, device="cpu", resident_layers=1, device_budget=10 << 30)
    assert all(p.is_meta for p in model.parameters())


def test_auto_budget_arithmetic_and_bad_values(monkeypatch):
    import layerwise.planning.device_budget as B

    monkeypatch.setattr(B, "free_device_bytes", lambda dev: (10 << 30, 16 << 30))
    cuda = torch.device("cuda", 0)  # only a device object: nothing runs on it
    assert B.resolve_budget(cuda, "auto", None) == (10 << 30) - int(0.1 * (16 << 30))
    assert B.resolve_budget(cuda, "auto", 1 << 30) == 9 << 30
    for bad in ("lots", -1, True):  # refused where the options are built (the planner takes valid values)
        with pytest.raises(ValueError, match="device_budget"):
            layerwise.OffloadOptions.build(device="cpu", device_budget=bad)
    with pytest.raises(ValueError, match="device_budget"):
        layerwise.configure_layerwise_offload(make(), GROUPS, device="cpu", device_budget="lots")


@pytest.mark.parametrize("depth", [0, 2])
def test_auto_budget_on_cpu_plans_nothing_and_says_so(monkeypatch, caplog, depth):
    import layerwise.planning.device_budget as B

    def no_probe(dev):
        raise AssertionError("free RAM must not drive the plan on a CPU device")

    monkeypatch.setattr(B, "free_device_bytes", no_probe)
    model, ref = make(), make()
    with caplog.at_level(logging.INFO, logger="layerwise"):
        managers = layerwise.configure_layerwise_offload(model, GROUPS, device="cpu", prefetch_depth=depth,
                                                         device_budget="auto")
    assert [len(m.resident) for m in managers] == [0, 0]  # nothing made resident for free RAM
    assert all(m.prefetch_depth == depth for m in managers)
    assert warnings_of(caplog) == []
    assert any("device_budget='auto' on a CPU device plans nothing" in r.getMessage()
               and f"prefetch depth stays {depth}" in r.getMessage() for r in infos_of(caplog))
    x = torch.randn(2, 32)
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))


def test_bytes_budget_on_cpu_is_planned_as_on_cuda():
    model = make()
    fixed, ring = needs(model, 1)
    managers = layerwise.configure_layerwise_offload(model, GROUPS, device="cpu",
                                                     device_budget=fixed + ring + 2 * layer_bytes(model))
    assert sum(len(m.resident) for m in managers) > 0


def test_fmt_bytes():
    assert fmt_bytes(0) == "0 B" and fmt_bytes(1023) == "1023 B"
    assert fmt_bytes(1536) == "1.5 KiB" and fmt_bytes(3 << 20) == "3.0 MiB" and fmt_bytes(5 << 40) == "5120.0 GiB"


# ------------------------------------------- bad argument values, every front door
INF, NAN = float("inf"), float("nan")
BAD = {  # argument: bad values (each must be refused naming the argument, the model unchanged)
    "device": ["tpu", 3.5, "cuda:x"],
    "prefetch_depth": [INF, NAN, -1, 1.5, "1", None],
    "resident_layers": [INF, NAN, -1, "1", None, -0.5],
    "residency_policy": ["first", 3, None],
    "pin_memory": ["yes", 2, None],
    "device_budget": [INF, NAN, -1, "lots", [1], True],
    "budget_margin": [INF, NAN, -1, "x", True],
    "num_copy_streams": [0, INF, NAN, 1.5, "2", None],
    "debug_copy_delay_us": [-1, INF, NAN, "x", 1.5],
    "debug_read_delay_us": [-1, INF, NAN, "x", 1.5],
    "compress": ["zstd", True, 1],
    "host_budget": [INF, NAN, -1, "lots", [1], True],
    "disk_prefetch_depth": [0, INF, NAN, "2", 1.5],
}
ONLY = {
    "offload_pipeline": {"pin_budget": [INF, NAN, -1, "lots", [1], True],
                         "components": [{"model": 3}, 3, {"model": [3]}, {"nope": "auto"}, ["model", 3]],
                         "uses": [{"model": INF}, {"model": NAN}, {"model": -1}, 3]},
    "load_offloaded": {"dtype": ["bf16", torch.int8, 16], "strict": ["yes", None, 1]},
    "configure_layerwise_offload": {},
}


def _front_door(door, tmp_path):
    """(call(**kwargs), the model it configures)."""
    path = tmp_path / "model.safetensors"
    if door == "load_offloaded" and not path.exists():
        save_checkpoint(make(), path)
    return front_door(door, make, GROUPS, path)


@pytest.mark.parametrize("door", list(ONLY))
def test_bad_argument_values_are_refused_naming_the_argument(door, tmp_path):
    from layerwise.configure import managers_of

    table = {**BAD, **ONLY[door]}
    wrong = []
    for name, values in table.items():
        for value in values:
            call, model = _front_door(door, tmp_path)
            before = {k: v.clone() for k, v in model.state_dict().items()}
            try:
                call(**{name: value})
            except (ValueError, TypeError, RuntimeError) as e:
                if name not in str(e):
                    wrong.append(f"{name}={value!r}: {type(e).__name__}: {e}")
            except Exception as e:  # noqa: BLE001 (OverflowError & co: the point of the test)
                wrong.append(f"{name}={value!r}: {type(e).__name__}: {e}")
            else:
                wrong.append(f"{name}={value!r}: accepted")
            if managers_of(model):
                wrong.append(f"{name}={value!r}: left the model configured")
                layerwise.remove_layerwise_offload(model)
            now = model.state_dict()
            if now.keys() != before.keys() or not all(
                    (v.is_meta and now[k].is_meta) if v.is_meta or now[k].is_meta else torch.equal(now[k], v)
                    for k, v in before.items()):
                wrong.append(f"{name}={value!r}: changed the model")
    assert not wrong, "\n".join(wrong)


# ------------------------------------ tier sizes known before packing (layerwise.planning.routes)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_encoded_size_is_exact_without_encoding(dtype):
    """routes.encoded_layer_bytes gives the byte count encode_layer gives, from the
    parameters alone: strided parameters, alignment gaps, a constant tensor, mixed dtypes."""
    from torch import nn

    from layerwise.planning import routes
    from layerwise.planning.layout import build_group_plan
    from layerwise.stages.decode import encode_layer

    torch.manual_seed(0)
    blocks = nn.Sequential(*[nn.Sequential(nn.Linear(300, 77), nn.LayerNorm(77)) for _ in range(3)]).to(dtype)
    blocks[1][0].weight.data = blocks[1][0].weight.data.t().contiguous().t()  # transposed
    blocks[2][1].weight.data.zero_()  # one symbol only
    blocks[0][1].float()  # an fp32 segment (stored, behind a header)
    plan = build_group_plan(nn.ModuleDict({"b": blocks}), "b")
    for lp in plan.layers:
        block = torch.zeros(lp.nbytes, dtype=torch.uint8)  # packed as the manager packs it
        for e in lp.params:
            d = e.param.data
            flat = torch.as_strided(d, (e.span,), (1,), d.storage_offset()).view(torch.uint8)
            block[e.offset : e.offset + e.span_bytes].copy_(flat)
        enc, _ = encode_layer(block, lp)
        assert routes.encoded_layer_bytes(lp) == enc.numel() < lp.nbytes


def test_planned_host_bytes_count_each_layer_at_its_tier():
    from types import SimpleNamespace

    from layerwise.planning import routes
    from layerwise.planning.layout import BLOCK_ALIGN, round_up

    model = make()
    m = layerwise.LayerwiseOffloadManager(model, GROUPS[0], device="cpu", initialize=False)
    raw = [round_up(lp.nbytes, BLOCK_ALIGN) for lp in m.plan.layers]
    assert routes.planned_host_bytes(m) == m._arena_capacity() == sum(raw)
    # split fetch: layers 0-3 are this rank's share (a quarter), layer 7 stays on disk
    share = {i: (0, 0, m.plan.layers[i].nbytes // 4) for i in range(4)}
    m.tiers.use_split(SimpleNamespace(spans=share))
    m.tiers.keep_on_disk({7})
    per = routes.layer_host_bytes(m)
    assert [per[i] for i in range(4)] == [round_up(m.plan.layers[i].nbytes // 4, BLOCK_ALIGN) for i in range(4)]
    assert per[7] == 0 and [per[i] for i in (4, 5, 6)] == raw[4:7]
    assert [r.describe() for r in m.tier_plan()][3:8] == [
        f"arena, share [0, {m.plan.layers[3].nbytes // 4})", "arena", "arena", "arena", "spill"]
    m.tiers.use_split(None)
    m.tiers.keep_on_disk(())
    m.compress = "lossless"  # encoded: at their encoded size, page-rounded
    per = routes.layer_host_bytes(m)
    assert all(per[i] == round_up(routes.encoded_layer_bytes(lp), BLOCK_ALIGN) < raw[i]
               for i, lp in enumerate(m.plan.layers))
