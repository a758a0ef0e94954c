"""torch.compile(fullgraph=True) of whole streamed models (CPU inductor): the hooks
are traced into the layerwise:: operators (layerwise/runtime/ops.py), so a streamed
model compiles with no graph break, once per input shape, and computes bitwise what
its resident twin compiled the same way computes: with the streaming options, per
block, through a SIGINT, in every tier (disk, compression, quantized wrappers,
routed experts); and what cannot be compiled (a backward through streamed layers, a
layer that returns a view of its own weights) is refused with layerwise's error.

The twin is the same model configured with every layer resident: its graph has the
same operator boundaries. A model never configured compiles to a graph that inductor
fuses across block boundaries, so it differs in the last bits (it is compared with
allclose only, to show that the model is the same). The stale-graph cases are
tests/contract/test_compile.py's."""
import copy
import os
import random
import signal
import time

import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.utils import counters

import layerwise

from helpers import archs, moe, quantized
from helpers import disk as disk_model
from helpers.interrupts import call_with_a_random_sigint
from helpers.models import TwoGroupModel

GROUPS = ["transformer_blocks", "single_transformer_blocks"]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test starts from empty compile caches (tests share the model classes, and
    dynamo's per-code cache limit would otherwise fill up across tests)."""
    torch._dynamo.reset()


# ------------------------------------------------------------------ helpers
class Case:
    """A model to build twice (the same weights), its groups, inputs and output."""

    def __init__(self, build, groups, inputs, output=lambda o: o, call=None):
        self.build, self.groups, self.inputs, self.output = build, groups, inputs, output
        self.call = call or (lambda m, inp: m(*inp[0], **inp[1]))

    def run(self, m, inp):
        with torch.no_grad():
            return self.output(self.call(m, inp))


def _arch(name):
    a = archs.ARCHS[name]
    return Case(lambda: archs.build(a), a.groups, lambda s: a.inputs(s), a.output)


def _mixtral(**kw):
    def build():
        torch.manual_seed(0)
        return moe._mixtral(**kw)
    return Case(build, ["model.layers"], lambda s: ((), {"input_ids": moe._ids(batch=2, seed=s)}), lambda o: o.logits)


def _two_group(n_a=6, n_b=2):
    def build():
        torch.manual_seed(0)
        return TwoGroupModel(d=32, n_a=n_a, n_b=n_b).eval()
    return Case(build, GROUPS, lambda s: ((torch.randn(3, 32, generator=torch.Generator().manual_seed(s)),), {}))


CASES = {"flux": lambda: _arch("flux"), "wan": lambda: _arch("wan"), "llama": lambda: _arch("llama"),
         "mixtral": lambda: _mixtral()}


def _layers(model, groups) -> int:
    return max(len(model.get_submodule(g)) for g in groups)


def pair(case, twin_opts=None, **opts):
    """(streamed model, its managers, the resident twin): the twin has every layer
    resident (`twin_opts`: the options that change its graph, e.g. experts)."""
    model, twin = case.build(), case.build()
    managers = layerwise.configure_layerwise_offload(model, case.groups, device="cpu", **opts)
    layerwise.configure_layerwise_offload(twin, case.groups, device="cpu", resident_layers=_layers(twin, case.groups),
                                          **(twin_opts or {}))
    assert all(not m.ring.streamed for m in layerwise.configure.managers_of(twin))
    return model, managers, twin


def graphs() -> int:
    return counters["stats"]["unique_graphs"]


def recompiles() -> int:
    return sum(counters["recompiles"].values()) if "recompiles" in counters else 0


def steps_exact(case, cm, refs, seeds):
    """Each step's output equals the twin's, and no step after the first compiles anything."""
    first = None
    for s, ref in zip(seeds, refs):
        assert torch.equal(case.run(cm, case.inputs(s)), ref), f"step with seed {s}"
        if first is None:
            first = graphs(), recompiles()
    assert (graphs(), recompiles()) == first  # one compile for the shape, none per step


def exact_in_both_modes(case, model, refs):
    """Compiled with fullgraph=True, then (dynamo reset) by default: every step equals
    the twin's, and the default compile breaks no graph."""
    counters.clear()
    steps_exact(case, torch.compile(model, fullgraph=True), refs, SEEDS)
    torch._dynamo.reset()
    counters.clear()
    steps_exact(case, torch.compile(model), refs, SEEDS)
    assert not counters["graph_break"]


def streams(managers) -> bool:
    """The hooks ran and the weights came through the ring: a group whose layers share
    slots (copied in every step) copied. (A group whose streamed layers each have a
    slot of their own copies nothing after configure.)"""
    return any(archs.recopied(m) > 0 and m.stats()["copies"] > 0 for m in managers)


SEEDS = [11, 12, 13]


# ------------------------------------------------------------------ whole models
@pytest.mark.parametrize("name", list(CASES))
def test_fullgraph_streamed_model_is_its_compiled_resident_twin(name):
    case = CASES[name]()
    model, managers, twin = pair(case, prefetch_depth=1)
    counters.clear()  # (the streamed model reuses the graphs compiled for its twin: same class, same operators)
    ct = torch.compile(twin, fullgraph=True)
    refs = [case.run(ct, case.inputs(s)) for s in SEEDS]
    steps_exact(case, torch.compile(model, fullgraph=True), refs, SEEDS)
    assert graphs() > 0 and not counters["graph_break"]
    assert streams(managers)
    eager = case.build()  # the same model, never configured nor compiled: equal up to fusion
    for s, ref in zip(SEEDS, refs):
        torch.testing.assert_close(case.run(eager, case.inputs(s)), ref, rtol=1e-4, atol=1e-5)


def test_a_default_compile_has_no_graph_break():
    case = CASES["llama"]()
    model, managers, twin = pair(case)
    counters.clear()  # (the streamed model may reuse graphs compiled for its twin)
    refs = [case.run(torch.compile(twin), case.inputs(s)) for s in SEEDS]
    steps_exact(case, torch.compile(model), refs, SEEDS)
    assert graphs() > 0 and not counters["graph_break"]
    assert streams(managers)


@pytest.mark.parametrize("opts", [dict(prefetch_depth=2), dict(prefetch_depth=1, resident_layers=2),
                                  dict(prefetch_depth=2, debug_copy_delay_us=300)],
                         ids=["depth2", "resident", "delays"])
def test_fullgraph_streaming_options(opts):
    case = CASES["llama"]()
    model, managers, twin = pair(case, **opts)
    refs = [case.run(torch.compile(twin, fullgraph=True), case.inputs(s)) for s in SEEDS]
    counters.clear()
    steps_exact(case, torch.compile(model, fullgraph=True), refs, SEEDS)
    assert streams(managers)
    if "resident_layers" in opts:
        assert managers[0].resident == [0, 1]


def test_fullgraph_compressed_bf16_model():
    def build():
        torch.manual_seed(0)
        return archs._llama().to(torch.bfloat16).eval()
    llama = archs.ARCHS["llama"]
    case = Case(build, llama.groups, llama.inputs, llama.output)
    model, managers, twin = pair(case, prefetch_depth=1, compress="lossless")
    refs = [case.run(torch.compile(twin, fullgraph=True), case.inputs(s)) for s in SEEDS]
    counters.clear()
    steps_exact(case, torch.compile(model, fullgraph=True), refs, SEEDS)
    assert streams(managers)
    st = managers[0].stats(sync=True)
    assert st["compress"]["layers"] == 7 and 0 < st["bytes_copied"] < st["bytes_raw"]  # encoded bytes crossed


def _shape_counts(case, model, twin, seeds, **compile_kw):
    """unique_graphs after each call, for the twin then the streamed model, each
    compiled from empty caches; and their outputs."""
    counts, outs = [], []
    for m in (twin, model):
        torch._dynamo.reset()
        counters.clear()
        cm = torch.compile(m, fullgraph=True, **compile_kw)
        got, per_call = [], []
        for s in seeds:
            got.append(case.run(cm, case.inputs(s)))
            per_call.append(graphs())
        counts.append(per_call)
        outs.append(got)
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    return counts


def _batches(case):
    """case with inputs of 2, 3 and 4 rows (seed % 3)."""
    case.inputs = lambda s: ((torch.randn(2 + s % 3, 32, generator=torch.Generator().manual_seed(s)),), {})
    return case


def test_a_new_shape_compiles_no_more_than_the_resident_twin():
    """A second shape may compile once more (dynamo's automatic dynamic shapes), a
    third none, exactly as for the twin."""
    case = _batches(_two_group())
    model, managers, twin = pair(case)
    twin_counts, counts = _shape_counts(case, model, twin, [0, 3, 1, 4, 2, 5])  # 2, 2, 3, 3, 4, 4 rows
    assert counts == twin_counts, (counts, twin_counts)
    assert counts[1] == counts[0] and counts[3] == counts[2] and counts[5] == counts[4]  # none per step
    assert counts[4] == counts[3]  # the third shape compiles nothing
    assert streams(managers)


def test_dynamic_true_compiles_once_for_every_shape():
    case = _batches(_two_group())
    model, managers, twin = pair(case)
    twin_counts, counts = _shape_counts(case, model, twin, range(6), dynamic=True)
    assert counts == twin_counts and counts == [counts[0]] * 6, (counts, twin_counts)
    assert streams(managers)


def test_configuring_other_models_recompiles_nothing():
    """Streamed models configured, removed or collected elsewhere in the process do not
    touch what a compiled graph guards on."""
    case = CASES["llama"]()
    model, managers, twin = pair(case)
    refs = [case.run(torch.compile(twin, fullgraph=True), case.inputs(s)) for s in SEEDS]
    cm = torch.compile(model, fullgraph=True)
    assert torch.equal(case.run(cm, case.inputs(SEEDS[0])), refs[0])
    counters.clear()
    other = TwoGroupModel(d=32, n_a=4, n_b=2)
    layerwise.configure_layerwise_offload(other, GROUPS, device="cpu")
    assert torch.equal(case.run(cm, case.inputs(SEEDS[1])), refs[1])
    layerwise.remove_layerwise_offload(other)
    layerwise.configure_layerwise_offload(other, GROUPS, device="cpu")
    del other
    assert torch.equal(case.run(cm, case.inputs(SEEDS[2])), refs[2])
    assert graphs() == 0 and recompiles() == 0


def test_fullgraph_per_block_compile():
    """Every block compiled on its own (`block.compile()`, as diffusers users do): one
    graph serves every block of a class, not one per block."""
    case = CASES["wan"]()
    model, managers, twin = pair(case, prefetch_depth=2)
    for m in (twin, model):
        for block in m.blocks:
            block.compile(fullgraph=True)
    counters.clear()
    steps_exact(case, model, [case.run(twin, case.inputs(s)) for s in SEEDS], SEEDS)
    assert 0 < graphs() < len(model.blocks)
    assert streams(managers)


def test_max_autotune_no_cudagraphs():
    case = _two_group()
    model, managers, twin = pair(case, prefetch_depth=1)
    refs = [case.run(torch.compile(twin, fullgraph=True, mode="max-autotune-no-cudagraphs"), case.inputs(s))
            for s in SEEDS]
    counters.clear()
    steps_exact(case, torch.compile(model, fullgraph=True, mode="max-autotune-no-cudagraphs"), refs, SEEDS)
    assert streams(managers)


# ------------------------------------------------------------------ interrupts
INTERRUPT = {"at": None, "calls": 0}


@torch.library.custom_op("layerwise_tests::interrupt_here", mutates_args=())
def interrupt_here(x: torch.Tensor) -> torch.Tensor:
    """A copy of x; at the armed call, a real SIGINT to this process first (a kernel
    that a compiled graph calls, in the middle of a layer's forward)."""
    INTERRUPT["calls"] += 1
    if INTERRUPT["calls"] == INTERRUPT["at"]:
        os.kill(os.getpid(), signal.SIGINT)
    return x.clone()


@interrupt_here.register_fake
def _(x):
    return torch.empty_like(x)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # (a SIGINT in a weakref callback)
def test_a_sigint_during_a_compiled_forward_leaves_the_next_call_exact():
    case = _two_group()
    model, managers, twin = pair(case, prefetch_depth=2, debug_copy_delay_us=100)
    for m in (model, twin):  # the same operator in both graphs
        for block in m.transformer_blocks:
            block.register_forward_pre_hook(lambda mod, args: (interrupt_here(args[0]),))
    ct, cm = torch.compile(twin, fullgraph=True), torch.compile(model, fullgraph=True)
    refs = [case.run(ct, case.inputs(s)) for s in range(4)]
    assert torch.equal(case.run(cm, case.inputs(0)), refs[0])
    # SIGINTs that land for sure: sent from inside the compiled graph, in layer k's
    # forward (its weights entered, the model's lock held, later layers prefetched).
    for k in range(len(model.transformer_blocks)):
        INTERRUPT.update(at=k + 1, calls=0)
        try:
            with pytest.raises(KeyboardInterrupt):
                case.run(cm, case.inputs(k % 4))
                time.sleep(1)  # (the signal is taken before this ends, if not inside the call)
        finally:
            INTERRUPT["at"] = None
        assert torch.equal(case.run(cm, case.inputs((k + 1) % 4)), refs[(k + 1) % 4]), k
    # Real SIGINTs at random moments of compiled forwards, from a timer thread (where
    # they land is the machine's business; every next call is exact).
    t0 = time.perf_counter()
    case.run(cm, case.inputs(0))
    span = max(time.perf_counter() - t0, 1e-4)
    rng = random.Random(5)
    for n in range(20):
        call_with_a_random_sigint(lambda: case.run(cm, case.inputs(n % 4)), rng, span, within=1.2, after=1.5)
        assert torch.equal(case.run(cm, case.inputs((n + 1) % 4)), refs[(n + 1) % 4]), n
    assert streams(managers)


# ------------------------------------------------------------------ grad mode
GRAD_REFUSED = "layerwise: a compiled forward of a streamed layer with grad enabled"


@pytest.mark.parametrize("fullgraph", [True, False])
@pytest.mark.parametrize("requires_grad", ["parameters", "inputs"])
def test_a_compiled_forward_that_would_build_a_backward_is_refused(fullgraph, requires_grad):
    """The compiled backward would read weights from ring slots that later layers
    refilled: refused with layerwise's own error (not one of dynamo's, nor a silent
    fallback to eager), and the model is unchanged."""
    case = _two_group()
    model, managers, twin = pair(case)
    if requires_grad == "inputs":
        model.requires_grad_(False)
    x = case.inputs(0)[0][0].clone().requires_grad_(requires_grad == "inputs")
    cm = torch.compile(model, fullgraph=fullgraph)
    with pytest.raises(RuntimeError) as err:
        cm(x)
    assert type(err.value) is RuntimeError and str(err.value).startswith(GRAD_REFUSED), err.value
    assert "torch.no_grad()" in str(err.value)
    ref = case.run(torch.compile(twin, fullgraph=fullgraph), case.inputs(0))
    assert torch.equal(case.run(cm, case.inputs(0)), ref)  # under no_grad: exact, after the refusal
    out = model(x)  # and eagerly, a backward through it is the resident model's
    out.square().sum().backward()
    ref_x = x.detach().clone().requires_grad_(requires_grad == "inputs")
    if requires_grad == "inputs":
        twin.requires_grad_(False)
    twin(ref_x).square().sum().backward()
    grads = [(x.grad, ref_x.grad)] if requires_grad == "inputs" else [
        (p.grad, q.grad) for p, q in zip(model.parameters(), twin.parameters())]
    assert all(torch.equal(a, b) for a, b in grads)


def test_grad_mode_with_frozen_parameters_is_exact():
    case = _two_group()
    model, managers, twin = pair(case)
    model.requires_grad_(False)
    twin.requires_grad_(False)
    ct, cm = torch.compile(twin, fullgraph=True), torch.compile(model, fullgraph=True)
    for s in SEEDS:
        x = case.inputs(s)[0][0]
        with torch.enable_grad():
            ref, out = ct(x), cm(x)
        assert not out.requires_grad and torch.equal(out, ref)
    assert streams(managers)


# ------------------------------------------------------------------ a view of a streamed weight
class ViewBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        return self.w.t()  # a view of its own weight, in its ring slot


class ViewModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(ViewBlock() for _ in range(4))

    def forward(self, x):
        return torch.stack([b(x) for b in self.blocks]).sum(0) + x


@pytest.mark.parametrize("fullgraph", [True, False])
def test_a_layer_returning_a_view_of_its_streamed_weight_is_refused(fullgraph):
    torch.manual_seed(0)
    ref = ViewModel()
    model = copy.deepcopy(ref)
    layerwise.configure_layerwise_offload(model, "blocks", device="cpu")
    x = torch.randn(8, 8)
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"layer blocks\[0\] returned a view of its own streamed "
                                                            r"weights under torch.compile"):
        torch.compile(model, fullgraph=fullgraph)(x)
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))  # eagerly the hook returns a copy


