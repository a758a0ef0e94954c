"""One rank of the tests of run_together on split-fetch models
(tests/stages/test_split_together.py; layerwise/runtime/turns.py): gloo ranks on
CPU, each running `layerwise.run_together` with the same calls (different inputs
per rank), whose outputs must be bitwise equal to each call made alone on a
resident model, whatever each rank's threads do meanwhile.

    python tests/helpers/split_together_worker.py RANK WORLD PORT TMPDIR SCENARIO
"""
import copy
import datetime
import os
import random
import sys
import time

import torch
import torch.distributed as dist
from split_worker import NET16, Net, configure_spilled, smallest_budget
from torch import nn

import layerwise
from layerwise.runtime import turns
from layerwise.stages import split


def bytes_copied(model):
    return sum(m.stats()["bytes_copied"] for m in layerwise.managers_of(model))


def turns_of(model):
    return model.__dict__[turns.TURNS][0].figures()["turns"]


def same_on_every_rank(v):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, v)
    assert all(o == out[0] for o in out), out
    return out


def inputs(rank, k, steps, d=48):
    g = torch.Generator().manual_seed(1000 * rank + k)
    rows = [3, 5, 2, 4, 1, 6][k % 6]  # a shape per call, the same on every rank
    return [torch.randn(rows, d, generator=g) for _ in range(steps)]


def make_call(xs, sleeps=None):
    def call(model):
        outs = []
        with torch.no_grad():
            for j, x in enumerate(xs):
                if sleeps is not None:
                    time.sleep(sleeps[j])
                outs.append(model(x))
        return outs
    return call


def alone(reference, xs):
    with torch.no_grad():
        return [reference(x) for x in xs]


def check(outs, refs, rank, what):
    for k, (o, r) in enumerate(zip(outs, refs)):
        assert len(o) == len(r), (rank, what, k)
        for j, (a, b) in enumerate(zip(o, r)):
            assert torch.equal(a, b), (rank, what, k, j, (a - b).abs().max().item())


def scenario_together(rank, world, tmp):
    """2-4 calls of different shapes and step counts, at depth 1 and 2 with resident
    layers: bitwise equal to alone; all calls at once copy one call's bytes (<= 1.5x);
    rounds with random sleeps that differ on every rank stay exact."""
    for depth, resident in ((1, 0), (2, 2)):
        torch.manual_seed(0)
        model = Net()
        reference = copy.deepcopy(model)
        layerwise.configure_layerwise_offload(
            model, ["blocks", "extra"], device="cpu", prefetch_depth=depth, resident_layers=resident,
            debug_copy_delay_us=300, split_fetch=dist.group.WORLD)
        # the bytes of the longest call made alone
        steps = [3, 2, 3]
        xs = [inputs(rank, k, s) for k, s in enumerate(steps)]
        b0 = bytes_copied(model)
        with torch.no_grad():
            for x in xs[0]:
                model(x)
        one = bytes_copied(model) - b0
        refs = [alone(reference, x) for x in xs]
        b0, t0 = bytes_copied(model), turns_of(model)
        outs = layerwise.run_together(model, [make_call(x) for x in xs])
        check(outs, refs, rank, f"together depth {depth}")
        together = bytes_copied(model) - b0
        assert together <= 1.5 * one, (rank, depth, together / one, turns_of(model) - t0)
        same_on_every_rank(turns_of(model))
        # rounds whose calls start and pause at random, differently on every rank
        rnd = random.Random(7 + rank)
        for r in range(4):
            n = rnd.choice([2, 3, 4]) if rank == 0 else None
            n = same_on_every_rank_pick(n)
            steps = [1 + (k + r) % 3 for k in range(n)]
            xs = [inputs(rank, k + 10 * r, s) for k, s in enumerate(steps)]
            refs = [alone(reference, x) for x in xs]
            sleeps = [[rnd.uniform(0, 0.02) for _ in x] for x in xs]
            outs = layerwise.run_together(model, [make_call(x, sl) for x, sl in zip(xs, sleeps)])
            check(outs, refs, rank, f"round {r} depth {depth}")
        same_on_every_rank(turns_of(model))
        # a call alone (no run_together) still streams exactly, with no agreement
        t0 = turns_of(model)
        check([alone(model, xs[0])], [refs[0]], rank, "alone after")
        assert turns_of(model) == t0
        layerwise.remove_layerwise_offload(model)


