"""torch.compile over a streamed model (CPU inductor): outputs equal the compiled
resident model's, the hooks cause no recompile per layer or per step, no graph
compiled without streaming ever runs a streamed model (nor one compiled with
streaming a removed model), and a process that never compiles never imports
torch._dynamo. None of the tests resets dynamo between its steps: users do not."""
import copy
import gc
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import layerwise

from helpers.models import TwoGroupModel

GROUPS = ["transformer_blocks", "single_transformer_blocks"]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(ROOT, "layerwise")


def blocks(model):
    return list(model.transformer_blocks) + list(model.single_transformer_blocks)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test starts from empty compile caches (tests share the model classes, and
    dynamo's per-code cache limit would otherwise fill up across tests)."""
    torch._dynamo.reset()


@pytest.mark.parametrize("scope", ["model", "blocks"])
def test_compiled_streaming_matches_compiled_resident_without_recompiles(scope):
    torch.manual_seed(0)
    resident = TwoGroupModel(d=32, n_a=4, n_b=2)
    model = copy.deepcopy(resident)
    xs = [torch.randn(3, 32) for _ in range(3)]

    def compile_(m):
        if scope == "model":
            return torch.compile(m)
        for b in blocks(m):
            b.compile()
        return m

    with torch.no_grad():
        c = compile_(resident)
        refs = [c(x) for x in xs]
    counters.clear()
    managers = layerwise.configure_layerwise_offload(model, GROUPS, device="cpu", prefetch_depth=1)
    cm = compile_(model)
    with torch.no_grad():
        assert torch.equal(cm(xs[0]), refs[0])  # first step compiles
        graphs = counters["stats"]["unique_graphs"]
        frames = counters["frames"]["total"]
        assert graphs > 0
        for _ in range(3):
            for x, ref in zip(xs, refs):
                assert torch.equal(cm(x), ref)
    assert counters["stats"]["unique_graphs"] == graphs  # nothing recompiled
    assert "recompiles" not in counters or not counters["recompiles"]
    assert managers[0].stats()["steps"] == 10 and managers[0].stats()["copies"] > 0  # hooks really ran
    assert counters["frames"]["total"] - frames < 10 * len(blocks(model))  # no compile attempt per layer call


# ------------------------------------------------------------- stale graphs
def _configure(model):
    return layerwise.configure_layerwise_offload(model, GROUPS, device="cpu", prefetch_depth=1)


def _streamed_steps(managers):
    return managers[0].stats()["steps"], managers[0].stats()["copies"]


def test_graph_compiled_before_configure_never_runs_the_streamed_model():
    torch.manual_seed(0)
    model = TwoGroupModel(d=32, n_a=4, n_b=2)
    xs = [torch.randn(3, 32) for _ in range(2)]
    cm = torch.compile(model)
    with torch.no_grad():
        refs = [cm(x) for x in xs]  # compiled and warm, on the resident weights
        managers = _configure(model)
        for x, ref in zip(xs, refs):
            assert torch.equal(cm(x), ref)  # the same compiled object, called after configure
    steps, copies = _streamed_steps(managers)
    assert steps == 2 and copies > 0  # the hooks ran: the weights came through the ring


@pytest.mark.parametrize("twin_compiled", ["before_configure", "after_configure"])
def test_graph_of_a_resident_twin_never_runs_the_streamed_model(twin_compiled):
    torch.manual_seed(0)
    resident = TwoGroupModel(d=32, n_a=4, n_b=2)
    model = copy.deepcopy(resident)
    x = torch.randn(3, 32)
    with torch.no_grad():
        if twin_compiled == "before_configure":
            ref = torch.compile(resident)(x)
            managers = _configure(model)
        else:
            managers = _configure(model)
            ref = torch.compile(resident)(x)
        out = torch.compile(model)(x)
        assert torch.equal(out, ref)
        # and the graph compiled for the streamed model never runs the resident twin
        assert torch.equal(torch.compile(copy.deepcopy(resident))(x), ref)
    assert _streamed_steps(managers)[1] > 0


def test_a_streamed_block_keeps_its_class_name_and_methods():
    model = TwoGroupModel(d=32, n_a=4, n_b=2)
    plain = [type(b) for b in blocks(model)]
    _configure(model)
    for b, cls in zip(blocks(model), plain):
        assert type(b) is not cls and isinstance(b, cls)  # what dynamo's type guards see
        assert (type(b).__name__, type(b).__qualname__, type(b).__module__) == (cls.__name__, cls.__qualname__,
                                                                                cls.__module__)
        assert type(b).forward is cls.forward and "forward" not in vars(type(b))
    assert len({type(b) for b in model.transformer_blocks}) == 1  # one class per class: the blocks share graphs
    layerwise.remove_layerwise_offload(model)
    assert [type(b) for b in blocks(model)] == plain


@pytest.mark.parametrize("specializes", [True, False])
def test_where_dynamo_specializes_instances_configure_and_remove_drop_its_code_caches(monkeypatch, specializes):
    """torch 2.4 (modules inlined from 2.5 on) guards a module's id, not its class:
    a graph compiled for the same instance before configure or during streaming is
    dropped with dynamo's code caches. Checked there by hand; here the wiring."""
    from layerwise.contract import compile_guard

    resets = []
    monkeypatch.setattr(compile_guard, "_specializes_instances", lambda dynamo: specializes)
    monkeypatch.setattr(torch._dynamo, "reset_code_caches", lambda: resets.append(1))
    model = TwoGroupModel(d=32, n_a=4, n_b=2)
    _configure(model)
    configured = len(resets)
    layerwise.remove_layerwise_offload(model)
    assert (configured > 0, len(resets) > configured) == (specializes, specializes)


def test_blocks_compiled_before_configure_run_their_hooks():
    torch.manual_seed(0)
    model = TwoGroupModel(d=32, n_a=4, n_b=2)
    xs = [torch.randn(3, 32) for _ in range(2)]
    for b in blocks(model):
        b.compile()
    with torch.no_grad():
        refs = [model(x) for x in xs]
        managers = _configure(model)
        for x, ref in zip(xs, refs):
            assert torch.equal(model(x), ref)
    steps, copies = _streamed_steps(managers)
    assert steps == 2 and copies > 0


def _layerwise_calls(fn):
    """The layerwise functions that run during fn() (a removed model runs none)."""
    seen = []
    gc.collect()  # (a streamed model an earlier test dropped is finalised now, not inside fn)

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(PACKAGE):
            seen.append(f"{frame.f_code.co_filename}:{frame.f_code.co_name}")

    sys.setprofile(profile)
    try:
        out = fn()
    finally:
        sys.setprofile(None)
    return out, seen


def test_graph_compiled_with_streaming_never_runs_after_remove():
    torch.manual_seed(0)
    resident = TwoGroupModel(d=32, n_a=4, n_b=2)
    model = copy.deepcopy(resident)
    xs = [torch.randn(3, 32) for _ in range(2)]
    with torch.no_grad():
        _configure(model)
        cm = torch.compile(model)
        streamed = [cm(x) for x in xs]  # compiled with streaming, warm
        layerwise.remove_layerwise_offload(model)
        assert all(type(b) is type(r) for b, r in zip(blocks(model), blocks(resident)))
        removed = []
        for x in xs:
            out, calls = _layerwise_calls(lambda x=x: cm(x))
            assert calls == []  # no hook, nothing of layerwise runs in the removed model
            removed.append(out)
        refs = [torch.compile(copy.deepcopy(resident))(x) for x in xs]
        for x, s, r, ref in zip(xs, streamed, removed, refs):
            assert torch.equal(s, ref) and torch.equal(r, ref)
            assert torch.equal(model(x), resident(x))  # eager, uncompiled: the plain model
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())


