"""One rank of the adversarial tests of run_together on split-fetch models
(tests/stages/test_split_attack.py; layerwise/runtime/turns.py): gloo ranks on
CPU, each running `layerwise.run_together` with the same calls (different inputs
per rank) in shapes the turns must survive: compiled models, many calls of very
different lengths, calls that make no forward or call the model inside its own
forward, calls that raise outside the layers, batches in a loop and from a
worker thread, state_dict round trips between batches, pipeline calls that use
one component or both, and a second batch started while one runs. Every output
is bitwise equal to the same call made alone on a resident copy, and the turn
count is the same on every rank.

    python tests/helpers/split_attack_worker.py RANK WORLD PORT TMPDIR SCENARIO
"""
import copy
import random
import threading
import time

import torch
import torch._dynamo
import torch.distributed as dist
from split_together_worker import (
    alone,
    batch_that_fails,
    check,
    inputs,
    main,
    make_call,
    same_on_every_rank,
    same_on_every_rank_pick,
)
from split_worker import Net

import layerwise
from layerwise.stages import split


def configured(**kw):
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    layerwise.configure_layerwise_offload(model, ["blocks", "extra"], device="cpu", split_fetch=dist.group.WORLD,
                                          debug_copy_delay_us=kw.pop("delay", 200), **kw)
    return model, reference


def stats_turns(model):
    """stats()["calls"]["turns"] of every group of the model: one figure, the same on every rank."""
    figures = {m.stats()["calls"]["turns"] for m in layerwise.managers_of(model)}
    assert len(figures) == 1, figures
    return same_on_every_rank(figures.pop())[0]


def compiled_call(fn, xs):
    def call(model):
        with torch.no_grad():
            return [fn(x) for x in xs]
    return call


def _compile_round(model, reference, cm, rank, what, steps=(2, 1, 3)):
    xs = [inputs(rank, k, s) for k, s in enumerate(steps)]
    refs = [alone(reference, x) for x in xs]
    t0 = stats_turns(model)
    outs = layerwise.run_together(model, [compiled_call(cm, x) for x in xs])
    check(outs, refs, rank, what)
    assert stats_turns(model) > t0, what


def scenario_compile_eager(rank, world, tmp):
    """torch.compile(model, backend="eager") after configure and before it: run_together's
    calls through the compiled module take turns, exact, two batches each."""
    import torch._dynamo

    torch._dynamo.reset()
    model, reference = configured()
    cm = torch.compile(model, backend="eager")
    for r in range(2):
        _compile_round(model, reference, cm, rank, f"compiled after configure, round {r}")
    layerwise.remove_layerwise_offload(model)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    cm = torch.compile(model, backend="eager")
    layerwise.configure_layerwise_offload(model, ["blocks", "extra"], device="cpu", split_fetch=dist.group.WORLD,
                                          debug_copy_delay_us=200)
    for r in range(2):
        _compile_round(model, reference, cm, rank, f"compiled before configure, round {r}")
    layerwise.remove_layerwise_offload(model)


def scenario_compile_module(rank, world, tmp):
    """run_together(torch.compile(model), calls): the compiled module stands for the
    offloaded model it wraps (its calls take turns), or is refused with a message
    that names what to pass; never plain threads on a split model."""
    import torch._dynamo

    torch._dynamo.reset()
    model, reference = configured()
    cm = torch.compile(model, backend="eager")
    xs = [inputs(rank, k, s) for k, s in enumerate((2, 1, 3))]
    refs = [alone(reference, x) for x in xs]
    t0 = stats_turns(model)
    outs = layerwise.run_together(cm, [make_call(x) for x in xs])
    check(outs, refs, rank, "run_together(compiled module)")
    assert stats_turns(model) > t0, "the compiled module's calls took no turns"
    layerwise.remove_layerwise_offload(model)


class NestNet(Net):
    """A model that, given `inner`, calls itself on it inside its own forward (before
    its own blocks): one call, two forwards of the model, nested."""

    def forward(self, x, inner=None):
        if inner is not None:
            x = x + self(inner).sum(0, keepdim=True)
        return super().forward(x)