# ------------------------------------------------------------------ tiers
def _bf16_net():
    return Case(disk_model.make, ["blocks"], lambda s: ((disk_model.inputs(seed=s)[0],), {}))


def test_disk_tier_under_compile(tmp_path):
    """Layers read from a spill file ahead of their copy: exact, fullgraph and default."""
    case = _bf16_net()
    probe = case.build()
    model, managers, twin = pair(case, prefetch_depth=1, host_budget=disk_model.budget(probe, 1),
                                 spill_dir=str(tmp_path))
    m = managers[0]
    assert [s.kind for s in m.sources].count("disk") >= 3
    refs = [case.run(torch.compile(twin, fullgraph=True), case.inputs(s)) for s in SEEDS]
    exact_in_both_modes(case, model, refs)
    assert m.stats()["disk"]["bytes_read"] > 0 and streams(managers)


def test_compressed_disk_tier_under_compile(tmp_path):
    case = _bf16_net()
    probe = case.build()
    model, managers, twin = pair(case, prefetch_depth=1, compress="lossless", debug_copy_delay_us=200,
                                 debug_read_delay_us=200, host_budget=disk_model.budget(probe, 0),
                                 spill_dir=str(tmp_path))
    assert "spill, encoded" in managers[0].stats()["tier_plan"]
    refs = [case.run(torch.compile(twin, fullgraph=True), case.inputs(s)) for s in SEEDS]
    counters.clear()
    steps_exact(case, torch.compile(model, fullgraph=True), refs, SEEDS)
    st = managers[0].stats(sync=True)
    assert st["disk"]["bytes_read"] > 0 and st["compress"]["layers"] > 0 and streams(managers)


