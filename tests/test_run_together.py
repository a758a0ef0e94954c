"""layerwise.run_together (layerwise/together.py): results in call order; the
earliest failure raised once every other call has finished, with a note naming
the failed calls; bad arguments refused before anything runs; a model's calls
may take no argument; a pipeline's calls each run on a view of their own (its
own scheduler): two calls at once are bitwise each alone, on a small pipeline
with a scheduler object and on a tiny diffusers FluxPipeline at two resolutions."""
import copy
import dataclasses
import threading

import pytest
import torch
from torch import nn

import layerwise

from helpers.models import TwoGroupModel

GROUPS = ["transformer_blocks", "single_transformer_blocks"]
WAIT_S = 120  # a guard against a hang, never a measure of speed


def make(seed=0):
    torch.manual_seed(seed)
    return TwoGroupModel()


def offloaded(seed=0, **kw):
    ref = make(seed)
    model = copy.deepcopy(ref)
    layerwise.configure_layerwise_offload(model, GROUPS, device="cpu", debug_copy_delay_us=200, **kw)
    return ref, model


def xs(n=4):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(1 + k, 32, generator=g) for k in range(n)]


def on_thread(fn):
    """fn() on a thread of its own: a call's reference (a thread's matrix products
    can round differently from the main thread's)."""
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join(WAIT_S)
    return out[0]


def steps(model, x, n):
    with torch.no_grad():
        return [model(x) for _ in range(n)]


def test_results_come_back_in_order_and_exact():
    ref, model = offloaded()
    inputs = xs()
    want = [on_thread(lambda x=x, k=k: steps(ref, x, 1 + k % 3)) for k, x in enumerate(inputs)]
    got = layerwise.run_together(model, [lambda m, x=x, k=k: steps(m, x, 1 + k % 3) for k, x in enumerate(inputs)])
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert len(a) == len(b) and all(torch.equal(u, v) for u, v in zip(a, b))


def test_a_compiled_model_is_its_offloaded_model():
    """run_together(torch.compile(model), calls): the compiled module stands for the
    offloaded model it wraps (not refused as "not offloaded"); each call gets the
    compiled module, and is exact."""
    import torch._dynamo

    torch._dynamo.reset()
    ref, model = offloaded()
    compiled = torch.compile(model, backend="eager")
    inputs = xs(2)
    want = [on_thread(lambda x=x: steps(ref, x, 2)) for x in inputs]
    seen = []
    got = layerwise.run_together(compiled, [lambda m, x=x: (seen.append(m), steps(m, x, 2))[1] for x in inputs])
    assert all(m is compiled for m in seen)
    assert all(torch.equal(g, w) for gs, ws in zip(got, want) for g, w in zip(gs, ws))
    torch._dynamo.reset()


def test_a_models_calls_may_take_no_argument():
    ref, model = offloaded()
    inputs = xs(3)
    want = [on_thread(lambda x=x: steps(ref, x, 2)) for x in inputs]
    got = layerwise.run_together(model, [lambda x=x: steps(model, x, 2) for x in inputs])
    assert all(torch.equal(u, v) for a, b in zip(got, want) for u, v in zip(a, b))


def test_the_earliest_failure_is_raised_after_the_others_finished():
    """Calls 1 and 3 fail, 1 first (3 fails once 1's thread has ended); calls 0
    and 2 run several steps to their end: their side effects are all there and
    exact when run_together raises call 1's error, noted with both failures."""
    ref, model = offloaded()
    inputs = xs(4)
    want = {k: on_thread(lambda x=inputs[k]: steps(ref, x, 3)) for k in (0, 2)}
    done, first = {}, []

    def good(k):
        def call(m):
            done[k] = steps(m, inputs[k], 3)
            return done[k]
        return call

    def fails_first(m):
        first.append(threading.current_thread())
        with torch.no_grad():
            m(inputs[1])
        raise ValueError("call 1 broke")

    def fails_later(m):
        while not first:
            threading.Event().wait(0.001)
        first[0].join(WAIT_S)  # call 1 has failed (its thread ended)
        raise KeyError("call 3 broke")

    with pytest.raises(ValueError, match="call 1 broke") as info:
        layerwise.run_together(model, [good(0), fails_first, good(2), fails_later])
    note = " ".join(getattr(info.value, "__notes__", []))
    assert "call 1 failed first" in note and "[1, 3]" in note, note
    assert set(done) == {0, 2}
    for k in (0, 2):
        assert all(torch.equal(u, v) for u, v in zip(done[k], want[k]))
    assert all(m.stats()["calls"]["calls_now"] == 0 for m in layerwise.managers_of(model))
    assert torch.equal(on_thread(lambda: steps(model, inputs[0], 1)[0]), want[0][0])  # still streaming, exact


