"""Concurrent calls of one streamed model (layerwise/runtime/cohort.py): threads
that call it at once, with different shapes, step counts and start times, at
random copy delays, get outputs bitwise equal to the same call run alone on the
resident model, on every kind of model (a plain stack of blocks, two groups, a
tiny Flux, a tiny Llama, Mixtral with its experts whole or routed); calls that
overlap copy about one call's bytes (share_calls=False: one call's per call); a
call that starts while another is part way through waits at most about one turn
of the ring; calls that leave early, start late, call blocks out of order or
skip a group stay exact and never hang.

Overlap is made certain where a test counts on it by a barrier in the first
block's pre-hook (it runs after every call's root pre-hook and before layerwise's
own hook), or by starting a call from a hook of another: never by sleeps. The
random sleeps of the first test only vary the interleaving. Every thread join
has a long timeout that only turns a hang into a failure with every thread's
stack."""
import copy
import faulthandler
import random
import sys
import threading

import pytest
import torch

import layerwise

from helpers import archs
from helpers.disk import make as make_net
from helpers.models import TwoGroupModel

WAIT_S = 120  # a guard against a hang, never a measure of speed


@pytest.fixture(autouse=True)
def interleave():
    """Thread switches every 10 us, so that calls interleave inside the hooks."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    yield
    sys.setswitchinterval(before)


def join_all(threads, errors=None):
    for t in threads:
        t.join(WAIT_S)
    hung = [t.name for t in threads if t.is_alive()]
    if hung:
        faulthandler.dump_traceback(all_threads=True)
        pytest.fail(f"threads {hung} still running after {WAIT_S} s (stacks above)")
    if errors:
        raise errors[0]


def run_threads(fns):
    """Run each of `fns` on its own thread; their results in order (the first error raised)."""
    out, errors = [None] * len(fns), []

    def run(k):
        try:
            with torch.no_grad():
                out[k] = fns[k]()
        except BaseException as err:  # noqa: BLE001 - raised in the test's thread
            errors.append(err)

    threads = [threading.Thread(target=run, args=(k,), name=f"call-{k}", daemon=True) for k in range(len(fns))]
    for t in threads:
        t.start()
    join_all(threads, errors)
    return out


def alone(fn):
    """fn() run alone on a thread of its own: a call's reference (a thread's matrix
    products can round differently from the main thread's, whatever streams)."""
    return run_threads([fn])[0]


def groups_of(model):
    return layerwise.managers_of(model)


def bytes_copied(model) -> int:
    return sum(m.stats()["bytes_copied"] for m in groups_of(model))


def calls_stats(model) -> dict:
    return groups_of(model)[0].stats()["calls"]


class Gate:
    """A pre-hook on a model's first streamed block: a thread in `waiting` waits
    there (once) at the barrier of `parties`; the others pass."""

    def __init__(self, block):
        self.barrier, self.waiting = None, set()
        self.handle = block.register_forward_pre_hook(self._hook, prepend=True)

    def arm(self, parties: int) -> None:
        self.barrier, self.waiting = threading.Barrier(parties), set()

    def enter(self) -> None:
        """The calling thread's next pass waits at the barrier."""
        self.waiting.add(threading.get_ident())

    def _hook(self, module, args):
        me = threading.get_ident()
        if me in self.waiting:
            self.waiting.discard(me)
            self.barrier.wait(WAIT_S)


# ------------------------------------------------------------------ the models
class Case:
    """A model kind: build(seed) -> resident model, configure(model, delay),
    inputs(rng, seed) -> one forward's (args, kwargs) of a random shape, output(out)."""

    def __init__(self, name, build, configure, inputs, output, first, rounds, calls):
        self.name, self.build, self.configure, self.inputs, self.output = name, build, configure, inputs, output
        self.first, self.rounds, self.calls = first, rounds, calls

    def forward(self, model, inp):
        args, kwargs = inp
        return self.output(model(*args, **kwargs))


def _net_inputs(rng, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rng.randint(1, 6), 256, generator=g),), {}


