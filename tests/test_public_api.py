"""Every name of docs/design.md's "Public API" lists (the seed's, the second, third and
fourth waves'), called with its documented signature and keywords on small CPU
models, its documented return shapes and keys checked. Tests outside this
repository call these names: a rename or a dropped keyword fails here first.

The fourth wave's lifecycle (is_offloaded, managers_of, removal of what is not
offloaded, report of a plain model, set_residency's warnings and errors) is
checked here too. run_together, share_host and fullgraph compile are not
checked here: they are later work."""
import copy
import inspect
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import layerwise

from helpers.doors import save_checkpoint
from helpers.models import SizedComponent, TwoGroupModel

ROOT = Path(__file__).resolve().parent.parent
GROUPS = ["transformer_blocks", "single_transformer_blocks"]
Manager = layerwise.LayerwiseOffloadManager

# Every name the lists call on the package (tests outside the repository import them).
NAMES = ["configure_layerwise_offload", "remove_layerwise_offload", "build_info", "LayerwiseOffloadManager",
         "offload_pipeline", "remove_pipeline_offload", "report", "load_offloaded", "tune", "TunePlan",
         "is_offloaded", "managers_of"]
SEED_METHODS = ["_managed_parameter_bytes", "_initialize_layer_weights", "_finalize_initialization", "stats"]


def make(seed=0, **kw):
    torch.manual_seed(seed)
    return TwoGroupModel(**kw)


def inputs(n=3, d=32):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(2, d, generator=g) for _ in range(n)]


def outputs(model, xs):
    with torch.no_grad():
        return [model(x) for x in xs]


def same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def same_state(model, ref):
    sd, want = model.state_dict(), ref.state_dict()
    return sd.keys() == want.keys() and all(torch.equal(sd[k], want[k]) for k in want)


def hook_count(model):
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


class Pipe:
    """A pipeline as offload_pipeline takes one: an object holding modules."""

    def __init__(self, seed=0):
        self.transformer = make(seed)
        torch.manual_seed(seed + 1)
        self.vae = nn.Linear(32, 32)  # no block list: moved whole to the device

    def __call__(self, x):
        return self.vae(self.transformer(x))


def test_every_name_is_exported():
    missing = [n for n in NAMES if not hasattr(layerwise, n)]
    assert not missing, missing
    assert set(NAMES) <= set(layerwise.__all__)
    assert all(callable(getattr(Manager, n)) for n in SEED_METHODS)


# ------------------------------------------------------------------- the seed
def test_configure_and_remove_as_the_seed_documents():
    model, ref = make(), make()
    want = outputs(ref, inputs())
    hooks = hook_count(model)
    named = list(reversed(GROUPS))
    managers = layerwise.configure_layerwise_offload(model, layer_names=named, device="cpu", prefetch_depth=1,
                                                     resident_layers=0, pin_memory=True)
    assert isinstance(managers, list) and all(isinstance(m, Manager) for m in managers)
    assert [m.layer_name for m in managers] == named  # in layer_names order
    assert same(outputs(model, inputs()), want)
    assert layerwise.remove_layerwise_offload(model) is model
    assert same_state(model, ref) and hook_count(model) == hooks
    assert same(outputs(model, inputs()), want)


def test_build_info_keys():
    info = layerwise.build_info()
    assert {"with_cuda", "cuda_version", "torch_version"} <= set(info)
    assert isinstance(info["with_cuda"], bool) and info["torch_version"] == torch.__version__


def test_manager_signature_and_stats():
    params = inspect.signature(Manager).parameters
    assert list(params)[:2] == ["model", "layer_name"]
    assert {k: params[k].default for k in ("num_layers", "device", "prefetch_depth", "initialize")} == {
        "num_layers": None, "device": None, "prefetch_depth": 1, "initialize": True}
    model, ref = make(), make()
    m = Manager(model, layer_name=GROUPS[0], num_layers=None, device="cpu", prefetch_depth=1, initialize=True)
    assert same(outputs(model, inputs()), outputs(ref, inputs()))
    s = m.stats()
    assert s["bytes_copied"] > 0 and s["copies"] > 0 and s["stall_s"] >= 0.0  # bytes, copies, stall time
    layerwise.remove_layerwise_offload(model)


def test_managed_parameter_bytes_is_the_local_bytes_of_the_matched_layers():
    model = SizedComponent()
    m = Manager(model, "large_blocks", num_layers=2, device="cpu", initialize=False)
    assert m._managed_parameter_bytes() == 2 * (64 * 64 + 64) * 4  # layers 0 and 1 of 3: index < num_layers
    model = make()
    for name in GROUPS:
        m = Manager(model, name, device="cpu", initialize=False)
        want = sum(p.numel() * p.element_size() for p in getattr(model, name).parameters())
        assert m._managed_parameter_bytes() == want


