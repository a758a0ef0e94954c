"""layerwise.offload_pipeline on a tiny Flux-architecture diffusers pipeline (CPU
backend): exact images, placement and pins as the report says, the pin budget
(cgroup / memlock reading against fake files), the startup order across
components, rollback, removal, and the pipeline calls that are refused."""
import json
import subprocess
import sys

import pytest
import torch
from torch import nn

import layerwise
from layerwise import pipelines
from layerwise.configure import managers_of
from layerwise.planning import host_limits

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from layerwise.bench.pipeline import SIZES, generate, tiny_flux_pipeline  # noqa: E402

SIZE = SIZES["tiny"]
MODULES = ("vae", "text_encoder", "text_encoder_2", "transformer")
KiB = 1024


@pytest.fixture(scope="module")
def reference():
    return generate(tiny_flux_pipeline(SIZE), SIZE)


@pytest.fixture
def pipe():
    return tiny_flux_pipeline(SIZE)


def state_dicts(pipe):
    return {n: {k: v.clone() for k, v in getattr(pipe, n).state_dict().items()} for n in MODULES}


def assert_state_dicts_equal(pipe, before):
    for n in MODULES:
        now = getattr(pipe, n).state_dict()
        assert now.keys() == before[n].keys(), n
        for k, v in before[n].items():
            assert torch.equal(now[k], v), f"{n}.{k}"


def hook_count(module):
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in module.modules())


def can_mlock(nbytes):
    return layerwise.HostArena(nbytes, pinned=True, cuda=False).pinned


# --------------------------------------------------------------- exactness
def test_offloaded_pipeline_image_is_bitwise_equal(pipe, reference):
    managers = layerwise.offload_pipeline(pipe, device="cpu")
    assert set(managers) == set(MODULES)  # every component of the tiny Flux has block lists
    assert [m.layer_name for m in managers["transformer"]] == ["transformer_blocks", "single_transformer_blocks"]
    assert pipe.device == torch.device("cpu") and pipe._execution_device == torch.device("cpu")
    pipe.set_progress_bar_config(disable=True, leave=False)  # the usual pipeline calls keep working
    for _ in range(2):  # repeated requests stay exact
        out = generate(pipe, SIZE)
        assert torch.equal(out, reference), (out - reference).abs().max()
    latent = generate(pipe, SIZE, output_type="latent")
    layerwise.remove_pipeline_offload(pipe)
    assert torch.equal(latent, generate(pipe, SIZE, output_type="latent"))


def test_components_stream_and_stay_resident_as_the_report_says(pipe, reference):
    managers = layerwise.offload_pipeline(
        pipe, device="cpu", components={"transformer": "auto", "text_encoder_2": ["encoder.block"],
                                        "text_encoder": "auto", "vae": None})
    assert sorted(managers) == ["text_encoder", "text_encoder_2", "transformer"]
    assert torch.equal(generate(pipe, SIZE), reference)
    rep = layerwise.report(pipe)  # dispatches to report_pipeline for a pipeline
    assert isinstance(rep, pipelines.PipelineReport)
    rows = {r["component"]: r for r in rep["components"]}
    for name in MODULES:
        module = getattr(pipe, name)
        streamed = bool(managers_of(module))
        assert rows[name]["streamed"] is streamed, name
        assert rows[name]["placement"].startswith("streamed" if streamed else "resident")
        assert [g["group"] for g in rows[name]["groups"]] == [m.layer_name for m in managers_of(module)]
        # streamed: its block weights are views of the ring slots; resident: ordinary weights only
        slots = {ptr for m in managers_of(module) for ptr in m.ring.ptrs}
        in_ring = [p for p in module.parameters() if p.untyped_storage().data_ptr() in slots]
        assert bool(in_ring) is streamed, name
        assert all(p.shape != (1,) for p in module.parameters())
    assert "components['vae'] is None" in rows["vae"]["why"]
    assert rows["transformer"]["uses"] == 28 and "denoiser" in rows["transformer"]["uses_source"]
    assert rows["text_encoder"]["uses"] == 1
    text = str(rep)
    assert all(len(line) <= 120 for line in text.splitlines()), text
    assert "resident" in text and "pin budget" in text
    # a model still gives its own report
    assert "groups" in layerwise.report(pipe.transformer)


def test_any_object_holding_modules_is_a_pipeline():
    class Holder:
        def __init__(self):
            torch.manual_seed(0)
            self.encoder = nn.Sequential(nn.Linear(8, 16), nn.Sequential(*[nn.Linear(16, 16) for _ in range(3)]))
            self.head = nn.Linear(16, 4)
            self.name = "not a module"

        def __call__(self, x):
            return self.head(self.encoder(x))

    holder, x = Holder(), torch.randn(5, 8)
    ref = holder(x)
    managers = layerwise.offload_pipeline(holder, device="cpu")
    assert list(managers) == ["encoder"]  # head has no block list: resident
    with torch.no_grad():
        assert torch.equal(holder(x), ref)
    layerwise.remove_pipeline_offload(holder)
    with pytest.raises(TypeError, match="configure_layerwise_offload"):
        layerwise.offload_pipeline(holder.encoder, device="cpu")  # one model, not a pipeline