def _two_group_inputs(rng, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rng.randint(1, 5), 32, generator=g),), {}


def _flux_inputs(rng, seed):
    return archs._flux_inputs(seed, batch=rng.randint(1, 2), tokens=rng.choice([8, 16, 24]))


def _llama_inputs(rng, seed):
    return archs._llama_inputs(seed, batch=rng.randint(1, 3), tokens=rng.randint(3, 12))


def _mixtral_inputs(rng, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(3, 128, (rng.randint(1, 2), rng.randint(3, 10)), generator=g),), {}


def _mixtral(seed):
    from helpers.moe import _mixtral as build

    torch.manual_seed(seed)
    return build(layers=4)


def _torch_seeded(build):
    def made(seed):
        torch.manual_seed(seed)
        return build().eval()
    return made


def _configure(groups, **extra):
    def configure(model, delay, **kw):
        return layerwise.configure_layerwise_offload(model, groups, device="cpu", debug_copy_delay_us=delay,
                                                     **extra, **kw)
    return configure


CASES = {
    **{f"net-K{k}": Case(f"net-K{k}", lambda seed: make_net(dtype=torch.float32, seed=seed, depth=8),
                         _configure("blocks"), _net_inputs, lambda o: o, lambda m: m.blocks[0], 10, k)
       for k in (2, 4, 8)},
    "two-groups": Case("two-groups", _torch_seeded(TwoGroupModel),
                       _configure(["transformer_blocks", "single_transformer_blocks"]), _two_group_inputs,
                       lambda o: o, lambda m: m.transformer_blocks[0], 10, 3),
    "flux": Case("flux", lambda seed: archs.build(archs.ARCHS["flux"], seed),
                 _configure(archs.ARCHS["flux"].groups), _flux_inputs, lambda o: o[0],
                 lambda m: m.transformer_blocks[0], 4, 3),
    "llama": Case("llama", lambda seed: archs.build(archs.ARCHS["llama"], seed), _configure("model.layers"),
                  _llama_inputs, lambda o: o.logits, lambda m: m.model.layers[0], 4, 3),
    "mixtral": Case("mixtral", _mixtral, _configure("model.layers"), _mixtral_inputs, lambda o: o.logits,
                    lambda m: m.model.layers[0], 4, 3),
    "mixtral-routed": Case("mixtral-routed", _mixtral, _configure("model.layers", experts="routed"),
                           _mixtral_inputs, lambda o: o.logits, lambda m: m.model.layers[0], 4, 3),
}


def _built(case, seed=0):
    if case.name.startswith(("flux", "llama")):
        pytest.importorskip(archs.ARCHS[case.name].package)
    if case.name.startswith("mixtral"):
        pytest.importorskip("transformers")
    return case.build(seed)


# ------------------------------------------------- shapes, steps, starts, delays
@pytest.mark.parametrize("name", list(CASES))
def test_threads_with_different_shapes_share_and_stay_bitwise(name):
    """K calls at once, each of its own shape and number of steps, started after
    a random sleep, on a model whose copies each take a random time: every step's
    output equals the same step on the resident model, alone (on a thread). The first round
    starts every call's first step together (a barrier), so that fetches are
    shared; the others interleave at random."""
    case = CASES[name]
    rng = random.Random(sum(map(ord, name)))
    ref = _built(case)
    model = copy.deepcopy(ref)
    case.configure(model, rng.choice([50, 300, 1000]))
    gate = Gate(case.first(model))
    seed = 100
    for r in range(case.rounds):
        plans = []
        for _ in range(case.calls):
            steps = []
            for _ in range(rng.randint(1, 3)):
                seed += 1
                steps.append(case.inputs(rng, seed))
            plans.append((steps, rng.random() * 0.003 if r else 0.0))
        want = [alone(lambda steps=steps: [case.forward(ref, inp) for inp in steps]) for steps, _ in plans]
        if r == 0:
            gate.arm(case.calls)

        def call(k, first=(r == 0)):
            steps, sleep = plans[k]
            if sleep:
                threading.Event().wait(sleep)  # (varies the interleaving; nothing waits on it)
            if first:
                gate.enter()
            return [case.forward(model, inp) for inp in steps]

        got = run_threads([lambda k=k: call(k) for k in range(case.calls)])
        for k, (g, w) in enumerate(zip(got, want)):
            assert len(g) == len(w)
            for step, (a, b) in enumerate(zip(g, w)):
                assert torch.equal(a, b), f"round {r}, call {k}, step {step}: {(a - b).abs().max()}"
        if r == 0:
            st = calls_stats(model)
            assert st["joins"] > 0 and st["calls_max"] >= 2, st
    gate.handle.remove()
    inp = case.inputs(rng, 7)  # and alone afterwards
    assert torch.equal(alone(lambda: case.forward(model, inp)), alone(lambda: case.forward(ref, inp)))
    assert calls_stats(model)["calls_now"] == 0
    layerwise.remove_layerwise_offload(model)