def test_the_size_ordered_initialisation_sorts_by_managed_parameter_bytes(monkeypatch):
    """configure packs the group that _managed_parameter_bytes() calls the largest
    first (here it is told the small group is larger: the order follows the method)."""
    told = {"small_blocks": 10**9, "large_blocks": 1}
    packed = []
    pack = Manager._initialize_layer_weights

    def record(self, fill=None):
        packed.append(self.layer_name)
        return pack(self, fill)

    monkeypatch.setattr(Manager, "_managed_parameter_bytes", lambda self: told[self.layer_name])
    monkeypatch.setattr(Manager, "_initialize_layer_weights", record)
    model = SizedComponent()
    layerwise.configure_layerwise_offload(model, ["large_blocks", "small_blocks"], device="cpu")
    assert packed == ["small_blocks", "large_blocks"]
    layerwise.remove_layerwise_offload(model)
    packed.clear()
    pipe = Pipe()
    pipe.other = SizedComponent()
    layerwise.offload_pipeline(pipe, device="cpu", components={"other": ["large_blocks", "small_blocks"]})
    assert packed == ["small_blocks", "large_blocks"]  # (configure_models: several models' groups)
    layerwise.remove_pipeline_offload(pipe)


@pytest.mark.parametrize("make_model,groups", [(make, GROUPS), (SizedComponent, ["small_blocks", "large_blocks"])],
                         ids=["two-groups", "sized"])
def test_the_seeds_multi_group_flow_by_hand(make_model, groups):
    """The seed's order, called by a test outside the front doors: every manager built
    with initialize=False, packed largest first by _managed_parameter_bytes(), ONE
    model.to, every manager finalised in declaration order. Bitwise the resident
    model, and the model is then offloaded as configure leaves it (managers_of,
    removal, report)."""
    model = make_model()
    ref = copy.deepcopy(model)
    xs = inputs(d=16 if make_model is SizedComponent else 32)
    want = outputs(ref, xs)
    hooks = hook_count(model)
    managers = [Manager(model, name, device="cpu", initialize=False) for name in groups]
    assert not layerwise.is_offloaded(model)
    for m in sorted(managers, key=lambda m: -m._managed_parameter_bytes()):
        m._initialize_layer_weights()
    assert all(p.shape == (1,) for m in managers for lp in m.plan.layers for e in lp.params for p in [e.param])
    model.to("cpu")
    for m in managers:
        m._finalize_initialization()
    for _ in range(3):
        assert same(outputs(model, xs), want)
    assert layerwise.managers_of(model) == managers and layerwise.is_offloaded(model)
    assert managers[0].next_manager is managers[1] and managers[1].next_manager is managers[0]
    assert same_state(model, ref)
    assert layerwise.report(model)["offloaded"] and len(layerwise.report(model)["groups"]) == 2
    assert layerwise.remove_layerwise_offload(model) is model
    assert not layerwise.is_offloaded(model) and hook_count(model) == hooks and same_state(model, ref)
    assert same(outputs(model, xs), want)


# ------------------------------------------------------------ the second wave
def test_offload_pipeline_returns_managers_per_component_and_is_removed():
    pipe, ref = Pipe(), Pipe()
    x = inputs()[0]
    with torch.no_grad():
        want = ref(x)
    out = layerwise.offload_pipeline(pipe, device=None, components="auto", prefetch_depth=1, pin_budget="auto",
                                     host_budget=None, device_budget=None, pin_memory="auto")
    assert isinstance(out, dict) and list(out) == ["transformer"]  # {component name: [managers]}
    assert [m.layer_name for m in out["transformer"]] == GROUPS
    assert all(isinstance(m, Manager) for ms in out.values() for m in ms)
    with torch.no_grad():
        assert torch.equal(pipe(x), want)
    rep = layerwise.report(pipe)
    assert rep["offloaded"] and {r["component"] for r in rep["components"]} == {"transformer", "vae"}
    assert layerwise.remove_pipeline_offload(pipe) is pipe
    assert not layerwise.is_offloaded(pipe) and same_state(pipe.transformer, ref.transformer)


DISK = {"d": 128, "n_a": 12, "n_b": 6}  # layers large enough against the disk tier's fixed costs