def scenario_many(rank, world, tmp):
    """8 calls: one with 6 forwards beside ones with 1, two with none, one that calls
    the model inside its own forward; three batches with per-rank sleeps."""
    torch.manual_seed(0)
    model = NestNet()
    reference = copy.deepcopy(model)
    layerwise.configure_layerwise_offload(model, ["blocks", "extra"], device="cpu", split_fetch=dist.group.WORLD,
                                          debug_copy_delay_us=100)
    rnd = random.Random(11 + rank)
    for r in range(3):
        steps = [1, 6, 0, 2, 1, 0, 3, 1]
        xs = [inputs(rank, k + 10 * r, s) for k, s in enumerate(steps)]
        nest = inputs(rank, 99 + r, 2)  # call 7: the model inside its own forward, twice

        def nested(m):
            with torch.no_grad():
                return [m(x, inner=y) for x, y in zip(xs[7] + xs[7], nest)]

        refs = [alone(reference, x) for x in xs[:7]]
        with torch.no_grad():
            refs.append([reference(x, inner=y) for x, y in zip(xs[7] + xs[7], nest)])
        sleeps = [[rnd.uniform(0, 0.01) for _ in x] for x in xs]
        calls = [make_call(x, sl) for x, sl in zip(xs[:7], sleeps)] + [nested]
        t0 = stats_turns(model)
        outs = layerwise.run_together(model, calls)
        check(outs, refs, rank, f"many, round {r}")
        assert stats_turns(model) - t0 >= 6, "a call's 6 forwards took fewer than 6 turns"
    layerwise.remove_layerwise_offload(model)


def scenario_raises_outside(rank, world, tmp):
    """On every rank: call 1 raises in its own code between two forwards, call 2's
    second forward raises in the model's non-layer code (an input of the wrong width
    into the embedding, before any block): the others exact, the next batch exact,
    the turns the same on every rank."""
    model, reference = configured()
    xs = [inputs(rank, k, 3) for k in range(4)]
    refs = [alone(reference, x) for x in xs]
    got = [[] for _ in xs]

    def call(k):
        def run(m):
            with torch.no_grad():
                for j, x in enumerate(xs[k]):
                    if k == 1 and j == 1:
                        raise ValueError("call 1 fails between its forwards")
                    if k == 2 and j == 1:
                        x = torch.randn(3, 47)  # (the embedding takes 48)
                    got[k].append(m(x))
        return run

    for r in range(2):
        for g in got:
            g.clear()
        try:
            layerwise.run_together(model, [call(k) for k in range(4)])
            raise AssertionError("the failures were not raised")
        except (ValueError, RuntimeError) as e:
            assert "between its forwards" in str(e) or "47" in str(e) or "shapes" in str(e), str(e)
        check([got[0], got[3]], [refs[0], refs[3]], rank, f"the others, round {r}")
        assert len(got[1]) == 1 and len(got[2]) == 1, [len(g) for g in got]
        stats_turns(model)
        outs = layerwise.run_together(model, [make_call(x) for x in xs])
        check(outs, refs, rank, f"after the failures, round {r}")
        stats_turns(model)
    layerwise.remove_layerwise_offload(model)


def scenario_loop(rank, world, tmp):
    """10 batches in a row, sizes and lengths agreed, sleeps that differ per rank (one
    call of one batch starts 0.6 s late on rank 0 only); then 2 batches from a worker
    thread."""
    model, reference = configured(delay=50)
    rnd = random.Random(21 + rank)
    for r in range(10):
        n = same_on_every_rank_pick(random.Random(r).choice([1, 2, 3]))
        steps = [1 + (k + r) % 2 for k in range(n)]
        xs = [inputs(rank, k + 10 * r, s) for k, s in enumerate(steps)]
        refs = [alone(reference, x) for x in xs]
        sleeps = [[rnd.uniform(0, 0.01) for _ in x] for x in xs]
        if r == 7 and rank == 0:
            sleeps[-1][0] = 0.6
        outs = layerwise.run_together(model, [make_call(x, sl) for x, sl in zip(xs, sleeps)])
        check(outs, refs, rank, f"loop batch {r}")
    stats_turns(model)
    box = {}

    def worker():
        try:
            for r in range(2):
                xs = [inputs(rank, k + 500 + 10 * r, 2) for k in range(3)]
                refs = [alone(reference, x) for x in xs]
                outs = layerwise.run_together(model, [make_call(x) for x in xs])
                check(outs, refs, rank, f"from a worker thread, batch {r}")
            box["ok"] = True
        except BaseException as e:  # noqa: BLE001 - reported below
            box["err"] = e

    t = threading.Thread(target=worker)
    t.start()
    t.join(90)
    assert not t.is_alive(), "run_together from a worker thread did not end"
    if "err" in box:
        raise box["err"]
    stats_turns(model)
    layerwise.remove_layerwise_offload(model)