# ------------------------------------------------------------ bytes of K calls
def _net_model(groups=1, **kw):
    ref = make_net(dtype=torch.float32, depth=8, groups=groups)
    model = copy.deepcopy(ref)
    names = ["blocks", "more"] if groups > 1 else "blocks"
    layerwise.configure_layerwise_offload(model, names, device="cpu", **kw)
    return ref, model


def _net_xs(n, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1 + k % 5, 256, generator=g) for k in range(n)]


def _one_call_bytes(model, x) -> int:
    alone(lambda: model(x))  # the ring as a call alone leaves it
    b0 = bytes_copied(model)
    alone(lambda: model(x))
    return bytes_copied(model) - b0


def _overlapping(model, gate, xs):
    """One forward per input, all begun before any layer is decided (the barrier)."""
    gate.arm(len(xs))

    def call(x):
        gate.enter()
        return model(x)

    return run_threads([lambda x=x: call(x) for x in xs])


@pytest.mark.parametrize("K", [2, 4])
@pytest.mark.parametrize("kw", [dict(prefetch_depth=1), dict(prefetch_depth=2), dict(resident_layers=3),
                                dict(groups=2)], ids=["depth1", "depth2", "resident", "two-groups"])
def test_overlapping_calls_copy_one_calls_bytes(patient, K, kw):
    """K calls at once copy about one call's bytes (a layer is fetched once for
    all of them), whatever their shapes, and each is exact."""
    kw = dict(kw)
    groups = kw.pop("groups", 1)
    ref, model = _net_model(groups=groups, debug_copy_delay_us=300, **kw)
    # At block 0, resident or not: calls that drift apart through resident layers in
    # front are held together by the schedule (the call behind ranks first).
    gate = Gate(model.blocks[0])
    xs = _net_xs(K)
    want = [alone(lambda x=x: ref(x)) for x in xs]
    one = _one_call_bytes(model, xs[0])
    assert one > 0
    b0 = bytes_copied(model)
    got = _overlapping(model, gate, xs)
    together = bytes_copied(model) - b0
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    st = calls_stats(model)
    assert st["joins"] > 0 and st["calls_max"] == K, st
    assert together <= 1.5 * one, (together / one, str(st))
    layerwise.remove_layerwise_offload(model)