def _disk_budget(model, keep):
    """A host_budget that holds about `keep` layers of the model's first group in memory
    (the planner's accounting, layerwise.planning.host_budget, as tests/stages/test_disk_tier.py counts it)."""
    lb = max(sum(p.numel() * p.element_size() for p in b.parameters()) for name in GROUPS
             for b in getattr(model, name)) + 4096
    managed = {id(p) for name in GROUPS for p in getattr(model, name).parameters()}
    fixed = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in managed)
    return int(2 * (2 * (lb + 12 * 4096)) + lb + keep * lb + fixed + 2 * 4 * lb)


def _check_stats(managers, disk: bool):
    stats = [m.stats(sync=True) for m in managers]
    # What crossed the bus in the last full step (a group whose every layer has a slot of its own
    # keeps them there: nothing to copy again)
    assert all(s["last_step"]["bytes_copied"] >= 0 for s in stats)
    assert sum(s["last_step"]["bytes_copied"] for s in stats) > 0
    for m, s in zip(managers, stats):
        assert s["arena_bytes"] >= 0 and isinstance(s["arena_pinned"], bool)
        assert s["managed_bytes"] == m._managed_parameter_bytes()
    if disk:
        on_disk = [m.stats()["disk"] for m in managers if m.stats()["disk"] is not None]
        assert on_disk and all(d["layers"] for d in on_disk)  # the layers on disk
        assert sum(d["bytes_read"] for d in on_disk) > 0  # cumulative bytes read


@pytest.mark.parametrize("compress", [None, "lossless"])
def test_configure_with_the_second_waves_options(compress, tmp_path):
    model, ref = make(**DISK), make(**DISK)
    xs = inputs(d=128)
    want = outputs(ref, xs)
    managers = layerwise.configure_layerwise_offload(model, GROUPS, device="cpu", host_budget=_disk_budget(model, 2),
                                                     spill_dir=tmp_path, compress=compress, split_fetch=None)
    for _ in range(2):
        assert same(outputs(model, xs), want)
    _check_stats(managers, disk=True)
    layerwise.remove_layerwise_offload(model)
    assert same_state(model, ref)


def test_configure_with_split_fetch_takes_a_process_group():
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.fail("a process group is initialised already in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model, ref = make(), make()
        managers = layerwise.configure_layerwise_offload(model, GROUPS, device="cpu", split_fetch=dist.group.WORLD)
        assert same(outputs(model, inputs()), outputs(ref, inputs()))
        _check_stats(managers, disk=False)
        layerwise.remove_layerwise_offload(model)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("budget", ["bytes", "auto"])
def test_load_offloaded_signature(budget, tmp_path):
    ref = make(**DISK)
    path = tmp_path / "model.safetensors"
    save_checkpoint(ref, path)
    with torch.device("meta"):
        model = TwoGroupModel(**DISK)
    host_budget = _disk_budget(ref, 2) if budget == "bytes" else "auto"
    managers = layerwise.load_offloaded(model, path, GROUPS, device="cpu", host_budget=host_budget, dtype=None,
                                        compress=None, split_fetch=None, spill_dir=tmp_path)
    assert [m.layer_name for m in managers] == GROUPS
    xs = inputs(d=128)
    for _ in range(2):
        assert same(outputs(model, xs), outputs(ref, xs))
    _check_stats(managers, disk=budget == "bytes")
    layerwise.remove_layerwise_offload(model)
    assert same_state(model, ref)


# ------------------------------------------------------------- the third wave
def _mixtral():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(cfg).eval()


def _logits(model):
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("door", ["configure_layerwise_offload", "load_offloaded", "offload_pipeline"])
@pytest.mark.parametrize("cache", [None, 1 << 16, "auto"])
def test_routed_experts_and_expert_cache_at_every_front_door(door, cache, tmp_path):
    ref = _mixtral()
    want = _logits(ref)
    kw = {"device": "cpu", "experts": "routed", "expert_cache": cache, "residency_policy": "strided"}
    if door == "configure_layerwise_offload":
        model = copy.deepcopy(ref)
        managers = layerwise.configure_layerwise_offload(model, ["model.layers"], **kw)
    elif door == "load_offloaded":
        path = tmp_path / "model.safetensors"
        save_checkpoint(ref, path)
        with torch.device("meta"):
            model = type(ref)(ref.config).eval()
        managers = layerwise.load_offloaded(model, path, ["model.layers"], **kw)
    else:
        holder = Pipe()
        holder.lm = model = copy.deepcopy(ref)
        managers = layerwise.offload_pipeline(holder, components={"lm": ["model.layers"]}, **kw)["lm"]
    (m,) = managers
    assert m.experts is not None and m.options.expert_cache == cache and m.residency_policy == "strided"
    assert torch.equal(_logits(model), want)
    assert m.stats(sync=True)["last_step"]["bytes_copied"] > 0


@pytest.mark.parametrize("policy", ["leading", "strided"])
def test_residency_policy(policy):
    model = make(n_a=6)
    (m, _) = layerwise.configure_layerwise_offload(model, GROUPS, device="cpu", resident_layers=2,
                                                   residency_policy=policy)
    assert m.resident == ([0, 1] if policy == "leading" else [0, 3])
    layerwise.remove_layerwise_offload(model)


def test_tune_plan_has_the_named_figures_as_items_and_attributes():
    model, ref = make(), make()
    layerwise.configure_layerwise_offload(model, GROUPS, device="cpu")
    x = inputs()[0]
    plan = layerwise.tune(model, lambda m: m(x), device_budget=1 << 30)
    assert isinstance(plan, layerwise.TunePlan)
    assert plan["predicted_step_s"] == plan.predicted_step_s == plan.predicted_s > 0
    assert plan["measured_step_s"] == plan.measured_step_s == plan.measured_s > 0
    assert plan["predicted_s"] == plan.predicted_s and plan["floor_s"] == plan.floor_s
    assert {"predicted_step_s", "measured_step_s", "groups", "applied"} <= set(plan.keys())
    assert dict(plan)["measured_step_s"] == plan.measured_s and "predicted_step_s" in plan
    with pytest.raises(KeyError, match="no item 'predicted'"):
        plan["predicted"]
    assert same(outputs(model, inputs()), outputs(ref, inputs()))  # applied in place, still exact
    layerwise.remove_layerwise_offload(model)


def test_tune_takes_a_pipeline():
    pipe = Pipe()
    layerwise.offload_pipeline(pipe, device="cpu")
    x = inputs()[0]
    plan = layerwise.tune(pipe, lambda p: p(x), device_budget=1 << 30, apply=False)
    assert plan["measured_step_s"] is None and plan.measured_step_s is None and plan["predicted_step_s"] > 0
    layerwise.remove_pipeline_offload(pipe)


def _run_with_env(code: str, **env) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("LAYERWISE_SIM_BUS_")}
    full["PYTHONPATH"] = f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    full.update(env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=full,
                          timeout=120, cwd=ROOT, check=False)