# -------------------------------------------------------------------- pins
def _arena(managers):
    return sum(m.stats()["arena_bytes"] for m in managers)


def test_pin_budget_that_fits_only_the_transformer_pins_only_the_transformer(pipe, reference):
    sizes = {n: _arena(ms) for n, ms in layerwise.offload_pipeline(pipe, device="cpu", pin_budget=0).items()}
    smallest_other = min(m.stats()["arena_bytes"] for n in MODULES if n != "transformer"
                         for m in managers_of(getattr(pipe, n)))
    layerwise.remove_pipeline_offload(pipe)
    if not can_mlock(sizes["transformer"]):
        pytest.skip("this process may not lock the transformer's arena (RLIMIT_MEMLOCK)")
    budget = sizes["transformer"] + smallest_other - 4 * KiB  # no other group fits beside it
    managers = layerwise.offload_pipeline(pipe, device="cpu", pin_budget=budget)
    pinned = {n: [m.stats()["arena_pinned"] for m in ms] for n, ms in managers.items()}
    assert pinned["transformer"] == [True, True]
    assert pinned["text_encoder"] == [False] and pinned["text_encoder_2"] == [False]
    assert not any(pinned["vae"])
    assert all(m.pin_memory is False for n in ("text_encoder", "text_encoder_2", "vae") for m in managers[n])
    assert torch.equal(generate(pipe, SIZE), reference)
    rows = {r["component"]: r for r in layerwise.report_pipeline(pipe)["components"]}
    assert rows["transformer"]["pinned"] == "yes" and rows["text_encoder"]["pinned"] == "no"
    assert "did not fit the pin budget" in rows["text_encoder"]["groups"][0]["why"]
    assert "rank 1 of" in " ".join(g["why"] for g in rows["transformer"]["groups"])


def test_given_uses_decide_what_is_pinned(pipe, reference):
    sizes = {n: _arena(ms) for n, ms in layerwise.offload_pipeline(pipe, device="cpu", pin_budget=0).items()}
    layerwise.remove_pipeline_offload(pipe)
    if not can_mlock(sizes["transformer"]):
        pytest.skip("this process may not lock memory (RLIMIT_MEMLOCK)")
    # Say the T5 encoder runs 1000 times per request: it outranks the transformer.
    budget = sizes["text_encoder_2"] + 4 * KiB  # the smallest other group is larger than 4 KiB
    managers = layerwise.offload_pipeline(pipe, device="cpu", pin_budget=budget,
                                          uses={"text_encoder_2": 1000, "transformer": 1})
    assert managers["text_encoder_2"][0].stats()["arena_pinned"]
    assert not any(m.stats()["arena_pinned"] for m in managers["transformer"])
    rows = {r["component"]: r for r in layerwise.report_pipeline(pipe)["components"]}
    assert rows["text_encoder_2"]["uses"] == 1000 and rows["text_encoder_2"]["uses_source"] == "given"
    assert torch.equal(generate(pipe, SIZE), reference)


def test_uses_counted_in_a_warm_up_call(pipe, reference):
    calls = []

    def warmup(p):
        calls.append(1)
        generate(p, SIZE)

    managers = layerwise.offload_pipeline(pipe, device="cpu", pin_budget=None, uses=warmup)
    assert calls == [1]
    groups = {(r["component"], g["group"]): g for r in layerwise.report_pipeline(pipe)["components"]
              for g in r["groups"]}
    assert groups[("transformer", "transformer_blocks")]["uses"] == SIZE.steps
    assert groups[("text_encoder", "encoder.layers")]["uses"] == 1
    assert groups[("vae", "decoder.up_blocks")]["uses"] == 1
    enc = groups[("vae", "encoder.down_blocks")]  # text-to-image never runs the VAE's encoder
    assert enc["uses"] == 0 and not enc["arena_pinned"] and "0 uses" in enc["why"]
    assert all(g["uses_source"] == "counted in a warm-up call" for g in groups.values())
    assert sorted(managers) == sorted(MODULES)
    assert torch.equal(generate(pipe, SIZE), reference)


def _group(value_bytes, uses, arena=None):
    return pipelines.GroupPin("g", None, arena if arena is not None else value_bytes, value_bytes, uses, "")