def same_on_every_rank_pick(v):
    out = [v]
    dist.broadcast_object_list(out, src=0)
    return out[0]


class Mixing(nn.Module):
    """A block that all-reduces its activations over the user's group (a stand-in for
    a sequence-parallel block's all-to-all): calls that computed it in another order
    on another rank would pair another call's tensor, of another shape."""

    def __init__(self, d):
        super().__init__()
        self.a = nn.Linear(d, d)

    def forward(self, x):
        y = self.a(x)
        dist.all_reduce(y)
        return x + y / 4


class MixNet(nn.Module):
    def __init__(self, d=32, n=5):
        super().__init__()
        self.blocks = nn.ModuleList([Mixing(d) for _ in range(n)])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def scenario_collective(rank, world, tmp):
    """Collectives inside the layers pair up call by call: members compute each layer
    in call order on every rank."""
    torch.manual_seed(0)
    model = MixNet()
    reference = copy.deepcopy(model)
    layerwise.configure_layerwise_offload(model, "blocks", device="cpu", debug_copy_delay_us=200,
                                          split_fetch=dist.group.WORLD)
    rnd = random.Random(3 + rank)
    for r in range(3):
        steps = [2, 1, 3]
        xs = [inputs(rank, k + 10 * r, s, d=32) for k, s in enumerate(steps)]
        refs = [alone(reference, x) for x in xs]  # (every rank makes the calls in the same order)
        sleeps = [[rnd.uniform(0, 0.01) for _ in x] for x in xs]
        outs = layerwise.run_together(model, [make_call(x, sl) for x, sl in zip(xs, sleeps)])
        check(outs, refs, rank, f"collective round {r}")
    layerwise.remove_layerwise_offload(model)


class Holder:  # a pipeline of two streamed components
    def __init__(self):
        torch.manual_seed(0)
        self.first = Net()
        self.second = Net(n=4, m=2)

    def __call__(self, x):
        with torch.no_grad():
            return self.second(self.first(x))


def scenario_pipeline(rank, world, tmp):
    """Several calls of a pipeline whose two components stream over one split group:
    calls in different components at once take turns by component."""
    pipe, ref = Holder(), Holder()
    layerwise.offload_pipeline(pipe, device="cpu", split_fetch=dist.group.WORLD, debug_copy_delay_us=200)
    rnd = random.Random(5 + rank)
    for r in range(3):
        xs = [inputs(rank, k + 10 * r, 1)[0] for k in range(3)]
        refs = [ref(x) for x in xs]
        delays = [rnd.uniform(0, 0.01) for _ in xs]

        def call(x, delay):
            def run(p):
                time.sleep(delay)
                return p(x)
            return run

        outs = layerwise.run_together(pipe, [call(x, d) for x, d in zip(xs, delays)])
        for k, (o, rf) in enumerate(zip(outs, refs)):
            assert torch.equal(o, rf), (rank, r, k)
    # calls that keep to one component each: the turns alternate, no call is passed over twice
    xs = [inputs(rank, k, 5) for k in range(3)]
    parts = [pipe.first, pipe.second, pipe.first]
    refs = [alone(getattr(ref, "first" if k != 1 else "second"), x) for k, x in enumerate(xs)]

    def only(k):
        def run(p):
            part = p.first if k != 1 else p.second
            with torch.no_grad():
                return [part(x) for x in xs[k]]
        return run

    outs = layerwise.run_together(pipe, [only(k) for k in range(3)])
    check(outs, refs, rank, "one component each")
    figures = layerwise.managers_of(parts[0])[0].stats()["calls"]
    assert figures["passed_over_max"] <= 1, figures
    same_on_every_rank(figures["turns"])
    layerwise.remove_pipeline_offload(pipe)