def test_one_failure_is_raised_as_it_is():
    _, model = offloaded()
    with pytest.raises(ZeroDivisionError) as info:
        layerwise.run_together(model, [lambda m: 1 / 0, lambda m: steps(m, xs(1)[0], 1)])
    assert not getattr(info.value, "__notes__", None)


def test_bad_arguments_are_refused():
    plain = make()
    with pytest.raises(ValueError, match="not offloaded"):
        layerwise.run_together(plain, [lambda m: m])
    _, model = offloaded()
    with pytest.raises(TypeError, match=r"calls \[1\] are not callable"):
        layerwise.run_together(model, [lambda m: m, 3])
    with pytest.raises(TypeError, match="list of callables"):
        layerwise.run_together(model, lambda m: m)
    with pytest.raises(ValueError, match="at most one argument"):
        layerwise.run_together(model, [lambda a, b: a])
    pipe = Pipe()
    with pytest.raises(ValueError, match="not offloaded"):
        layerwise.run_together(pipe, [lambda p: p])
    layerwise.offload_pipeline(pipe, device="cpu")
    with pytest.raises(ValueError, match="takes the pipeline as its argument"):
        layerwise.run_together(pipe, [lambda p: p, lambda: 1])


# ------------------------------------------------------------------- pipelines
class Scheduler:
    """A scheduler object as diffusers' are: set per call, stepped in the loop."""

    def __init__(self):
        self.timesteps, self.step_index = None, None

    def set_timesteps(self, n):
        self.timesteps, self.step_index = torch.linspace(1.0, 0.1, n), 0

    def step(self, out, x):
        t = self.timesteps[self.step_index]
        self.step_index += 1
        return x - t * out


class Pipe:
    """A pipeline as offload_pipeline takes one: modules and a scheduler."""

    def __init__(self, seed=0):
        self.transformer = make(seed)
        torch.manual_seed(seed + 1)
        self.vae = nn.Linear(32, 32)
        self.scheduler = Scheduler()

    def __call__(self, x, n):
        self.scheduler.set_timesteps(n)
        with torch.no_grad():
            for _ in range(n):
                x = self.scheduler.step(self.transformer(x), x)
            return self.vae(x)


def test_two_pipeline_calls_at_once_are_each_alone():
    ref, pipe = Pipe(), Pipe()
    layerwise.offload_pipeline(pipe, device="cpu", debug_copy_delay_us=200)
    a, b = xs(2)
    want = [on_thread(lambda: ref(a, 3)), on_thread(lambda: ref(b, 5))]
    got = layerwise.run_together(pipe, [lambda p: p(a, 3), lambda p: p(b, 5)])
    assert all(torch.equal(u, v) for u, v in zip(got, want))
    assert pipe.scheduler.timesteps is None and pipe.scheduler.step_index is None  # each call had its own


def test_two_flux_pipeline_calls_at_two_resolutions_are_each_alone():
    pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    from layerwise.bench.pipeline import SIZES, generate, tiny_flux_pipeline

    sizes = [SIZES["tiny"], dataclasses.replace(SIZES["tiny"], image=48)]
    ref = tiny_flux_pipeline(sizes[0])
    want = [on_thread(lambda s=s: generate(ref, s)) for s in sizes]
    pipe = tiny_flux_pipeline(sizes[0])
    layerwise.offload_pipeline(pipe, device="cpu", debug_copy_delay_us=100)
    before = copy.deepcopy(pipe.scheduler.__dict__)
    got = layerwise.run_together(pipe, [lambda p, s=s: generate(p, s) for s in sizes])
    assert [g.shape for g in got] == [w.shape for w in want] and want[0].shape != want[1].shape
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert pipe.scheduler.__dict__.keys() == before.keys()
    assert all(repr(pipe.scheduler.__dict__[k]) == repr(v) for k, v in before.items())  # untouched


def test_calls_that_cannot_take_the_model_are_refused_naming_the_fix():
    """What a user may pass by mistake as `calls` (a tensor, a string, a dict, the
    model itself, a callable with a required keyword) is refused before any call
    runs, saying what `calls` must be."""
    lw = layerwise
    model = TwoGroupModel()
    lw.configure_layerwise_offload(model, ["transformer_blocks", "single_transformer_blocks"], device="cpu")
    x = torch.randn(2, 32)
    for bad in (torch.randn(2, 32), "ab", {lambda m: m(x): 1}):
        with pytest.raises(TypeError, match="list of callables"):
            lw.run_together(model, bad)
    with pytest.raises(TypeError, match=r"calls \[1\] are not callables that take the model"):
        lw.run_together(model, [lambda m: m(x), model])
    with pytest.raises(ValueError, match="keyword argument"):
        lw.run_together(model, [lambda *, m: m(x)])
    with pytest.raises(ValueError, match="pass that model"):
        lw.run_together(model.transformer_blocks, [lambda m: m(x)])
    assert lw.managers_of(model)[0].stats()["calls"]["calls_max"] == 0
    lw.remove_layerwise_offload(model)