def test_pin_choice_maximises_bytes_times_uses_within_the_budget():
    # 1 GB x 28 against 10 GB x 4: a budget of 10 GB holds only one; the 10 GB one saves more.
    a, b = _group(1 << 30, 28), _group(10 << 30, 4)
    assert pipelines.choose_pins([a, b], 10 << 30) == {1}
    # Greedy by bytes x uses would take the 6 GB group and stop; the best pair is 5 + 5.
    groups = [_group(6 << 30, 1), _group(5 << 30, 1), _group(5 << 30, 1)]
    assert pipelines.choose_pins(groups, 10 << 30) == {1, 2}
    assert pipelines.choose_pins(groups, None) == {0, 1, 2}
    assert pipelines.choose_pins([_group(1, 0)], None) == set()  # never runs: never pinned
    assert pipelines.choose_pins(groups, 0) == set()


# ------------------------------------------------------- cgroup and memlock
def _fake(tmp_path, cgroup_lines, files, status="CapEff:\t0000000000000000\nVmLck:\t       0 kB\n",
          memlock=None):
    root, proc = tmp_path / "cgroup", tmp_path / "proc"
    proc.mkdir(parents=True)
    (proc / "cgroup").write_text(cgroup_lines)
    (proc / "status").write_text(status)
    limit = "unlimited" if memlock is None else str(memlock)
    (proc / "limits").write_text(f"Limit                     Soft Limit           Hard Limit           Units\n"
                                 f"Max locked memory         {limit:<21}{limit:<21}bytes\n")
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return str(root), str(proc)


@pytest.fixture
def big_host(monkeypatch):
    monkeypatch.setattr(host_limits, "_host_memory", lambda: (1 << 50, 1 << 50))


GiB = 1 << 30


def test_cgroup_v2_limit_less_usage_and_reserve(tmp_path, big_host):
    root, proc = _fake(tmp_path, "0::/\n", {"memory.max": f"{16 * GiB}\n", "memory.current": f"{4 * GiB}\n"})
    b = host_limits.pinnable_host_bytes(0, root, proc)
    assert b.bytes == 12 * GiB - 2 * GiB  # reserve max(5% of 16 GiB, 2 GiB)
    assert "cgroup" in b.source and "memory.max" in b.source
    # weights that the arenas will replace count as free
    assert host_limits.pinnable_host_bytes(3 * GiB, root, proc).bytes == 13 * GiB
    # a larger limit: the 5% reserve is the larger one
    root, proc = _fake(tmp_path / "b", "0::/\n", {"memory.max": f"{100 * GiB}\n", "memory.current": "0\n"})
    assert host_limits.pinnable_host_bytes(0, root, proc).bytes == 95 * GiB


def test_cgroup_v2_nested_path_takes_the_tightest_ancestor(tmp_path, big_host):
    root, proc = _fake(tmp_path, "0::/kubepods/pod1/ctr\n", {
        "memory.max": "max\n",
        "kubepods/pod1/memory.max": f"{8 * GiB}\n", "kubepods/pod1/memory.current": f"{1 * GiB}\n",
        "kubepods/pod1/ctr/memory.max": "max\n", "kubepods/pod1/ctr/memory.current": f"{1 * GiB}\n",
    })
    assert host_limits.pinnable_host_bytes(0, root, proc).bytes == 7 * GiB - 2 * GiB


def test_cgroup_v1_limit_and_its_unlimited_value(tmp_path, big_host):
    root, proc = _fake(tmp_path, "4:memory:/docker/abc\n1:cpu:/\n", {
        "memory/memory.limit_in_bytes": "9223372036854771712\n",  # v1's "no limit"
        "memory/docker/abc/memory.limit_in_bytes": f"{10 * GiB}\n",
        "memory/docker/abc/memory.usage_in_bytes": f"{2 * GiB}\n",
    })
    b = host_limits.pinnable_host_bytes(0, root, proc)
    assert b.bytes == 8 * GiB - 2 * GiB and "memory.limit_in_bytes" in b.source
    root, proc = _fake(tmp_path / "b", "4:memory:/\n", {"memory/memory.limit_in_bytes": "9223372036854771712\n"})
    assert host_limits.pinnable_host_bytes(0, root, proc).bytes == (1 << 50) - (1 << 50) // 20  # host only