@pytest.mark.parametrize("kind", ["ao-int8", "quanto-qint8"])
def test_quantized_wrappers_under_compile(kind):
    """torchao and optimum-quanto weights, whose inner tensors stream: exact, fullgraph
    and default. (quanto's qint4 does not compile without layerwise either.)"""
    def build():
        return quantized.make(kind, n=6)
    case = Case(build, ["blocks"], lambda s: ((quantized.inputs(seed=s)[0],), {}))
    model, managers, twin = pair(case, prefetch_depth=1)
    quantized.assert_computes_from_slots(model)
    refs = [case.run(torch.compile(twin, fullgraph=True), case.inputs(s)) for s in SEEDS]
    exact_in_both_modes(case, model, refs)
    assert streams(managers)


@pytest.mark.parametrize("fullgraph", [True, False])
def test_routed_experts_under_compile(fullgraph):
    """experts="routed": the expert modules' pre-hooks are traced into an operator that
    takes the routing; its kernel copies the experts the router picked. Exact, with no
    graph break."""
    case = _mixtral()
    model, managers, twin = pair(case, twin_opts=dict(experts="routed"), prefetch_depth=1, experts="routed")
    counters.clear()  # (the streamed model may reuse graphs compiled for its twin)
    refs = [case.run(torch.compile(twin, fullgraph=fullgraph), case.inputs(s)) for s in SEEDS]
    steps_exact(case, torch.compile(model, fullgraph=fullgraph), refs, SEEDS)
    assert not counters["graph_break"]
    st = managers[0].stats(sync=True)["experts"]
    assert st["misses"] > 0 and st["experts_used"] == st["hits"] + st["misses"]
    assert st["demand_bytes"] > 0
    assert streams(managers)