def scenario_state(rank, world, tmp):
    """Between batches: state_dict (the resident values), load_state_dict of new
    values (the same on every rank), a plain forward; each batch exact."""
    model, reference = configured()
    for r in range(3):
        xs = [inputs(rank, k + 10 * r, 2) for k in range(3)]
        refs = [alone(reference, x) for x in xs]
        outs = layerwise.run_together(model, [make_call(x) for x in xs])
        check(outs, refs, rank, f"state, batch {r}")
        sd, want = model.state_dict(), reference.state_dict()
        assert sd.keys() == want.keys()
        for name in want:
            assert torch.equal(sd[name], want[name]), (rank, r, name)
        g = torch.Generator().manual_seed(77 + r)  # the same values on every rank
        new = {name: (v + 0.01 * torch.randn(v.shape, generator=g).to(v.dtype)) for name, v in want.items()}
        model.load_state_dict(new)
        reference.load_state_dict(new)
        check([alone(model, xs[0][:1])], [alone(reference, xs[0][:1])], rank, f"plain forward after load {r}")
    stats_turns(model)
    layerwise.remove_layerwise_offload(model)


class TwoParts:
    """A pipeline of two streamed components; `use` picks which a call runs."""

    def __init__(self):
        torch.manual_seed(0)
        self.first = Net()
        self.second = Net(n=4, m=2)

    def __call__(self, x, use="both"):
        with torch.no_grad():
            if use == "first":
                return self.first(x)
            if use == "second":
                return self.second(x)
            return self.second(self.first(x))


def scenario_pipeline_partial(rank, world, tmp):
    """Pipeline calls that use the first component, the second, or both (by call index,
    the same on every rank), some twice; three batches with per-rank delays."""
    pipe, ref = TwoParts(), TwoParts()
    layerwise.offload_pipeline(pipe, device="cpu", split_fetch=dist.group.WORLD, debug_copy_delay_us=100)
    rnd = random.Random(31 + rank)
    uses = ["second", "first", "both", "second", "both", "first"]
    for r in range(3):
        xs = [inputs(rank, k + 10 * r, 2) for k in range(len(uses))]
        refs = [[ref(x, use=u) for x in xx] for xx, u in zip(xs, uses)]
        delays = [rnd.uniform(0, 0.01) for _ in xs]

        def call(xx, use, delay):
            def run(p):
                out = []
                for x in xx:
                    time.sleep(delay)
                    out.append(p(x, use=use))
                return out
            return run

        outs = layerwise.run_together(pipe, [call(xx, u, d) for xx, u, d in zip(xs, uses, delays)])
        check(outs, refs, rank, f"pipeline, batch {r}")
        stats_turns(pipe.first)
        assert stats_turns(pipe.first) == stats_turns(pipe.second)
    layerwise.remove_pipeline_offload(pipe)