def test_memlock_limit_unless_cap_ipc_lock(tmp_path, big_host):
    files = {"memory.max": "max\n"}
    root, proc = _fake(tmp_path, "0::/\n", files, memlock=64 << 20,
                       status="CapEff:\t0000000000000000\nVmLck:\t    4096 kB\n")
    b = host_limits.pinnable_host_bytes(0, root, proc)
    assert b.bytes == (64 << 20) - (4 << 20) - int(0.05 * (64 << 20))
    assert "memlock" in b.source
    # CAP_IPC_LOCK (bit 14 of CapEff): RLIMIT_MEMLOCK does not bind
    root, proc = _fake(tmp_path / "cap", "0::/\n", files, memlock=64 << 20,
                       status=f"CapEff:\t{1 << 14:016x}\nVmLck:\t       0 kB\n")
    assert host_limits.pinnable_host_bytes(0, root, proc).bytes == (1 << 50) - (1 << 50) // 20
    # no cgroup limit, no memlock limit: the host's available memory, less max(5%, 2 GiB)
    root, proc = _fake(tmp_path / "none", "0::/\n", files)
    assert host_limits.pinnable_host_bytes(0, root, proc).bytes == (1 << 50) - (1 << 50) // 20


def test_auto_pin_budget_reads_the_limits(pipe, reference, tmp_path, monkeypatch):
    sizes = {n: _arena(ms) for n, ms in layerwise.offload_pipeline(pipe, device="cpu", pin_budget=0).items()}
    layerwise.remove_pipeline_offload(pipe)
    if not can_mlock(sizes["transformer"]):
        pytest.skip("this process may not lock memory (RLIMIT_MEMLOCK)")
    # A memlock limit whose 95% just holds the transformer's arena (the process may
    # really lock more: it has CAP_IPC_LOCK or a higher limit, else we skipped).
    limit = int((sizes["transformer"] + 2 * KiB) / 0.95) + 1
    root, proc = _fake(tmp_path, "0::/\n", {"memory.max": "max\n"}, memlock=limit)
    monkeypatch.setattr(host_limits, "CGROUP_ROOT", root)
    monkeypatch.setattr(host_limits, "PROC_SELF", proc)
    managers = layerwise.offload_pipeline(pipe, device="cpu")  # pin_budget="auto"
    assert [m.stats()["arena_pinned"] for m in managers["transformer"]] == [True, True]
    assert not any(m.stats()["arena_pinned"] for n in ("vae", "text_encoder", "text_encoder_2") for m in managers[n])
    budget = layerwise.report_pipeline(pipe)["pin_budget"]
    assert budget["bytes"] == limit - int(0.05 * limit) and "memlock" in budget["source"]
    assert torch.equal(generate(pipe, SIZE), reference)


# ----------------------------------------------------------------- startup
def _watch(pipe, names, log, monkeypatch):
    """Log every pack (with the model it belongs to) and every model.to."""
    owner = {id(getattr(pipe, n)): n for n in names}
    orig = layerwise.LayerwiseOffloadManager._initialize_layer_weights

    def record(self, fill=None):
        log.append(("pack", owner[id(self.model)], self.layer_name, self.plan.managed_bytes))
        return orig(self, fill)

    monkeypatch.setattr(layerwise.LayerwiseOffloadManager, "_initialize_layer_weights", record)
    for n in names:
        module = getattr(pipe, n)

        def to(*args, _module=module, _name=n, **kwargs):
            ours = {id(e.param) for m in pipelines_managers(_module) for lp in m.plan.layers for e in lp.params}
            log.append(("to", _name, all(tuple(p.shape) == (1,) for p in _module.parameters() if id(p) in ours)))
            return type(_module).to(_module, *args, **kwargs)

        module.to = to


def pipelines_managers(module):
    m = getattr(module, "_pending_managers", None)
    return m if m is not None else managers_of(module)


class Holder:
    """A pipeline-like object whose components come in a chosen order."""

    def __init__(self, pipe, order):
        for n in order:
            setattr(self, n, getattr(pipe, n))


@pytest.mark.parametrize("order", [MODULES, tuple(reversed(MODULES))])
def test_every_component_is_packed_before_any_model_to(order, monkeypatch):
    pipe = tiny_flux_pipeline(SIZE)
    holder = Holder(pipe, order)
    log = []
    _watch(holder, order, log, monkeypatch)
    # Record the planned managers so that the `to` wrapper can check their placeholders.
    orig_prepare = pipelines.prepare_groups

    def prepare(model, *args, **kwargs):
        managers = orig_prepare(model, *args, **kwargs)
        model.__dict__["_pending_managers"] = managers
        return managers

    monkeypatch.setattr(pipelines, "prepare_groups", prepare)
    layerwise.offload_pipeline(holder, device="cpu", components={n: (None if n == "vae" else "auto")
                                                                   for n in order})
    packs = [e for e in log if e[0] == "pack"]
    tos = [e for e in log if e[0] == "to"]
    assert log.index(tos[0]) == len(packs), log  # every pack comes before the first model.to
    assert sorted(e[1] for e in tos) == sorted(order)  # exactly one model.to per component, resident ones too
    assert all(e[2] for e in tos)  # every managed parameter is a (1,) placeholder when its model moves
    sizes = [e[3] for e in packs]
    assert sizes == sorted(sizes, reverse=True)  # largest first, across components
    assert {e[1] for e in packs} == {"transformer", "text_encoder", "text_encoder_2"}


