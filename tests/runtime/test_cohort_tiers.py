"""Every tier and feature under concurrent calls that share fetches
(runtime/cohort.py): the disk tier, compress, routed experts, quantized
wrappers, torch.compile, share_host, resident layers and prefetch depths,
offload_pipeline. K threads call the model at once; a barrier in layer 0's
pre-hook (registered before layerwise's) makes every call known before the
first layer is decided, so the calls overlap by construction. Each output is
torch.equal to the same call alone on the resident model, and the sharing is
checked by bytes (the disk stage's reads, the bus bytes, the experts copied).

The byte checks need the calls to stay together: the schedule stops keeping a
layer for a call that stays STALL_S between two layers (a loaded CI machine
can pause a thread that long), so those tests make the cohort's patience
longer than any pause (`patient`); exactness never depends on it."""
import copy
import os
import threading
import uuid

import pytest
import torch

import layerwise
from layerwise.configure import managers_of
from layerwise.contract import locking
from layerwise.runtime import cohort
from layerwise.stages.disk.reader import filesystem_type

from helpers import compress as compress_models
from helpers import disk as disk_models


@pytest.fixture
def disk_dir(tmp_path):
    if filesystem_type(tmp_path) in ("tmpfs", "ramfs"):
        pytest.skip("tmp_path is on a memory file system here")  # (as tests/stages/conftest.py's)
    return tmp_path