@pytest.mark.parametrize("K", [2, 4])
def test_sharing_off_fetches_per_call(K):
    """share_calls=False: each call fetches its own layers. The calls are all under
    way and run one after another inside their overlap (so that no layer a call
    left in a slot serves the next by chance): K calls copy K calls' bytes, nothing
    is joined. Calls at once (a barrier) stay exact and join nothing either."""
    xs = _net_xs(K)
    ref, model = _net_model(debug_copy_delay_us=100, share_calls=False)
    want = [alone(lambda x=x: ref(x)) for x in xs]
    one = _one_call_bytes(model, xs[0])
    done = [threading.Event() for _ in range(K)]
    order = {}

    def after(mod, args):  # (a pre-hook that runs after the gate's, before layerwise's)
        k = order.get(threading.get_ident(), 0)
        if k and not done[k - 1].is_set():
            assert done[k - 1].wait(WAIT_S)

    model.blocks[0].register_forward_pre_hook(after, prepend=True)
    model.blocks[-1].register_forward_hook(lambda mod, a, out: done[order.get(threading.get_ident(), 0)].set())
    gate = Gate(model.blocks[0])
    gate.arm(K)

    def call(k):
        order[threading.get_ident()] = k
        gate.enter()  # every call under way, then each runs once the one before has computed its last layer
        return model(xs[k])

    b0 = bytes_copied(model)
    got = run_threads([lambda k=k: call(k) for k in range(K)])
    copied = (bytes_copied(model) - b0) / one
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    st = calls_stats(model)
    assert st["share_calls"] is False and st["calls_max"] == K, st
    assert st["joins"] == st["loads"] == 0, st
    assert copied >= K - 0.5, copied
    order.clear()
    got = _overlapping(model, gate, xs)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert calls_stats(model)["joins"] == 0
    layerwise.remove_layerwise_offload(model)


@pytest.mark.parametrize("bad", [1, "yes", None, 0.0])
def test_share_calls_takes_a_bool(bad):
    model = make_net(dtype=torch.float32, depth=4)
    with pytest.raises(TypeError, match="share_calls"):
        layerwise.configure_layerwise_offload(model, "blocks", device="cpu", share_calls=bad)
    assert not layerwise.is_offloaded(model)


# ------------------------------------------------------------ one turn at most
@pytest.mark.parametrize("depth,resident", [(1, 0), (2, 0), (1, 3)])
def test_a_call_started_part_way_through_waits_at_most_one_turn(depth, resident):
    """Calls that start from a hook of another call at a random layer of its
    forward (no sleeps: the new call's first layers race the old call's last
    ones): exact, and no call waited for its layer longer than one turn of the
    ring (stats' wait_turns_max: fetches into the group while it waited, over
    the group's streamed layers)."""
    rng = random.Random(depth)
    ref, model = _net_model(prefetch_depth=depth, resident_layers=resident, debug_copy_delay_us=200)
    xs = _net_xs(6, seed=5)
    want = [alone(lambda x=x: ref(x)) for x in xs]
    spawn = {}  # thread ident -> (layer at which it starts the next call, the next call's index)
    threads, got, errors = [], [None] * len(xs), []

    def start(k):
        t = threading.Thread(target=run, args=(k,), name=f"call-{k}", daemon=True)
        threads.append(t)
        t.start()

    def run(k):
        try:
            if k + 1 < len(xs):
                spawn[threading.get_ident()] = [rng.randrange(8), k + 1]
            with torch.no_grad():
                got[k] = model(xs[k])
        except BaseException as err:  # noqa: BLE001 - raised in the test's thread
            errors.append(err)
            last.set()
        if k + 1 == len(xs):
            last.set()

    def hook(j):
        def pre(mod, args):
            todo = spawn.get(threading.get_ident())
            if todo is not None and todo[0] == j and todo[1] is not None:
                todo[1], k = None, todo[1]
                start(k)
        return pre

    for j, block in enumerate(model.blocks):
        block.register_forward_pre_hook(hook(j), prepend=True)
    for _ in range(12):
        threads.clear()
        last = threading.Event()  # the last call has ended (each call starts the next), or one failed
        start(0)
        if not last.wait(WAIT_S):
            faulthandler.dump_traceback(all_threads=True)
            pytest.fail(f"the calls did not end in {WAIT_S} s (stacks above)")
        join_all(list(threads), errors)
        assert len(threads) == len(xs)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    st = calls_stats(model)
    assert st["calls_max"] >= 2 and st["joins"] > 0, st
    # An aged call ranks first a ring's worth of fetches before a turn is over; while
    # the calls joined to its slot compute, prefetches into the other slots go on: at
    # most one turn and depth + 1 fetches.
    streamed = len(groups_of(model)[0].ring.streamed)
    assert st["wait_turns_max"] <= 1.0 + (depth + 1) / streamed, str(st)
    layerwise.remove_layerwise_offload(model)