def test_pack_order_does_not_depend_on_component_order(monkeypatch):
    seqs = []
    for order in (MODULES, tuple(reversed(MODULES))):
        pipe = tiny_flux_pipeline(SIZE)
        log = []
        holder = Holder(pipe, order)
        _watch(holder, order, log, monkeypatch)
        layerwise.offload_pipeline(holder, device="cpu")
        seqs.append([e[1:] for e in log if e[0] == "pack"])
        monkeypatch.undo()
    assert seqs[0] == seqs[1]


# ------------------------------------------------------ rollback, removal
@pytest.mark.parametrize("where", ["pack", "finalize"])
def test_a_failure_rolls_every_component_back(pipe, reference, where, monkeypatch):
    before = state_dicts(pipe)
    params = {n: list(getattr(pipe, n).parameters()) for n in MODULES}
    hooks = {n: hook_count(getattr(pipe, n)) for n in MODULES}
    name = "_initialize_layer_weights" if where == "pack" else "_finalize_initialization"
    orig = getattr(layerwise.LayerwiseOffloadManager, name)
    calls = []

    def failing(self, *args):
        calls.append(self.layer_name)
        if len(calls) == 4:  # the fourth group, after three have been done
            raise RuntimeError("injected failure")
        return orig(self, *args)

    monkeypatch.setattr(layerwise.LayerwiseOffloadManager, name, failing)
    with pytest.raises(RuntimeError, match="injected failure"):
        layerwise.offload_pipeline(pipe, device="cpu")
    monkeypatch.undo()
    assert_state_dicts_equal(pipe, before)
    for n in MODULES:
        module = getattr(pipe, n)
        assert not managers_of(module) and hook_count(module) == hooks[n]
        assert all(p.shape != (1,) for p in module.parameters())
        assert all(a is b for a, b in zip(module.parameters(), params[n], strict=True))  # the same objects
    assert not pipelines.is_offloaded_pipeline(pipe) and "to" not in pipe.__dict__
    assert torch.equal(generate(pipe, SIZE), reference)
    layerwise.offload_pipeline(pipe, device="cpu")  # and it can be offloaded again
    assert torch.equal(generate(pipe, SIZE), reference)


def test_remove_restores_the_pipeline(pipe, reference):
    before = state_dicts(pipe)
    hooks = {n: hook_count(getattr(pipe, n)) for n in MODULES}
    layerwise.offload_pipeline(pipe, device="cpu", resident_layers=1, components={"vae": None, "transformer": "auto",
                                                                                  "text_encoder": "auto",
                                                                                  "text_encoder_2": "auto"})
    assert set(pipelines.REFUSED) <= set(pipe.__dict__)
    generate(pipe, SIZE)
    assert layerwise.remove_pipeline_offload(pipe) is pipe
    assert_state_dicts_equal(pipe, before)
    for n in MODULES:
        module = getattr(pipe, n)
        assert not managers_of(module) and hook_count(module) == hooks[n]
        assert all(p.device.type == "cpu" and p.shape != (1,) for p in module.parameters())
    assert not set(pipelines.REFUSED) & set(pipe.__dict__)  # the class's own methods again
    assert not pipelines.is_offloaded_pipeline(pipe)
    assert torch.equal(generate(pipe, SIZE), reference)
    assert layerwise.remove_pipeline_offload(pipe) is pipe  # removed already: a no-op


def test_remove_keeps_a_weight_loaded_into_a_resident_layer(pipe):
    layerwise.offload_pipeline(pipe, device="cpu", resident_layers=1)
    key = "transformer_blocks.0.ff.net.2.weight"  # layer 0 is resident
    new = torch.randn_like(pipe.transformer.state_dict()[key])
    pipe.transformer.load_state_dict({key: new}, strict=False)
    layerwise.remove_pipeline_offload(pipe)
    assert torch.equal(pipe.transformer.state_dict()[key], new)


# ---------------------------------------------------------- refused calls
REPLACEMENTS = {
    "enable_model_cpu_offload": ((), {}),
    "enable_sequential_cpu_offload": ((), {}),
    "enable_group_offload": ((torch.device("cpu"),), {}),
    "to": ((torch.float16,), {}),
}


@pytest.mark.parametrize("method", sorted(REPLACEMENTS))
def test_refused_pipeline_calls_name_their_replacement(pipe, reference, method):
    layerwise.offload_pipeline(pipe, device="cpu")
    before = state_dicts(pipe)
    args, kwargs = REPLACEMENTS[method]
    with pytest.raises(RuntimeError) as e:
        getattr(pipe, method)(*args, **kwargs)
    msg = str(e.value)
    assert "layerwise.remove_pipeline_offload(pipe)" in msg and f"pipe.{method}(" in msg, msg
    assert_state_dicts_equal(pipe, before)
    assert torch.equal(generate(pipe, SIZE), reference)
    layerwise.remove_pipeline_offload(pipe)
    assert method not in pipe.__dict__