def scenario_out_of_lockstep(rank, world, tmp):
    """Ranks that run different calls raise SplitError (at once where the sessions
    differ in size; after the timeout where a call makes one forward more on one rank),
    never compute with mixed weights."""
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    layerwise.configure_layerwise_offload(model, ["blocks", "extra"], device="cpu", split_fetch=dist.group.WORLD)
    xs = [inputs(rank, k, 1) for k in range(3)]
    n = 2 if rank == 0 else 3
    try:
        layerwise.run_together(model, [make_call(x) for x in xs[:n]])
    except split.SplitError as e:
        assert "out of lockstep" in str(e) and "turn" in str(e), str(e)
    else:
        raise AssertionError(f"rank {rank}: sessions of different sizes were not refused")
    # the next calls made in lockstep are exact
    refs = [alone(reference, x) for x in xs]
    outs = layerwise.run_together(model, [make_call(x) for x in xs])
    check(outs, refs, rank, "after the refusal")
    # one forward more on rank 1: its extra forward waits for a turn no other rank agrees to
    extra = xs[1] + xs[1] if rank == 1 else xs[1]
    t0 = time.monotonic()
    try:
        outs = layerwise.run_together(model, [make_call(xs[0]), make_call(extra)])
    except split.SplitError as e:
        assert rank == 1, (rank, str(e))
        assert time.monotonic() - t0 < 30, "the timeout did not end the wait"
    else:
        assert rank == 0, f"rank {rank}: a forward no other rank made was not refused"
        check(outs, [refs[0], refs[1]], rank, "rank 0's calls")
    if rank == 1:  # (a timed-out collective leaves the group unusable: no teardown)
        print(f"rank {rank} ok", flush=True)
        os._exit(0)


def scenario_raises(rank, world, tmp):
    """A call that raises inside a layer on every rank (its second forward) leaves the
    other calls exact and the model streaming in lockstep."""
    import threading

    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    layerwise.configure_layerwise_offload(model, ["blocks", "extra"], device="cpu", debug_copy_delay_us=200,
                                          split_fetch=dist.group.WORLD)
    seen = {}

    def boom(module, args):
        name = threading.current_thread().name
        seen[name] = seen.get(name, 0) + 1
        if name == "layerwise-call-1" and seen[name] == 2:
            raise ValueError("call 1 fails in its second forward")

    handle = model.blocks[2].register_forward_pre_hook(boom)
    xs = [inputs(rank, k, 3) for k in range(3)]
    refs = [alone(reference, x) for x in xs]
    got = batch_that_fails(model, model, xs, "second forward")
    handle.remove()
    check([got[0], got[2]], [refs[0], refs[2]], rank, "the others")
    assert len(got[1]) == 1
    outs = layerwise.run_together(model, [make_call(x) for x in xs])  # in lockstep again: exact
    check(outs, refs, rank, "after the failure")
    layerwise.remove_layerwise_offload(model)


def batch_that_fails(model, forward, xs, words):
    """run_together on `model` of one call per input list of xs, call k appending
    forward(x) for each of its inputs to got[k], as it goes; the batch must raise a
    ValueError naming `words`. Returns got: what each call computed before the end."""
    got = [[] for _ in xs]

    def call(k):
        def run(m):
            with torch.no_grad():
                for x in xs[k]:
                    got[k].append(forward(x))
        return run

    try:
        layerwise.run_together(model, [call(k) for k in range(len(xs))])
        raise AssertionError("the failure was not raised")
    except ValueError as e:
        assert words in str(e), str(e)
    return got