def together(blocks, calls):
    """Run `calls` (callables of no argument) on threads of their own, under
    no_grad; each thread waits at the first of `blocks` it enters (once) until every
    thread has reached one, so that all the calls are under way before any layer is
    decided. Returns their results in order; raises the first failure."""
    k = len(calls)
    barrier = threading.Barrier(k, timeout=120)
    passed = set()

    def meet(module, args):
        me = threading.get_ident()
        if me not in passed:
            passed.add(me)
            barrier.wait()

    handles = [b.register_forward_pre_hook(meet, prepend=True) for b in blocks]
    outs, errs = [None] * k, [None] * k
    # A new thread starts at the default number of intra-op threads, not this thread's
    # (tests/conftest.py sets 1): a matmul split over another count sums in another order.
    threads_now = torch.get_num_threads()

    def run(j):
        try:
            torch.set_num_threads(threads_now)
            with torch.no_grad():
                outs[j] = calls[j]()
        except BaseException as e:  # noqa: BLE001 - raised below, in the test's thread
            errs[j] = e
            barrier.abort()

    threads = [threading.Thread(target=run, args=(j,), daemon=True) for j in range(k)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert not any(t.is_alive() for t in threads), "a call never finished"
    finally:
        for h in handles:
            h.remove()
    for e in errs:
        if e is not None:
            raise e
    return outs


def alone(model, x):
    with torch.no_grad():
        return model(x)


def calls_figures(model):
    return managers_of(model)[0].stats()["calls"]


def assert_overlapped(model, k):
    st = calls_figures(model)
    assert st["share_calls"] and st["calls_max"] >= k and st["joins"] > 0, st


def rows(k, dtype, d=256, seed=1):
    """k inputs of different shapes (2, 3, ... rows)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2 + j, d, generator=g).to(dtype) for j in range(k)]


def bus_bytes(model):
    return sum(m.stats()["bytes_copied"] for m in managers_of(model))


def measured(model, figure, fn):
    """(fn's result, how much `figure(model)` grew while it ran)."""
    before = figure(model)
    out = fn()
    for m in managers_of(model):
        m.stats(sync=True)
    return out, figure(model) - before


# ------------------------------------------------------------------- the disk tier
def disk_read(model):
    return sum(m.stats()["disk"]["bytes_read"] for m in managers_of(model) if m.stats()["disk"] is not None)


def _disk_shares(model, ref, k):
    xs = rows(k, torch.bfloat16)
    want = [alone(ref, x) for x in xs]
    alone(model, xs[0])  # warm: the read-ahead reaches its steady state
    got1, one = measured(model, disk_read, lambda: alone(model, xs[0]))
    assert torch.equal(got1, want[0]) and one > 0
    outs, shared = measured(model, disk_read, lambda: together(
        [model.blocks[0]], [lambda x=x: model(x) for x in xs]))
    assert all(torch.equal(o, w) for o, w in zip(outs, want))
    assert_overlapped(model, k)
    assert shared <= 1.5 * one, (shared, one, k)  # a layer read once for all the calls that share it
    for x, w in zip(xs, want):  # and alone again afterwards
        assert torch.equal(alone(model, x), w)


@pytest.mark.parametrize("k", [2, 3, 4])
@pytest.mark.parametrize("depth", [1, 2])
def test_spilled_layers_are_read_once_for_all_the_calls(disk_dir, patient, k, depth):
    ref, model = disk_models.make(), disk_models.make()
    (m,) = layerwise.configure_layerwise_offload(
        model, "blocks", device="cpu", prefetch_depth=depth, host_budget=disk_models.budget(model, 1, depth),
        spill_dir=disk_dir, debug_copy_delay_us=200)
    assert sum(s.kind == "disk" for s in m.sources) >= 3
    _disk_shares(model, ref, k)
    layerwise.remove_layerwise_offload(model)


@pytest.mark.parametrize("k", [2, 4])
def test_compressed_spilled_layers_are_read_once_for_all_the_calls(disk_dir, patient, k):
    ref, model = disk_models.make(), disk_models.make()
    (m,) = layerwise.configure_layerwise_offload(
        model, "blocks", device="cpu", compress="lossless", host_budget=disk_models.budget(model, 0),
        spill_dir=disk_dir, debug_copy_delay_us=200, debug_read_delay_us=200)
    assert "spill, encoded" in m.stats()["tier_plan"]
    _disk_shares(model, ref, k)
    layerwise.remove_layerwise_offload(model)


@pytest.mark.parametrize("k", [2, 4])
def test_checkpoint_layers_are_read_once_for_all_the_calls(disk_dir, patient, k):
    ref = disk_models.make()
    ckpt = disk_models.save_checkpoint(ref, os.path.join(disk_dir, "model.safetensors"))
    model = disk_models.meta_model()
    (m,) = layerwise.load_offloaded(model, ckpt, "blocks", device="cpu", host_budget=disk_models.budget(ref, 2),
                                    debug_read_delay_us=200)
    assert sum(s.kind == "disk" for s in m.sources) >= 4
    _disk_shares(model, ref, k)
    layerwise.remove_layerwise_offload(model)


def _exact_and_copied_once(model, ref, xs, k):
    """k calls at once from the barrier at blocks[0]: each the resident call's
    output, and the bus moved at most 1.5x one call's bytes."""
    want = [alone(ref, x) for x in xs]
    alone(model, xs[0])
    _, one = measured(model, bus_bytes, lambda: alone(model, xs[0]))
    outs, shared = measured(model, bus_bytes, lambda: together(
        [model.blocks[0]], [lambda x=x: model(x) for x in xs]))
    assert all(torch.equal(o, w) for o, w in zip(outs, want))
    assert_overlapped(model, k)
    assert 0 < shared <= 1.5 * one, (shared, one)


# ------------------------------------------------------------------------ compress
@pytest.mark.parametrize("k", [2, 4])
def test_compressed_layers_are_copied_once_for_all_the_calls(patient, k):
    ref = compress_models.linear_stack(torch.bfloat16)
    model = copy.deepcopy(ref)
    (m,) = layerwise.configure_layerwise_offload(model, "blocks", device="cpu", compress="lossless",
                                                 debug_copy_delay_us=200)
    assert m.stats()["compress"]["ratio"] < 1, m.stats()["compress"]
    xs = rows(k, torch.bfloat16)
    _exact_and_copied_once(model, ref, xs, k)


# ------------------------------------------------------------------- routed experts
def _routings(m):
    """Record, per thread, the (layer, module, expert) triples its forwards pick
    (the expert modules' pre-hooks, as layerwise/bench/moe.py records them)."""
    from layerwise.runtime.expert_hooks import chosen_experts

    picked: dict = {}
    handles = []
    for i, mods in m.experts.layers.items():
        for xm in mods:
            def rec(mod, args, kwargs, i=i, xm=xm):
                picked.setdefault(threading.get_ident(), set()).update(
                    (i, xm.name, x) for x in chosen_experts(xm.routed(args, kwargs), xm.num_experts))
            handles.append(xm.module.register_forward_pre_hook(rec, with_kwargs=True))
    return picked, handles


@pytest.mark.parametrize("k", [2, 3, 4])
def test_routed_experts_copy_the_union_of_the_calls_picks(patient, k):
    from helpers import moe

    ref = moe._make("mixtral")
    model = copy.deepcopy(ref)
    (m,) = layerwise.configure_layerwise_offload(model, "model.layers", device="cpu", experts="routed",
                                                 debug_copy_delay_us=200)
    ids = [moe._ids(batch=1, tokens=3 + j, seed=10 + j) for j in range(k)]
    with torch.no_grad():
        want = [ref(x).logits for x in ids]
        assert torch.equal(model(ids[0]).logits, want[0])
    picked, handles = _routings(m)
    unit = {(i, xm.name): xm for i, mods in m.experts.layers.items() for xm in mods}
    before = m.stats(sync=True)["experts"]
    outs = together([model.model.layers[0]], [lambda x=x: model(x).logits for x in ids])
    after = m.stats(sync=True)["experts"]
    for h in handles:
        h.remove()
    assert all(torch.equal(o, w) for o, w in zip(outs, want))
    assert_overlapped(model, k)
    assert len(picked) == k
    union = set().union(*picked.values())
    total = sum(len(p) for p in picked.values())
    assert len(union) < total  # (the calls' routings overlap, and differ)
    misses = after["misses"] - before["misses"]
    demand = after["demand_bytes"] - before["demand_bytes"]
    # Each layer is fetched once for all the calls: an expert one call copied into the
    # slot is there for the next, so the experts copied are the union of the picks.
    assert misses == len(union), (misses, len(union), total)
    assert demand == sum(unit[(i, name)].unit_bytes for i, name, _ in union)


def _moe_rounds_exact(model, ref, k):
    """Two rounds of k Mixtral calls at once from the barrier at layer 0, each the resident call's logits."""
    from helpers import moe

    ids = [moe._ids(batch=1, tokens=3 + j, seed=10 + j) for j in range(k)]
    with torch.no_grad():
        want = [ref(x).logits for x in ids]
    for _ in range(2):
        outs = together([model.model.layers[0]], [lambda x=x: model(x).logits for x in ids])
        assert all(torch.equal(o, w) for o, w in zip(outs, want))
    assert_overlapped(model, k)


@pytest.mark.parametrize("opts", [dict(expert_cache="auto"), dict(expert_cache="auto", expert_prefetch=True),
                                  dict(expert_prefetch=True, prefetch_depth=2)])
@pytest.mark.parametrize("k", [2, 4])
def test_routed_experts_with_cache_and_prefetch_are_exact(opts, k):
    from helpers import moe

    ref = moe._make("mixtral")
    model = copy.deepcopy(ref)
    layerwise.configure_layerwise_offload(model, "model.layers", device="cpu", experts="routed",
                                          debug_copy_delay_us=200, **opts)
    _moe_rounds_exact(model, ref, k)


# ---------------------------------------------------------------- quantized wrappers
def _quantized(kind):
    if kind.startswith("bnb-"):
        from helpers import bnb
        return bnb.make(kind[4:]).eval(), bnb.make(kind[4:]).eval(), bnb.D
    from helpers import quantized
    return quantized.make(kind), quantized.make(kind), quantized.D


@pytest.mark.parametrize("kind", ["ao-int8", "quanto-qint8", "bnb-int8", "bnb-nf4"])
@pytest.mark.parametrize("k", [2, 4])
def test_quantized_wrappers_are_exact_under_threads(patient, kind, k):
    ref, model, d = _quantized(kind)
    layerwise.configure_layerwise_offload(model, "blocks", device="cpu", debug_copy_delay_us=200)
    xs = rows(k, torch.bfloat16, d=d)
    _exact_and_copied_once(model, ref, xs, k)


# --------------------------------------------------------------------- torch.compile
def test_two_threads_call_a_compiled_streamed_model(monkeypatch):
    """Compiled as tests/contract/test_compile_native.py compiles it, beside its
    resident twin; both input shapes compiled alone first, then two threads call
    it at once: each output is the twin's, and nothing compiles again. (The
    barrier is in the cohort's first look at the calls under way, from the first
    layer's hook, which the compiled graph calls through
    layerwise::layer_ready: a Python hook on a block would be traced.)"""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from helpers.models import TwoGroupModel

    torch._dynamo.reset()
    counters.clear()
    groups = ["transformer_blocks", "single_transformer_blocks"]

    def build():
        torch.manual_seed(0)
        return TwoGroupModel(d=32, n_a=6, n_b=2).eval()

    model, twin = build(), build()
    managers = layerwise.configure_layerwise_offload(model, groups, device="cpu", prefetch_depth=1,
                                                     debug_copy_delay_us=200)
    layerwise.configure_layerwise_offload(twin, groups, device="cpu", resident_layers=6)
    xs = [torch.randn(2 + j, 32, generator=torch.Generator().manual_seed(j)) for j in range(2)]
    ct, cm = torch.compile(twin, fullgraph=True), torch.compile(model, fullgraph=True)
    with torch.no_grad():
        want = [ct(x) for x in xs]
        for x, w in zip(xs, want):
            assert torch.equal(cm(x), w)
            assert torch.equal(cm(x), w)
    compiled = counters["stats"]["unique_graphs"], sum(counters["recompiles"].values())

    barrier = threading.Barrier(2, timeout=120)
    shared, passed = cohort.Cohort.shared, set()
    lock = model.__dict__[locking.LOCK]

    def meet_then_shared(self):
        # (the first layer's hook asks first, before it takes the model's lock)
        me = threading.get_ident()
        if threading.current_thread() is not threading.main_thread() and me not in passed \
                and not lock.is_owned():
            passed.add(me)
            barrier.wait()
        return shared(self)

    monkeypatch.setattr(cohort.Cohort, "shared", meet_then_shared)
    for _ in range(2):
        outs = together([], [lambda x=x: cm(x) for x in xs])
        assert all(torch.equal(o, w) for o, w in zip(outs, want))
        passed.clear()
    assert (counters["stats"]["unique_graphs"], sum(counters["recompiles"].values())) == compiled
    st = managers[0].stats()["calls"]
    assert st["calls_max"] >= 2 and st["joins"] > 0, st
    torch._dynamo.reset()


# ------------------------------------------------------------------------ share_host
@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="share_host needs Linux (memfd_create)")
@pytest.mark.parametrize("key", [True, "key"])
@pytest.mark.parametrize("k", [2, 4])
def test_share_host_models_called_by_threads_at_once(k, key):
    from helpers.contract import make

    groups = ["transformer_blocks", "single_transformer_blocks"]
    key = key if key is True else f"test-{uuid.uuid4().hex}"
    ref, a, b = make(seed=0), make(seed=0), make(seed=0)
    layerwise.configure_layerwise_offload(a, groups, device="cpu", share_host=key, debug_copy_delay_us=200)
    layerwise.configure_layerwise_offload(b, groups, device="cpu", share_host=key, debug_copy_delay_us=200)
    assert managers_of(b)[0].stats()["share_host"]["role"] == "attached"
    xs = rows(k, torch.float32, d=32)
    want = [alone(ref, x) for x in xs]
    # Half the calls on each model, and each model's calls overlap each other's.
    targets = [a if j % 2 == 0 else b for j in range(k)]
    outs = together([a.transformer_blocks[0], b.transformer_blocks[0]],
                    [lambda x=x, t=t: t(x) for x, t in zip(xs, targets)])
    assert all(torch.equal(o, w) for o, w in zip(outs, want))
    if k >= 4:
        assert_overlapped(a, k // 2)
    outs = together([a.transformer_blocks[0]], [lambda x=x: a(x) for x in xs])
    assert all(torch.equal(o, w) for o, w in zip(outs, want))
    assert_overlapped(a, k)
    layerwise.remove_layerwise_offload(b)
    layerwise.remove_layerwise_offload(a)


# ------------------------------------------------- resident layers and prefetch depths
@pytest.mark.parametrize("depth", [0, 1, 2, 3])
@pytest.mark.parametrize("resident", [0, 2])
@pytest.mark.parametrize("k", [2, 3, 4])
def test_every_depth_and_resident_layers(patient, depth, resident, k):
    from helpers.contract import make

    groups = ["transformer_blocks", "single_transformer_blocks"]
    ref, model = make(seed=0, n_a=6, n_b=3), make(seed=0, n_a=6, n_b=3)
    layerwise.configure_layerwise_offload(model, groups, device="cpu", prefetch_depth=depth,
                                          resident_layers=resident, debug_copy_delay_us=200)
    xs = rows(k, torch.float32, d=32)
    want = [alone(ref, x) for x in xs]
    alone(model, xs[0])
    _, one = measured(model, bus_bytes, lambda: alone(model, xs[0]))
    for _ in range(2):
        outs, shared = measured(model, bus_bytes, lambda: together(
            [model.transformer_blocks[0]], [lambda x=x: model(x) for x in xs]))
        assert all(torch.equal(o, w) for o, w in zip(outs, want))
        assert shared <= 1.5 * one, (shared, one)
    assert_overlapped(model, k)
    for x, w in zip(xs, want):
        assert torch.equal(alone(model, x), w)


# ------------------------------------------------------------------ offload_pipeline
class _Pipe:
    """Two components, as a pipeline holds them (offload_pipeline's `components`)."""

    def __init__(self):
        from helpers.contract import make

        self.text_encoder = make(seed=1, n_a=4, n_b=2)
        self.transformer = make(seed=2, n_a=6, n_b=3)


@pytest.mark.parametrize("k", [2, 3, 4])
def test_pipeline_components_called_by_different_threads_at_once(k):
    ref, pipe = _Pipe(), _Pipe()
    layerwise.offload_pipeline(pipe, device="cpu", debug_copy_delay_us=200)
    comps = [pipe.text_encoder if j % 2 == 0 else pipe.transformer for j in range(k)]
    refs = [ref.text_encoder if j % 2 == 0 else ref.transformer for j in range(k)]
    xs = rows(k, torch.float32, d=32)
    want = [alone(r, x) for r, x in zip(refs, xs)]
    for _ in range(3):
        outs = together([pipe.text_encoder.transformer_blocks[0], pipe.transformer.transformer_blocks[0]],
                        [lambda x=x, c=c: c(x) for x, c in zip(xs, comps)])
        assert all(torch.equal(o, w) for o, w in zip(outs, want))
    for x, c, w in zip(xs, comps, want):
        assert torch.equal(alone(c, x), w)
    if k >= 3:
        assert_overlapped(pipe.text_encoder, 2)
    layerwise.remove_pipeline_offload(pipe)


@pytest.mark.parametrize("cache", [None, "auto"])
@pytest.mark.parametrize("k", [2, 4])
def test_routed_experts_read_from_spill_files_are_exact(disk_dir, cache, k):
    from helpers import moe

    ref = moe._make("mixtral")
    model = copy.deepcopy(ref)
    (m,) = layerwise.configure_layerwise_offload(
        model, "model.layers", device="cpu", experts="routed", host_budget=moe._host_budget(ref),
        spill_dir=str(disk_dir), expert_cache=cache, expert_prefetch=cache is not None, debug_copy_delay_us=200)
    assert m.stats()["disk"]["layers"] >= 1
    _moe_rounds_exact(model, ref, k)
    layerwise.remove_layerwise_offload(model)


# ------------------------------------------------------------------ run_together
def test_run_together_calls_compute_with_the_callers_intra_op_threads():
    """A new thread starts at torch's default number of intra-op threads, not the
    caller's (tests/conftest.py sets 1), and a matmul split over another count sums
    in another order: run_together's calls use the caller's count, so that each is
    bitwise the call alone in the caller's thread."""
    from helpers.contract import make

    groups = ["transformer_blocks", "single_transformer_blocks"]
    ref, model = make(seed=0, n_a=6, n_b=3), make(seed=0, n_a=6, n_b=3)
    layerwise.configure_layerwise_offload(model, groups, device="cpu", debug_copy_delay_us=200)
    xs = rows(4, torch.float32, d=32)
    want = [alone(ref, x) for x in xs]

    def call(x):
        def run(m):
            with torch.no_grad():
                return m(x)
        return run

    for _ in range(2):
        outs = layerwise.run_together(model, [call(x) for x in xs])
        assert all(torch.equal(o, w) for o, w in zip(outs, want))