def test_to_the_streaming_device_is_allowed(pipe, reference):
    layerwise.offload_pipeline(pipe, device="cpu")
    assert pipe.to("cpu") is pipe and pipe.to(device="cpu") is pipe
    for bad in (("cpu", torch.float16), ("meta",)):
        with pytest.raises(RuntimeError, match="remove_pipeline_offload"):
            pipe.to(*bad)
    assert torch.equal(generate(pipe, SIZE), reference)


# ----------------------------------------------------------------- errors
def test_bad_arguments_fail_before_anything_changes(pipe):
    before = state_dicts(pipe)
    cases = [
        (dict(components=["transformer", "nope"]), ValueError, "nope"),
        (dict(components="all"), ValueError, "components"),
        (dict(pin_budget=-1), ValueError, "pin_budget"),
        (dict(pin_budget="lots"), ValueError, "pin_budget"),
        (dict(host_budget=1024), ValueError, "spill_dir="),
        (dict(uses={"transformer": -1}), ValueError, "uses"),
        (dict(uses={"unet": 3}), ValueError, "unet"),
        (dict(pin_memory=True, pin_budget=0), ValueError, "pin_memory=True"),
        (dict(prefetch_depth=-1), ValueError, "prefetch_depth"),
        (dict(colour="red"), TypeError, "colour"),
        (dict(components={"vae": "auto", "transformer": ["nope_blocks"]}), Exception, "nope_blocks"),
    ]
    for kwargs, exc, words in cases:
        with pytest.raises(exc, match=words):
            layerwise.offload_pipeline(pipe, device="cpu", **kwargs)
        assert not pipelines.is_offloaded_pipeline(pipe)
        assert not any(managers_of(getattr(pipe, n)) for n in MODULES)
    assert_state_dicts_equal(pipe, before)
    layerwise.offload_pipeline(pipe, device="cpu")
    with pytest.raises(RuntimeError, match="remove_pipeline_offload"):
        layerwise.offload_pipeline(pipe, device="cpu")


def _needed_host_bytes(pipe):
    """What a pipeline's streamed weights take of host memory with every layer in memory,
    counted from what a streamed pipeline holds (report: arenas, and on a CPU device the
    non-layer weights, rings and resident layers) plus the packing scratch (its largest layer)."""
    managers = [m for ms in layerwise.offload_pipeline(pipe, device="cpu", host_budget=1 << 40).values() for m in ms]
    used = layerwise.report(pipe)["host_budget"]["used_bytes"]
    scratch = max(lp.nbytes for m in managers for lp in m.plan.layers)
    layerwise.remove_pipeline_offload(pipe)
    return used + scratch


def test_host_budget_means_what_it_means_for_configure(pipe, reference):
    """One meaning of host_budget at every front door: the pipeline's budget
    counts what configure_layerwise_offload's does, not only the arenas."""
    needed = _needed_host_bytes(pipe)
    arenas = sum(_arena(ms) for ms in layerwise.offload_pipeline(pipe, device="cpu").values())
    layerwise.remove_pipeline_offload(pipe)
    assert needed > arenas  # (the arenas alone were what the pipeline counted before)
    before = state_dicts(pipe)
    with pytest.raises(ValueError, match=f"needs {pipelines.fmt_bytes(needed)} \\({needed} bytes.*spill_dir="):
        layerwise.offload_pipeline(pipe, device="cpu", host_budget=needed - 1)
    assert not pipelines.is_offloaded_pipeline(pipe)
    assert_state_dicts_equal(pipe, before)
    layerwise.offload_pipeline(pipe, device="cpu", host_budget=needed)
    assert torch.equal(generate(pipe, SIZE), reference)
    assert layerwise.report(pipe)["host_budget"]["used_bytes"] <= needed
    layerwise.remove_pipeline_offload(pipe)
    # configure_layerwise_offload on one model counts it the same way: what it holds, and the scratch
    m, groups = pipe.transformer, ["transformer_blocks", "single_transformer_blocks"]
    ms = layerwise.configure_layerwise_offload(m, groups, device="cpu", host_budget=1 << 40)
    one = layerwise.report(m)["host_budget"]["used_bytes"] + max(lp.nbytes for g in ms for lp in g.plan.layers)
    layerwise.remove_layerwise_offload(m)
    with pytest.raises(ValueError, match=f"needs {pipelines.fmt_bytes(one)} \\({one} bytes.*spill_dir="):
        layerwise.configure_layerwise_offload(m, groups, device="cpu", host_budget=one - 1)
    layerwise.configure_layerwise_offload(m, groups, device="cpu", host_budget=one)
    assert torch.equal(generate(pipe, SIZE), reference)
    layerwise.remove_layerwise_offload(m)