# ------------------------------------------- early, late, out of order, skipped
def test_calls_that_leave_early_start_late_skip_and_reorder_stay_exact():
    """Calls of different lengths (one forward, several), started at once and
    from inside another call, some calling the first group's blocks out of order
    or skipping the second group: each is exact (bitwise the same call alone) and
    none hangs."""
    torch.manual_seed(0)
    ref = TwoGroupModel(n_a=6, n_b=4)
    model = copy.deepcopy(ref)
    layerwise.configure_layerwise_offload(model, ["transformer_blocks", "single_transformer_blocks"], device="cpu",
                                          debug_copy_delay_us=300)
    g = torch.Generator().manual_seed(2)
    plans = [  # (steps: [(x, order_a, order_b)], start: None at once, else (call, layer of its group a))
        ([(torch.randn(2, 32, generator=g), None, None)], None),
        ([(torch.randn(3, 32, generator=g), [5, 0, 3, 1, 4, 2], None)] * 3, None),
        ([(torch.randn(1, 32, generator=g), None, [])] * 2, (1, 3)),
        ([(torch.randn(4, 32, generator=g), [0, 2, 4], [3, 2])], (0, 1)),
        ([(torch.randn(2, 32, generator=g), [1, 1, 1], [0])] * 4, None),
    ]

    def steps_of(m, k):
        return [m(x, order_a=a, order_b=b) for x, a, b in plans[k][0]]

    want = [alone(lambda k=k: steps_of(ref, k)) for k in range(len(plans))]
    for rnd in range(4):
        got, errors, threads, mine = [None] * len(plans), [], [], {}
        later = {(p[1][0], p[1][1]): k for k, p in enumerate(plans) if p[1] is not None}

        def run(k):
            try:
                mine[threading.get_ident()] = k
                with torch.no_grad():
                    got[k] = steps_of(model, k)
            except BaseException as err:  # noqa: BLE001 - raised in the test's thread
                errors.append(err)

        def start(k):
            t = threading.Thread(target=run, args=(k,), name=f"call-{k}", daemon=True)
            threads.append(t)
            t.start()

        def hook(j):
            def pre(mod, args):
                k = later.pop((mine.get(threading.get_ident()), j), None)
                if k is not None:
                    start(k)
            return pre

        handles = [b.register_forward_pre_hook(hook(j), prepend=True) for j, b in enumerate(model.transformer_blocks)]
        for k, p in enumerate(plans):
            if p[1] is None:
                start(k)
        while True:  # (a call starts others: join until none is left)
            alive = [t for t in threads if t.is_alive()]
            if not alive:
                break
            join_all(alive)
        for h in handles:
            h.remove()
        if errors:
            raise errors[0]
        assert not later, later
        for k, (a, b) in enumerate(zip(got, want)):
            assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b)), (rnd, k)
    assert calls_stats(model)["calls_max"] >= 2
    layerwise.remove_layerwise_offload(model)


def test_overlapping_calls_make_one_step_whose_figures_are_the_batchs(patient):
    """While calls overlap, one step spans them all (from the first one's start to
    the last one's end): a step's figures are the whole batch's, not a slice of
    one call cut by another's start; a call alone afterwards is a step again."""
    ref, model = _net_model(debug_copy_delay_us=300)
    gate = Gate(model.blocks[0])
    xs = _net_xs(4)
    one = _one_call_bytes(model, xs[0])
    group = groups_of(model)[0]
    steps0 = group.stats()["steps"]
    b0 = bytes_copied(model)
    _overlapping(model, gate, xs)
    batch = bytes_copied(model) - b0
    st = group.stats(sync=True)
    assert st["steps"] == steps0 + 1, (st["steps"], steps0)
    assert st["last_step"]["bytes_copied"] == batch and 0 < batch <= 1.5 * one, (st["last_step"], batch, one)
    alone(lambda: model(xs[1]))
    st = group.stats(sync=True)
    assert st["steps"] == steps0 + 2 and 0 < st["last_step"]["bytes_copied"] <= 1.5 * one
    layerwise.remove_layerwise_offload(model)