def test_the_simulated_bus_variables():
    code = """
        import layerwise
        engine = layerwise.CopyEngine("cpu")
        print(dict(layerwise._native._C.sim_bus()))
    """
    proc = _run_with_env(code, LAYERWISE_SIM_BUS_GBPS="2.5", LAYERWISE_SIM_BUS_LATENCY_US="7",
                         LAYERWISE_SIM_BUS_PAGEABLE_GBPS="0.5")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == str({"gbps": 2.5, "pageable_gbps": 0.5, "latency_us": 7.0})
    proc = _run_with_env(code, LAYERWISE_SIM_BUS_LATENCY_US="7")
    assert proc.returncode != 0 and "give LAYERWISE_SIM_BUS_GBPS too" in proc.stderr


# ------------------------------------------------------------ the fourth wave
def test_is_offloaded_and_managers_of_a_model():
    model = make()
    assert layerwise.is_offloaded(model) is False and layerwise.managers_of(model) == []
    managers = layerwise.configure_layerwise_offload(model, GROUPS, device="cpu")
    assert layerwise.is_offloaded(model) is True and layerwise.managers_of(model) == managers
    holder = nn.Sequential(model)  # a module holding an offloaded model is not itself configured
    assert not layerwise.is_offloaded(holder) and layerwise.managers_of(holder) == []
    layerwise.remove_layerwise_offload(model)
    assert layerwise.is_offloaded(model) is False and layerwise.managers_of(model) == []


def test_is_offloaded_and_managers_of_a_pipeline():
    pipe = Pipe()
    pipe.second = make(seed=3)
    assert not layerwise.is_offloaded(pipe) and layerwise.managers_of(pipe) == []
    out = layerwise.offload_pipeline(pipe, device="cpu")
    assert layerwise.is_offloaded(pipe)
    assert layerwise.managers_of(pipe) == out["transformer"] + out["second"]  # component by component, in order
    layerwise.remove_pipeline_offload(pipe)
    assert not layerwise.is_offloaded(pipe) and layerwise.managers_of(pipe) == []
    own = layerwise.configure_layerwise_offload(pipe.second, GROUPS[:1], device="cpu")  # a component on its own
    assert layerwise.is_offloaded(pipe) and layerwise.managers_of(pipe) == own
    layerwise.remove_layerwise_offload(pipe.second)
    for bad in (None, 3, "model"):
        with pytest.raises(TypeError, match="takes a model .* or a pipeline"):
            layerwise.is_offloaded(bad)
        with pytest.raises(TypeError, match="takes a model .* or a pipeline"):
            layerwise.managers_of(bad)