def scenario_sigint(rank, world, tmp):
    """A real SIGINT on rank 0 only, during run_together: rank 0 raises
    KeyboardInterrupt and rank 1 a RuntimeError naming rank 0, both at the same turn
    (no collective is left unpaired); the next run_together is exact on both."""
    import signal
    import threading

    from layerwise.runtime import cohort

    signal.signal(signal.SIGINT, signal.default_int_handler)
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    layerwise.configure_layerwise_offload(model, ["blocks", "extra"], device="cpu", debug_copy_delay_us=200,
                                          split_fetch=dist.group.WORLD)
    xs = [inputs(rank, k, 6) for k in range(3)]
    refs = [alone(reference, x) for x in xs]

    def call(k):
        def run(m):
            outs = []
            with torch.no_grad():
                for j, x in enumerate(xs[k]):
                    if rank == 0 and k == 1 and j == 1:
                        os.kill(os.getpid(), signal.SIGINT)
                        # (until the main thread took the signal and cancelled this call: then
                        # the next agreement carries it, whatever the machine's load)
                        me = threading.get_ident()
                        limit = time.monotonic() + 60
                        while me not in cohort.CANCELLED and time.monotonic() < limit:
                            time.sleep(0.01)
                    outs.append(m(x))
            return outs
        return run

    try:
        layerwise.run_together(model, [call(k) for k in range(3)])
        raise AssertionError(f"rank {rank}: the calls were not stopped")
    except KeyboardInterrupt:
        assert rank == 0
    except RuntimeError as e:
        assert rank == 1 and "cancelled by Ctrl-C on rank 0" in str(e), (rank, str(e))
    dist.barrier()
    outs = layerwise.run_together(model, [make_call(x[:2]) for x in xs])
    check(outs, [r[:2] for r in refs], rank, "after the interrupt")
    layerwise.remove_layerwise_offload(model)


def scenario_tiers(rank, world, tmp):
    """Compression and the disk tier (every streamed layer spilled) under split fetch
    and run_together: bitwise, and one call's bytes read from disk for all the calls."""
    spill = os.path.join(tmp, f"spill-{rank}")
    os.makedirs(spill, exist_ok=True)
    kw = dict(device="cpu", prefetch_depth=1, split_fetch=dist.group.WORLD, compress="lossless",
              disk_prefetch_depth=1, debug_copy_delay_us=100)
    local = {k: v for k, v in kw.items() if k != "split_fetch"}
    budget = smallest_budget(lambda b: configure_spilled(spill, b, **local))
    model = configure_spilled(spill, budget, **kw)
    reference = NET16.build()
    m0 = layerwise.managers_of(model)[0]
    assert any(r.startswith("spill, encoded, share") for r in m0.stats()["tier_plan"]), m0.stats()["tier_plan"]

    def xs_of(k, steps):
        g = torch.Generator().manual_seed(1000 * rank + k)
        return [torch.randn(2 + k, 128, generator=g).to(torch.bfloat16) for _ in range(steps)]

    def read(model):
        return sum(m.stats()["disk"]["bytes_read"] for m in layerwise.managers_of(model))

    xs = [xs_of(k, 2) for k in range(3)]
    refs = [alone(reference, x) for x in xs]
    r0 = read(model)
    alone(model, xs[0])
    one = read(model) - r0
    assert one > 0, "the calls do not read from disk"
    r0 = read(model)
    outs = layerwise.run_together(model, [make_call(x) for x in xs])
    check(outs, refs, rank, "tiers")
    assert read(model) - r0 <= 1.5 * one, (rank, (read(model) - r0) / one)
    layerwise.remove_layerwise_offload(model)


SCENARIOS = {"tiers": scenario_tiers, "raises": scenario_raises, "sigint": scenario_sigint, "together": scenario_together, "collective": scenario_collective, "pipeline": scenario_pipeline,
             "out_of_lockstep": scenario_out_of_lockstep}


def main(scenarios, short_timeout=()):
    """Run the scenario named on the command line (RANK WORLD PORT TMPDIR SCENARIO)
    on this gloo rank; the collective timeout is 3 s for the scenarios that wait for
    it on purpose, 60 s (a loaded machine) elsewhere."""
    rank, world, port, tmp, scenario = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    timeout_s = "3" if scenario in short_timeout else "60"
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LAYERWISE_COLLECTIVE_TIMEOUT_S=timeout_s)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    t0 = time.perf_counter()
    scenarios[scenario](rank, world, tmp)
    print(f"rank {rank} ok ({time.perf_counter() - t0:.1f} s)", flush=True)
    os._exit(0)


if __name__ == "__main__":
    main(SCENARIOS, short_timeout=("out_of_lockstep",))