def test_device_budget_is_shared_and_the_denoiser_gets_resident_layers_first(pipe, reference):
    managers = layerwise.offload_pipeline(pipe, device="cpu", pin_budget=0)
    stats = {n: [m.stats() for m in ms] for n, ms in managers.items()}
    ring = sum(s["ring_bytes"] for ss in stats.values() for s in ss)
    non_layer = sum(sum(p.numel() * p.element_size() for p in getattr(pipe, n).parameters() if p.shape != (1,))
                    + sum(b.numel() * b.element_size() for b in getattr(pipe, n).buffers()) for n in MODULES)
    layerwise.remove_pipeline_offload(pipe)
    budget = non_layer + ring + 300 * KiB  # room for about half the transformer's layers
    managers = layerwise.offload_pipeline(pipe, device="cpu", pin_budget=0, device_budget=budget)
    share = {n: sum(len(m.resident) for m in ms) / sum(m.num_layers for m in ms) for n, ms in managers.items()}
    assert share["transformer"] > 0 and all(share["transformer"] >= v for v in share.values()), share
    stats = [m.stats() for ms in managers.values() for m in ms]
    assert non_layer + sum(s["ring_bytes"] + s["resident_bytes"] for s in stats) <= budget
    assert torch.equal(generate(pipe, SIZE), reference)
    layerwise.remove_pipeline_offload(pipe)
    # The ranking decides: a T5 said to run 100 times per request is planned first.
    managers = layerwise.offload_pipeline(pipe, device="cpu", pin_budget=0, device_budget=budget,
                                          uses={"text_encoder_2": 100, "transformer": 1})
    assert all(m.resident for m in managers["text_encoder_2"])