def scenario_second_batch(rank, world, tmp):
    """A second run_together on the same rank while one runs (from another thread, and
    from inside one of the batch's calls): refused with RuntimeError naming the cause,
    the first batch exact, the next one exact."""
    model, reference = configured()
    xs = [inputs(rank, k, 3) for k in range(3)]
    refs = [alone(reference, x) for x in xs]
    started, release = threading.Event(), threading.Event()
    box = {}

    def slow(x):
        def run(m):
            outs = []
            with torch.no_grad():
                for j, xi in enumerate(x):
                    outs.append(m(xi))
                    if j == 0:
                        started.set()
                        release.wait(30)
            return outs
        return run

    def first():
        try:
            box["outs"] = layerwise.run_together(model, [slow(x) for x in xs])
        except BaseException as e:  # noqa: BLE001 - reported below
            box["err"] = e

    t = threading.Thread(target=first)
    t.start()
    assert started.wait(60)
    try:
        layerwise.run_together(model, [make_call(xs[0])])
        raise AssertionError("a second run_together at once was not refused")
    except RuntimeError as e:
        assert "another run_together" in str(e), str(e)
    finally:
        release.set()
    t.join(60)
    assert not t.is_alive()
    if "err" in box:
        raise box["err"]
    check(box["outs"], refs, rank, "the first batch")

    def inner(m):  # a call that starts a batch of its own
        return layerwise.run_together(m, [make_call(xs[0])])

    try:
        layerwise.run_together(model, [make_call(xs[0]), inner, make_call(xs[2])])
        raise AssertionError("run_together inside a call was not refused")
    except RuntimeError as e:
        assert "another run_together" in str(e), str(e)
    outs = layerwise.run_together(model, [make_call(x) for x in xs])
    check(outs, refs, rank, "after the refusals")
    stats_turns(model)
    layerwise.remove_layerwise_offload(model)


def scenario_empty(rank, world, tmp):
    """run_together with no calls, and with calls that make no forward: nothing to agree
    on, nothing hangs; the next batch exact."""
    model, reference = configured()
    assert layerwise.run_together(model, []) == []
    assert layerwise.run_together(model, [lambda m: 1, lambda m: 2]) == [1, 2]
    xs = [inputs(rank, k, 1) for k in range(2)]
    outs = layerwise.run_together(model, [make_call(x) for x in xs])
    check(outs, [alone(reference, x) for x in xs], rank, "after empty batches")
    stats_turns(model)
    layerwise.remove_layerwise_offload(model)


_FAILS = {}


@torch._dynamo.disable
def _fail_once(x):
    """Raises for call 1's second forward (by thread name: the same on every rank)."""
    name = threading.current_thread().name
    _FAILS[name] = _FAILS.get(name, 0) + 1
    if name == "layerwise-call-1" and _FAILS[name] == 2:
        raise ValueError("call 1 fails after its blocks")
    return x


class FailNet(Net):
    """Net whose head runs after a graph break that raises once (call 1, second forward)."""

    def forward(self, x):
        x = self.embed(x)
        for b in self.blocks:
            x = b(x)
        for b in self.extra:
            x = b(x)
        return self.head(_fail_once(x))


def scenario_compile_raises(rank, world, tmp):
    """A compiled call that raises after its blocks, in code torch.compile does not trace
    (the root post-hook may never run): the others exact, the next batch exact."""
    import torch._dynamo

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = FailNet()
    reference = copy.deepcopy(model)
    layerwise.configure_layerwise_offload(model, ["blocks", "extra"], device="cpu", split_fetch=dist.group.WORLD,
                                          debug_copy_delay_us=200)
    cm = torch.compile(model, backend="eager")
    xs = [inputs(rank, k, 3) for k in range(3)]
    with torch.no_grad():
        refs = [[Net.forward(reference, x) for x in xx] for xx in xs]
    got = batch_that_fails(model, cm, xs, "after its blocks")
    check([got[0], got[2]], [refs[0], refs[2]], rank, "the others")
    assert len(got[1]) == 1
    stats_turns(model)
    outs = layerwise.run_together(model, [compiled_call(cm, x) for x in xs])
    check(outs, refs, rank, "after the failure")
    stats_turns(model)
    layerwise.remove_layerwise_offload(model)