def test_removing_what_is_not_offloaded_is_a_no_op():
    model, ref = make(), make()
    hooks = hook_count(model)
    assert layerwise.remove_layerwise_offload(model) is model  # never configured
    assert same_state(model, ref) and hook_count(model) == hooks
    layerwise.configure_layerwise_offload(model, GROUPS, device="cpu")
    layerwise.remove_layerwise_offload(model)
    assert layerwise.remove_layerwise_offload(model) is model  # removed already
    assert same_state(model, ref) and hook_count(model) == hooks
    pipe = Pipe()
    assert layerwise.remove_pipeline_offload(pipe) is pipe  # never offloaded
    layerwise.offload_pipeline(pipe, device="cpu")
    layerwise.remove_pipeline_offload(pipe)
    assert layerwise.remove_pipeline_offload(pipe) is pipe  # removed already
    # A component streamed on its own is not offload_pipeline's: remove_pipeline_offload leaves it.
    layerwise.configure_layerwise_offload(pipe.transformer, GROUPS, device="cpu")
    assert layerwise.remove_pipeline_offload(pipe) is pipe and layerwise.is_offloaded(pipe.transformer)
    layerwise.remove_layerwise_offload(pipe.transformer)
    # The two removals are not interchangeable: the wrong one is refused, not a silent no-op.
    with pytest.raises(TypeError, match="remove_pipeline_offload"):
        layerwise.remove_layerwise_offload(pipe)
    with pytest.raises(TypeError, match="remove_layerwise_offload"):
        layerwise.remove_pipeline_offload(model)


def test_report_of_what_is_not_offloaded_says_so():
    model = make()
    rep = layerwise.report(model)
    assert rep["offloaded"] is False and rep["groups"] == []
    assert str(rep) == rep["text"] and "TwoGroupModel is not offloaded" in str(rep)
    pipe = Pipe()
    rep = layerwise.report(pipe)
    assert rep["offloaded"] is False and rep["components"] == [] and "Pipe is not offloaded" in str(rep)
    assert layerwise.report_pipeline(pipe) == rep
    layerwise.configure_layerwise_offload(pipe.transformer, GROUPS, device="cpu")
    rep = layerwise.report(pipe)  # not offload_pipeline's, but a component streams on its own
    assert rep["offloaded"] is True and rep["streamed_components"] == ["transformer"]
    assert "layerwise.report(pipe.transformer)" in str(rep)
    assert layerwise.report(pipe.transformer)["offloaded"] is True
    layerwise.remove_layerwise_offload(pipe.transformer)


def _warnings(caplog, call):
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="layerwise"):
        call()
    return [r.getMessage() for r in caplog.records if "more than layer group" in r.getMessage()]


def test_set_residency_warns_as_configure_does_and_names_its_own_arguments(caplog):
    model = make()
    warned = _warnings(caplog, lambda: layerwise.configure_layerwise_offload(model, GROUPS[0], device="cpu",
                                                                               resident_layers=1.5))
    assert warned == [("layerwise: resident_layers=1.5 is more than layer group 'transformer_blocks' holds "
                       "(5 layers): every layer of it is resident")]
    layerwise.remove_layerwise_offload(model)
    (m,) = layerwise.configure_layerwise_offload(model, GROUPS[0], device="cpu")
    for value in (1.5, 7):
        warned = _warnings(caplog, lambda value=value: m.set_residency(value))
        assert warned == [(f"layerwise: resident={value} is more than layer group 'transformer_blocks' holds "
                           "(5 layers): every layer of it is resident")]
        assert m.resident == list(range(5))
        m.set_residency(0)
    for value, exc, match in [(-1, ValueError, "resident must be >= 0, got -1"),
                              ("2", TypeError, r"resident must be an int \(layers\) or a fraction"),
                              (float("nan"), ValueError, r"a fractional resident must lie in \[0, 1\]"),
                              ([0, 9], ValueError, r"set_residency: resident= must be layer indices in \[0, 5\)"),
                              ]:
        with pytest.raises(exc, match=match) as info:
            m.set_residency(value)
        assert "resident_layers" not in str(info.value)
    with pytest.raises(ValueError, match="prefetch_depth must be >= 0, got -1"):
        m.set_residency(0, prefetch_depth=-1)
    assert m.resident == [] and m.prefetch_depth == 1
    layerwise.remove_layerwise_offload(model)