# --------------------------------------------- torch._dynamo is not imported
def run_fresh(code, timeout=600):
    """`code` in a fresh interpreter (nothing imported yet) with this checkout first on the path."""
    prelude = textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{ROOT!r}, {os.path.join(ROOT, "tests")!r}]
        import torch
        torch.set_num_threads(1)
        """)
    proc = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True,
                          check=False, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, f"exit code {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_configure_forward_tune_and_remove_never_import_dynamo():
    out = run_fresh("""
        import copy
        assert "torch._dynamo" not in sys.modules, "torch itself imported it"
        import layerwise
        from helpers.models import TwoGroupModel
        assert "torch._dynamo" not in sys.modules, "import layerwise did"
        torch.manual_seed(0)
        resident = TwoGroupModel(d=32, n_a=4, n_b=2)
        model = copy.deepcopy(resident)
        layerwise.configure_layerwise_offload(model, ["transformer_blocks", "single_transformer_blocks"],
                                              device="cpu", prefetch_depth=1)
        assert "torch._dynamo" not in sys.modules, "configure did"
        x = torch.randn(3, 32)
        with torch.no_grad():
            assert torch.equal(model(x), resident(x))
        assert "torch._dynamo" not in sys.modules, "a forward did"
        layerwise.tune(model, lambda m: m(x), device_budget=1 << 30, repeats=1, apply=False)
        assert "torch._dynamo" not in sys.modules, "tune did"
        layerwise.remove_layerwise_offload(model)
        with torch.no_grad():
            assert torch.equal(model(x), resident(x))
        assert "torch._dynamo" not in sys.modules, "remove did"
        print("ok")
        """)
    assert out.strip().endswith("ok")


COMPILE_STREAMED = """
    import copy, json
    if DYNAMO_FIRST:
        import torch._dynamo
    import layerwise
    from helpers.models import TwoGroupModel
    torch.manual_seed(0)
    resident = TwoGroupModel(d=32, n_a=4, n_b=2)
    model = copy.deepcopy(resident)
    managers = layerwise.configure_layerwise_offload(
        model, ["transformer_blocks", "single_transformer_blocks"], device="cpu", prefetch_depth=1)
    assert ("torch._dynamo" in sys.modules) == DYNAMO_FIRST
    xs = [torch.randn(3, 32) for _ in range(3)]
    with torch.no_grad():
        c = torch.compile(resident)
        refs = [c(x) for x in xs]
        from torch._dynamo.utils import counters
        counters.clear()
        cm = torch.compile(model)
        assert torch.equal(cm(xs[0]), refs[0])
        first = {k: dict(counters[k]) for k in ("frames", "stats", "graph_break", "recompiles")}
        for _ in range(3):
            for x, ref in zip(xs, refs):
                assert torch.equal(cm(x), ref)
    assert managers[0].stats()["steps"] == 10 and managers[0].stats()["copies"] > 0
    steps = {k: dict(counters[k]) for k in ("frames", "stats", "graph_break", "recompiles")}
    print(json.dumps({"first": first, "steps": steps}))
    """


def test_configured_before_dynamo_is_imported_then_compiled():
    """The hooks registered while dynamo was not imported run eagerly under
    torch.compile exactly as those registered after: the same frames, graphs and
    graph breaks (none inside the hooks), no recompile per layer or step."""
    import json

    later, first = (json.loads(run_fresh(f"DYNAMO_FIRST = {f}\n" + textwrap.dedent(COMPILE_STREAMED)).splitlines()[-1])
                    for f in (False, True))
    assert later == first
    n_blocks = 6
    assert later["first"]["stats"]["unique_graphs"] > 0
    assert later["steps"]["stats"] == later["first"]["stats"]  # nothing recompiled over the steps
    assert not later["steps"]["recompiles"]
    assert later["steps"]["frames"]["total"] - later["first"]["frames"]["total"] < 10 * n_blocks


def test_one_graph_serves_every_streamed_instance_of_a_class():
    # dynamo guards the ids of always-called and with-kwargs hooks: layerwise's hooks take
    # the same ids on every module, so that the ninth model does not hit the recompile limit.
    pairs = []
    for seed in range(10):
        torch.manual_seed(seed)
        m = TwoGroupModel(d=16, n_a=3, n_b=2)
        ref = copy.deepcopy(m)
        _configure(m)
        pairs.append((torch.compile(m, fullgraph=True), ref))
    twin = copy.deepcopy(pairs[0][1])
    layerwise.configure_layerwise_offload(twin, GROUPS, device="cpu", resident_layers=8)
    ctwin = torch.compile(twin, fullgraph=True)
    x = torch.randn(3, 16)
    with torch.no_grad():
        pairs[0][0](x)
        graphs = counters["stats"]["unique_graphs"]
        for c, ref in pairs:
            out = c(x)
            assert torch.allclose(out, ref(x), atol=1e-2)
        assert counters["stats"]["unique_graphs"] == graphs
        assert torch.equal(pairs[0][0](x), ctwin(x))