def scenario_share_calls_false(rank, world, tmp):
    """split_fetch with share_calls=False: run_together's calls still issue the ranks'
    collectives in one order (or run_together refuses up front); three batches with
    sleeps that differ per rank, exact."""
    model, reference = configured(share_calls=False)
    rnd = random.Random(41 + rank)
    for r in range(3):
        xs = [inputs(rank, k + 10 * r, 2) for k in range(3)]
        refs = [alone(reference, x) for x in xs]
        sleeps = [[rnd.uniform(0, 0.01) for _ in x] for x in xs]
        outs = layerwise.run_together(model, [make_call(x, sl) for x, sl in zip(xs, sleeps)])
        check(outs, refs, rank, f"share_calls=False, batch {r}")
    layerwise.remove_layerwise_offload(model)


def scenario_long_wait(rank, world, tmp):
    """Call 1 arrives at the second component while call 0's turn on the first lasts
    longer than LAYERWISE_COLLECTIVE_TIMEOUT_S (3 s here): a wait while a turn goes
    on is no sign of ranks out of lockstep; both calls exact."""
    pipe, ref = TwoParts(), TwoParts()
    layerwise.offload_pipeline(pipe, device="cpu", split_fetch=dist.group.WORLD, debug_copy_delay_us=200)
    x = inputs(rank, 0, 1)[0]
    y = inputs(rank, 1, 1)[0]
    refs = [ref(x, use="first"), ref(y, use="second")]
    # Each of the first component's 9 layers lasts at least 0.4 s: its turn, at least
    # 3.6 s, outlasts the timeout whatever the machine's speed.
    hooks = [b.register_forward_pre_hook(lambda module, args: time.sleep(0.4))
             for b in list(pipe.first.blocks) + list(pipe.first.extra)]

    def late(p):
        time.sleep(0.3)  # (arrives while call 0's turn is under way)
        return p(y, use="second")

    outs = layerwise.run_together(pipe, [lambda p: p(x, use="first"), late])
    for h in hooks:
        h.remove()
    check([[outs[0]], [outs[1]]], [[refs[0]], [refs[1]]], rank, "long wait")
    stats_turns(pipe.first)
    layerwise.remove_pipeline_offload(pipe)


def scenario_nested_other(rank, world, tmp):
    """On every rank, call 1 calls the pipeline's second component inside a forward of
    the first (refused: one model's forward at a time in a turn): call 1 raises
    SplitError naming the cause; the turn's other calls exact; the next batch exact."""
    pipe, ref = TwoParts(), TwoParts()
    layerwise.offload_pipeline(pipe, device="cpu", split_fetch=dist.group.WORLD, debug_copy_delay_us=100)
    xs = [inputs(rank, k, 2) for k in range(3)]
    refs = [[ref(x, use="first") for x in xx] for xx in xs]

    def inside(module, args):
        if threading.current_thread().name == "layerwise-call-1":
            pipe.second(args[0])

    handle = pipe.first.embed.register_forward_pre_hook(inside)
    got = [[] for _ in xs]

    def call(k):
        def run(p):
            for x in xs[k]:
                got[k].append(p(x, use="first"))
        return run

    try:
        layerwise.run_together(pipe, [call(k) for k in range(3)])
        raise AssertionError("the nested forward was not refused")
    except split.SplitError as e:
        assert "one model's forward at a time" in str(e), str(e)
    handle.remove()
    check([got[0], got[2]], [refs[0], refs[2]], rank, "the others")
    outs = layerwise.run_together(pipe, [lambda p, xx=xx: [p(x, use="first") for x in xx] for xx in xs])
    check(outs, refs, rank, "after the refusal")
    stats_turns(pipe.first)
    layerwise.remove_pipeline_offload(pipe)


SCENARIOS = {"nested_other": scenario_nested_other, "long_wait": scenario_long_wait, "compile_raises": scenario_compile_raises, "share_calls_false": scenario_share_calls_false,
             "compile_eager": scenario_compile_eager, "compile_module": scenario_compile_module,
             "many": scenario_many,
             "raises_outside": scenario_raises_outside, "loop": scenario_loop, "state": scenario_state,
             "pipeline_partial": scenario_pipeline_partial, "second_batch": scenario_second_batch,
             "empty": scenario_empty}


if __name__ == "__main__":
    main(SCENARIOS, short_timeout=("long_wait",))