# ------------------------------------------------------------------ bench
def test_bench_pipeline_suite_runs_at_test_size(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "layerwise.bench", "pipeline", "--tiny", "--device", "cpu",
                           "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert all(len(line) <= 120 for line in proc.stdout.splitlines()), proc.stdout
    suites = json.loads(out.read_text())["suites"]
    assert list(suites) == ["pipeline"]
    rows = {r["measure"]: r for r in suites["pipeline"]["rows"]}
    assert rows["image bitwise equal to resident"]["met"] is True
    assert rows["image bitwise equal to resident"]["ours"] == 1.0
    assert "diffusers model offload: not measured" in rows
    assert rows["peak device memory"]["ours"] is None
    assert rows["wall time per image"]["ours"]["median"] > 0


def test_ctrl_c_while_the_pipeline_completes_is_delivered_on_a_whole_pipeline(pipe, reference, monkeypatch):
    # A real SIGINT once every component is packed and finalised (while the configure
    # records itself) waits until the pipeline is whole: offloaded, marked, removable.
    import os
    import signal

    from layerwise.runtime import group as manager_mod

    before = state_dicts(pipe)
    orig = manager_mod.LayerwiseOffloadManager.commit_configure
    monkeypatch.setattr(manager_mod.LayerwiseOffloadManager, "commit_configure",
                        lambda self: (os.kill(os.getpid(), signal.SIGINT), orig(self))[1])
    with pytest.raises(KeyboardInterrupt):
        layerwise.offload_pipeline(pipe, device="cpu")
    monkeypatch.undo()
    assert pipelines.is_offloaded_pipeline(pipe)
    assert torch.equal(generate(pipe, SIZE), reference)
    layerwise.remove_pipeline_offload(pipe)
    assert_state_dicts_equal(pipe, before)


def test_a_component_streamed_on_its_own_is_kept_as_it_is(pipe, reference):
    # e.g. a transformer loaded with load_offloaded, then the pipeline offloaded around it
    layerwise.configure_layerwise_offload(pipe.transformer, ["transformer_blocks", "single_transformer_blocks"],
                                          device="cpu")
    own = managers_of(pipe.transformer)
    managers = layerwise.offload_pipeline(pipe, device="cpu")
    assert "transformer" not in managers and managers_of(pipe.transformer) == own
    assert torch.equal(generate(pipe, SIZE), reference)
    rows = {r["component"]: r for r in layerwise.report(pipe)["components"]}
    assert rows["transformer"]["placement"].startswith("own offload") and "kept as it is" in rows["transformer"]["why"]
    layerwise.remove_pipeline_offload(pipe)
    assert managers_of(pipe.transformer) == own  # given back as it was: still streamed on its own
    assert not managers_of(pipe.text_encoder)
    assert torch.equal(generate(pipe, SIZE), reference)


def test_host_budget_with_spill_dir_keeps_layers_on_disk(pipe, reference, tmp_path):
    import glob

    sizes = sum(_arena(ms) for ms in layerwise.offload_pipeline(pipe, device="cpu").values())
    layerwise.remove_pipeline_offload(pipe)
    before = state_dicts(pipe)
    # Not even the rings and the non-layer weights fit: refused before anything changes.
    with pytest.raises(ValueError, match="too small"):
        layerwise.offload_pipeline(pipe, device="cpu", host_budget=1 << 16, spill_dir=tmp_path)
    assert_state_dicts_equal(pipe, before)
    budget = 1 << 18
    while True:  # the smallest budget that works (to 1/8): most layers on disk
        try:
            managers = layerwise.offload_pipeline(pipe, device="cpu", host_budget=budget, spill_dir=tmp_path,
                                                  debug_read_delay_us=200, debug_copy_delay_us=200)
            break
        except ValueError:
            budget += budget // 8
    on_disk = sum(s.kind == "disk" for ms in managers.values() for m in ms for s in m.sources)
    assert on_disk >= 4
    assert sum(m.stats()["arena_bytes"] for ms in managers.values() for m in ms) < sizes
    assert glob.glob(str(tmp_path / "layerwise-*.spill"))
    assert torch.equal(generate(pipe, SIZE), reference)
    assert "disk tier" in str(layerwise.report(pipe.transformer))
    layerwise.remove_pipeline_offload(pipe)
    assert glob.glob(str(tmp_path / "layerwise-*.spill")) == []
    assert_state_dicts_equal(pipe, before)


# ------------------------------------------- budgets at the size the tiers keep
def _kept_bytes(m):
    """Host bytes a packed group holds, each block page-rounded: its arena and its encoded blocks."""
    page = 4096
    own = sum(-(-max(s.stored_bytes, 1) // page) * page for s in m.sources if s.kind == "lossless")
    return m._host.arena.capacity + own


def test_compressed_layers_count_at_their_encoded_size_in_the_host_and_pin_budgets():
    bf16 = torch.bfloat16
    pipe = tiny_flux_pipeline(SIZE, dtype=bf16)
    reference = generate(pipe, SIZE)
    raw = sum(_arena(ms) for ms in layerwise.offload_pipeline(pipe, device="cpu", pin_budget=0).values())
    layerwise.remove_pipeline_offload(pipe)
    managers = layerwise.offload_pipeline(pipe, device="cpu", pin_budget=0, compress="lossless")
    kept = sum(_kept_bytes(m) for ms in managers.values() for m in ms)
    planned = [g.arena_bytes for c in pipe.__dict__[pipelines._STATE].components for g in c.groups]
    layerwise.remove_pipeline_offload(pipe)
    assert kept < 0.9 * raw, (kept, raw)  # bf16 weights shrink
    assert sum(planned) == kept  # the plan counted each layer exactly as packing kept it
    before = state_dicts(pipe)
    # The raw arenas exceed the budget, the encoded ones fit: planned as fitting.
    other = _needed_host_bytes(pipe) - raw  # scratch, non-layer weights, rings (the device is host memory)
    need = kept + other
    layerwise.offload_pipeline(pipe, device="cpu", pin_budget=0, compress="lossless", host_budget=need)
    assert torch.equal(generate(pipe, SIZE), reference)
    rep = layerwise.report(pipe)  # the host budget in force, and what the components use of it
    assert rep["host_budget"]["bytes"] == need and rep["host_budget"]["source"] == "given"
    assert f"host budget {pipelines.fmt_bytes(need)} (given)" in str(rep)
    layerwise.remove_pipeline_offload(pipe)
    with pytest.raises(ValueError, match="too small"):  # without compress the same budget is refused
        layerwise.offload_pipeline(pipe, device="cpu", pin_budget=0, host_budget=need)
    with pytest.raises(ValueError, match="encoded size"):  # and below the encoded size too, saying how it counted
        layerwise.offload_pipeline(pipe, device="cpu", pin_budget=0, compress="lossless", host_budget=need - 1)
    assert not pipelines.is_offloaded_pipeline(pipe)
    assert_state_dicts_equal(pipe, before)
    # A pin budget that holds every encoded arena chooses every group for pinning.
    layerwise.offload_pipeline(pipe, device="cpu", pin_budget=kept, compress="lossless")
    groups = [g for c in pipe.__dict__[pipelines._STATE].components for g in c.groups]
    assert all(g.pin == "auto" for g in groups), [(g.layer_name, g.arena_bytes, g.why) for g in groups]
    assert torch.equal(generate(pipe, SIZE), reference)
    layerwise.remove_pipeline_offload(pipe)
