"""Faults while calls of one streamed model share each layer's fetch
(runtime/cohort.py, layerwise.run_together): an exception or a real SIGINT in one
call, a thread that dies or stops between layers, a load_state_dict, removal,
set_residency, state_dict or tune on another thread, nested block calls. Every
other call stays bitwise equal to the same call alone, nothing hangs (a hang
fails with every thread's traceback), and the next call is exact. CPU backend."""
import copy
import faulthandler
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

import layerwise
from layerwise.configure import managers_of
from layerwise.runtime import cohort

from helpers.contract import make, nested_model

GROUPS = ["transformer_blocks", "single_transformer_blocks"]
D = 32
HANG_S = 60  # a thread still running after this long is a hang (a busy 2-core machine takes ~1 s)


# ----------------------------------------------------------------- helpers
def configured(seed=0, depth=1, delay=200, **kw):
    model = make(seed)
    ref = copy.deepcopy(model)
    layerwise.configure_layerwise_offload(model, GROUPS, device="cpu", prefetch_depth=depth,
                                          debug_copy_delay_us=delay, **kw)
    return model, ref


def shapes(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1 + k % 3, D, generator=g) for k in range(n)]


def alone(model, xs):
    with torch.no_grad():
        return [model(x) for x in xs]


def dump_and_fail(what):
    faulthandler.dump_traceback(file=sys.__stderr__, all_threads=True)
    pytest.fail(f"hang: {what} still running after {HANG_S} s (tracebacks on stderr)")


def run_threads(fns, timeout=HANG_S):
    """Run each fn on its own thread; the exceptions they raised (a hang fails the test)."""
    errors = []
    join(start_threads(fns, errors), timeout)
    return errors


def start_threads(fns, errors):
    def wrap(fn):
        def body():
            try:
                with torch.no_grad():
                    fn()
            except BaseException as err:  # noqa: BLE001 - reported to the test
                errors.append(err)
        return body

    threads = [threading.Thread(target=wrap(fn), daemon=True) for fn in fns]
    for t in threads:
        t.start()
    return threads


def join(threads, timeout=HANG_S):
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):
        dump_and_fail([t.name for t in threads if t.is_alive()])


def loop_calls(model, xs, expect, n, wrong, stop=None):
    """A thread's calls: n of them (or until `stop`), each output checked."""
    def fn():
        for k in range(n):
            if stop is not None and stop.is_set():
                return
            out = model(xs[k % len(xs)])
            if not torch.equal(out, expect[k % len(xs)]):
                wrong.append((threading.get_ident(), k))
    return fn


def blocks_of(model):
    return list(model.transformer_blocks) + list(model.single_transformer_blocks)


# ------------------------------------------------------- exceptions in a call
class Boom(Exception):
    pass


def test_an_exception_inside_one_calls_block_leaves_the_others_and_the_next_call_exact():
    model, ref = configured()
    xs = shapes(3)
    expect = alone(ref, xs)
    victim, rng, raised = {}, random.Random(0), [0]
    bar = threading.Barrier(3, timeout=HANG_S)
    model.transformer_blocks[0].register_forward_pre_hook(lambda m, a: (bar.wait(), None)[1], prepend=True)

    def maybe_raise(mod, *args):
        if threading.get_ident() == victim.get("ident") and victim.get("at") is mod:
            raise Boom(f"injected in {victim['where']}")

    for blk in blocks_of(model):
        blk.register_forward_pre_hook(maybe_raise)  # (after layerwise's: inside the layer)
        blk.register_forward_hook(maybe_raise)
    wrong = []

    def victim_calls():
        victim["ident"] = threading.get_ident()
        for k in range(12):
            if k % 2 == 0:  # a call that raises at a random layer, before or after its compute
                victim["at"] = rng.choice(blocks_of(model))
                victim["where"] = rng.choice(["pre", "post"])
                try:
                    model(xs[k % 3])
                except Boom:
                    raised[0] += 1
                victim["at"] = None
            else:  # its next call: exact
                if not torch.equal(model(xs[k % 3]), expect[k % 3]):
                    wrong.append(("victim", k))

    errors = run_threads([victim_calls, loop_calls(model, xs, expect, 12, wrong),
                          loop_calls(model, xs[::-1], expect[::-1], 12, wrong)])
    assert not errors and not wrong and raised[0] == 6, (errors, wrong)
    bar = threading.Barrier(1)
    assert all(torch.equal(a, b) for a, b in zip(alone(model, xs), expect))


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # (it dies of it)
def test_an_exception_in_the_models_own_code_between_two_layers_leaves_the_others_exact():
    """The model's forward raises between two blocks (the user's code; no layer is
    inside a hook then), and the thread then dies of it."""
    model, ref = configured()
    xs = shapes(3)
    expect = alone(ref, xs)
    wrong = []

    def order():
        yield 0
        yield 1
        raise Boom("between layers 1 and 2")

    def dies():
        for k in range(4):
            if not torch.equal(model(xs[k % 3]), expect[k % 3]):
                wrong.append(("dies", k))
            try:
                model(xs[k % 3], order_a=order())
            except Boom:
                pass
        model(xs[0], order_a=order())  # escapes: the thread ends with it

    errors = run_threads([dies, loop_calls(model, xs, expect, 15, wrong), loop_calls(model, xs, expect, 15, wrong)])
    assert [type(e) for e in errors] == [Boom] and not wrong, (errors, wrong)
    assert all(torch.equal(a, b) for a, b in zip(alone(model, xs), expect))


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # (it dies of it)
def test_a_thread_that_dies_inside_a_layer_does_not_block_the_other_calls():
    """A KeyboardInterrupt raised inside a layer of a worker thread: torch runs no
    post-hook for it (the model's lock and the call's place stay behind), and the
    thread ends. The others take the lock over and go on, exact."""
    model, ref = configured()
    xs = shapes(3)
    expect = alone(ref, xs)
    dying = {}

    def kill(mod, args):
        if threading.get_ident() == dying.get("ident"):
            raise KeyboardInterrupt("the thread dies here")

    model.transformer_blocks[2].register_forward_pre_hook(kill)
    wrong = []

    def dies():
        dying["ident"] = threading.get_ident()
        model(xs[0])

    def lives_on():  # the same, caught: the thread then sits in its own code
        dying["ident"] = threading.get_ident()
        try:
            model(xs[1])
        except KeyboardInterrupt:
            pass
        time.sleep(2 * 1.0)  # (longer than Cohort.CHECK_S: found gone while it sleeps)

    for victim in (dies, lives_on):
        errors = run_threads([victim, loop_calls(model, xs, expect, 15, wrong),
                              loop_calls(model, xs[::-1], expect[::-1], 15, wrong)])
        assert all(isinstance(e, KeyboardInterrupt) for e in errors) and not wrong, (errors, wrong)
    dying.clear()
    assert all(torch.equal(a, b) for a, b in zip(alone(model, xs), expect))


def test_a_call_stopped_between_two_layers_does_not_block_the_others():
    """A call stays in its own code between two layers (it waits on something of
    its own): the others finish meanwhile, and it ends exact when it goes on."""
    model, ref = configured()
    xs = shapes(3)
    expect = alone(ref, xs)
    go, paused, wrong, got = threading.Event(), threading.Event(), [], []

    def order():
        yield 0
        yield 1
        paused.set()
        go.wait(HANG_S)  # until the other calls have all ended
        yield from range(2, 5)

    def stopped():
        got.append(model(xs[0], order_a=order()))

    def others():
        assert paused.wait(HANG_S)
        loop_calls(model, xs, expect, 10, wrong)()

    t = threading.Thread(target=lambda: (torch.set_grad_enabled(False), stopped()), daemon=True)
    t.start()
    errors = run_threads([others, others])
    go.set()
    join([t])
    assert not errors and not wrong, (errors, wrong)
    assert torch.equal(got[0], expect[0])


# ------------------------------------------------------------- real SIGINTs
SIGINT_SCRIPT = textwrap.dedent(r"""
    import copy, faulthandler, os, random, signal, sys, threading, time
    import torch
    sys.path.insert(0, {tests!r})
    torch.set_num_threads(1)
    import layerwise
    from helpers.contract import make
    faulthandler.dump_traceback_later({cap}, exit=True)  # a hang: every thread's traceback, exit 1
    GROUPS = ["transformer_blocks", "single_transformer_blocks"]
    mode, attempts, rng = sys.argv[1], int(sys.argv[2]), random.Random(int(sys.argv[3]))
    torch.manual_seed(0)
    model = make()
    ref = copy.deepcopy(model)
    layerwise.configure_layerwise_offload(model, GROUPS, device="cpu", prefetch_depth=1, debug_copy_delay_us=300)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(1 + k % 3, 32, generator=g) for k in range(4)]
    with torch.no_grad():
        expect = [ref(x) for x in xs]
    bad = []

    def check(k, what):
        with torch.no_grad():
            if not torch.equal(model(xs[k % 4]), expect[k % 4]):
                bad.append((what, k))

    def sigint_within(span):
        t = threading.Timer(rng.uniform(0, span), os.kill, (os.getpid(), signal.SIGINT))
        t.daemon = True
        t.start()
        return t

    def settle(timer):  # the timer's SIGINT sent and handled (it may land here)
        while True:
            try:
                timer.join()
                time.sleep(0.01)
                return
            except KeyboardInterrupt:
                pass

    def again(fn):  # (a SIGINT still pending lands in the first try: another interrupted call)
        while True:
            try:
                return fn()
            except KeyboardInterrupt:
                pass

    def timed(fn):
        t0 = time.perf_counter(); fn(); return time.perf_counter() - t0

    if mode == "forward":  # the main thread's calls interrupted while workers run theirs
        stop = threading.Event()

        def worker(w):
            try:
                with torch.no_grad():
                    k = w
                    while not stop.is_set():
                        if not torch.equal(model(xs[k % 4]), expect[k % 4]):
                            bad.append(("worker", w, k))
                        k += 1
            except BaseException as err:
                bad.append(("worker raised", w, repr(err)))

        workers = [threading.Thread(target=worker, args=(w,), daemon=True) for w in range(2)]
        for w in workers:
            w.start()
        span = max(timed(lambda: check(0, "warm")) for _ in range(3))
        for k in range(attempts):
            try:
                timer = sigint_within(span)
                with torch.no_grad():
                    model(xs[k % 4])
            except KeyboardInterrupt:
                pass
            settle(timer)
            again(lambda: check(k + 1, "the main thread's next call"))
        stop.set()
        for w in workers:
            w.join(60)
        if any(w.is_alive() for w in workers):
            faulthandler.dump_traceback(all_threads=True)
            bad.append("workers hang")
    else:  # run_together interrupted
        def calls(k):
            return [(lambda m, x=xs[(k + j) % 4]: [m(x) for _ in range(3)]) for j in range(3)]

        span = max(timed(lambda: layerwise.run_together(model, calls(0))) for _ in range(2))
        for k in range(attempts):
            try:
                timer = sigint_within(span)
                with torch.no_grad():
                    out = layerwise.run_together(model, calls(k))
                for j, o in enumerate(out):
                    if not all(torch.equal(a, expect[(k + j) % 4]) for a in o):
                        bad.append(("run_together", k, j))
            except KeyboardInterrupt:
                import traceback
                left = [t.name for t in threading.enumerate() if t.name.startswith("layerwise-call")]
                if left:
                    bad.append(("calls still running after KeyboardInterrupt", k, left, traceback.format_exc()))
            settle(timer)
            again(lambda: check(k, "after run_together"))
    print("RESULT", len(bad), bad, flush=True)
""")


@pytest.mark.parametrize("mode", ["forward", "run_together"])
def test_real_sigints_leave_every_call_exact_and_nothing_hangs(mode, tmp_path):
    script = tmp_path / "sigint.py"
    script.write_text(SIGINT_SCRIPT.format(tests=os.path.dirname(os.path.dirname(__file__)), cap=HANG_S * 2))
    proc = subprocess.run([sys.executable, str(script), mode, "12", "3"], capture_output=True, text=True,
                          timeout=HANG_S * 3)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")][-1]
    assert line.split()[1] == "0", proc.stdout[-3000:]


def _sigint_when(event):
    """A real SIGINT once `event` is set (from a timer thread), to the main thread:
    it interrupts the wait the main thread is in, as Ctrl-C at a terminal does."""
    main = threading.main_thread().ident

    def send():
        if event.wait(HANG_S):
            signal.pthread_kill(main, signal.SIGINT)
    t = threading.Thread(target=send, daemon=True)
    t.start()
    return t


def test_ctrl_c_in_run_together_returns_only_once_every_call_has_stopped():
    model, ref = configured()
    xs = shapes(3)
    expect = alone(ref, xs)
    running, ended, outs = threading.Event(), [threading.Event() for _ in range(3)], [[] for _ in range(3)]

    def call(j):
        def fn(m):
            try:
                for k in range(10_000):  # until cancelled: it stops at its next streamed layer
                    outs[j].append(torch.equal(m(xs[j]), expect[j]))
                    if k == 2 and j == 0:
                        running.set()
            finally:
                if j == 0:  # (the caller waits on this call's thread when the SIGINT comes: it ends last)
                    ended[1].wait(HANG_S), ended[2].wait(HANG_S), time.sleep(0.2)
                ended[j].set()
        return fn

    sender = _sigint_when(running)
    with torch.no_grad(), pytest.raises(KeyboardInterrupt):
        layerwise.run_together(model, [call(j) for j in range(3)])
    assert [e.is_set() for e in ended] == [True] * 3  # (returned before a call stopped: it would go on unseen)
    join([sender])
    assert all(all(o) for o in outs) and len(outs[0]) < 10_000
    assert all(torch.equal(a, b) for a, b in zip(alone(model, xs), expect))


def test_a_second_ctrl_c_in_run_together_leaves_the_calls_cancelled(monkeypatch):
    """The caller gives up waiting (a second Ctrl-C): the calls still stop at their
    next streamed layer instead of running on unseen."""
    model, ref = configured()
    xs = shapes(2)
    expect = alone(ref, xs)
    first, second, go = threading.Event(), threading.Event(), threading.Event()
    ran_after, ended = [0, 0], [threading.Event(), threading.Event()]

    def call(j):
        def fn(m):
            try:
                m(xs[j])
                if j == 0:
                    first.set()  # -> the first SIGINT: the calls are cancelled
                go.wait(HANG_S)  # (its own code: no layer until after the second SIGINT)
                for _ in range(3):
                    m(xs[j])
                    ran_after[j] += 1
            finally:
                ended[j].set()
        return fn

    s1 = _sigint_when(first)
    real = cohort.cancel

    def cancel_then_second(*args):
        real(*args)
        second.set()

    s2 = _sigint_when(second)
    monkeypatch.setattr(cohort, "cancel", cancel_then_second)
    with torch.no_grad(), pytest.raises(KeyboardInterrupt):
        layerwise.run_together(model, [call(j) for j in range(2)])
    monkeypatch.undo()
    go.set()
    for e in ended:
        assert e.wait(HANG_S) or dump_and_fail("a call")
    join([s1, s2])
    assert ran_after == [0, 0]
    assert all(torch.equal(a, b) for a, b in zip(alone(model, xs), expect))


# ------------------------------------------- operations while calls run
def _calls_until(model, xs, expect_of, stop, wrong, counts, w):
    """A thread's calls until `stop`; expect_of(k, out) says whether out is right."""
    def fn():
        k = w
        while not stop.is_set():
            out = model(xs[k % len(xs)])
            if not expect_of(k % len(xs), out):
                wrong.append((w, k))
            counts[w] += 1
            k += 1
    return fn


def _while_calls_run(model, xs, expect_of, op, rounds, threads=3):
    """op(r) for r in range(rounds) on this thread while `threads` threads call the
    model; each round waits until every thread has made a call since the last."""
    stop, wrong, counts, errors = threading.Event(), [], [0] * threads, []
    workers = start_threads([_calls_until(model, xs, expect_of, stop, wrong, counts, w) for w in range(threads)],
                            errors)
    try:
        for r in range(rounds):
            seen = list(counts)
            deadline = time.monotonic() + HANG_S
            while any(c == s for c, s in zip(counts, seen)) and all(t.is_alive() for t in workers):
                if time.monotonic() > deadline:
                    dump_and_fail("a call")
                time.sleep(0.005)
            op(r)
    finally:
        stop.set()
        join(workers)
    assert not errors and not wrong, (errors, wrong)


def test_load_state_dict_of_one_layer_while_calls_run_is_seen_whole_by_calls_after_it():
    model, ref = configured()
    xs = shapes(3)
    new = copy.deepcopy(ref)
    torch.manual_seed(9)
    with torch.no_grad():
        for p in new.transformer_blocks[2].parameters():  # every tensor of the layer: half a load would show
            p.copy_(torch.randn_like(p.float()).to(p.dtype))
    states = [{k: v.clone() for k, v in m.transformer_blocks[2].state_dict().items()} for m in (ref, new)]
    outs = [alone(ref, xs), alone(new, xs)]
    started, finished = [0], [0]  # loads begun, loads returned
    wrong = []

    def call_checked(w):
        def fn():
            for k in range(40):
                v0 = finished[0]
                out = model(xs[k % 3])
                v1 = started[0]
                if not any(torch.equal(out, outs[v % 2][k % 3]) for v in range(v0, v1 + 1)):
                    wrong.append((w, k, v0, v1))
        return fn

    def loads():
        for r in range(30):
            started[0] += 1
            model.transformer_blocks[2].load_state_dict(states[(r + 1) % 2])
            finished[0] += 1
            time.sleep(0.002)

    errors = run_threads([loads] + [call_checked(w) for w in range(3)])
    assert not errors and not wrong, (errors, wrong)
    assert torch.equal(alone(model, xs)[0], outs[started[0] % 2][0])


def test_removal_while_calls_run_on_several_threads_is_exact():
    """The removal waits for the calls in flight; the calls after it run on the plain
    model. (A configure while calls run is not one: the plain model has no guard.)"""
    model, ref = configured(delay=100)
    xs = shapes(3)
    expect = alone(ref, xs)
    removed = [0]

    def remove(r):
        if r == 1:  # (round 0 waits for a call of every thread)
            layerwise.remove_layerwise_offload(model)
            removed[0] += 1

    for depth in (1, 2):
        _while_calls_run(model, xs, lambda k, out: torch.equal(out, expect[k]), remove, 3)
        layerwise.configure_layerwise_offload(model, GROUPS, device="cpu", prefetch_depth=depth,
                                              debug_copy_delay_us=100)
    assert removed[0] == 2


def test_set_residency_while_calls_run_is_exact():
    model, ref = configured()
    xs = shapes(3)
    expect = alone(ref, xs)
    rng = random.Random(2)

    def change(r):
        for m in managers_of(model):
            m.set_residency(sorted(rng.sample(range(m.num_layers), rng.randint(0, m.num_layers - 1))),
                            rng.randint(0, 2))

    _while_calls_run(model, xs, lambda k, out: torch.equal(out, expect[k]), change, 12)


def test_state_dict_while_calls_run_gives_the_true_weights():
    model, ref = configured()
    xs = shapes(3)
    expect = alone(ref, xs)
    true = ref.state_dict()

    def read(r):
        sd = model.state_dict()
        assert set(sd) == set(true) and all(torch.equal(sd[k], v) for k, v in true.items())

    _while_calls_run(model, xs, lambda k, out: torch.equal(out, expect[k]), read, 10)


def test_tune_while_calls_run_on_other_threads_is_exact():
    model, ref = configured()
    xs = shapes(3)
    expect = alone(ref, xs)
    plans = []

    def tune(r):
        with torch.no_grad():
            plans.append(layerwise.tune(model, lambda m: m(xs[0]), depths=(1, 2), repeats=1))

    _while_calls_run(model, xs, lambda k, out: torch.equal(out, expect[k]), tune, 2)
    assert len(plans) == 2
    assert all(torch.equal(a, b) for a, b in zip(alone(model, xs), expect))


# ------------------------------------------------------------ nested calls
def test_nested_block_calls_under_concurrent_calls_are_exact():
    model = nested_model([(0, 1), (3, 4)])
    xs = [torch.randn(1 + k, 16) for k in range(3)]
    with torch.no_grad():
        expect = [model(x) for x in xs]
    layerwise.configure_layerwise_offload(model, "blocks", device="cpu", prefetch_depth=1, debug_copy_delay_us=200)
    bar = threading.Barrier(3, timeout=HANG_S)
    model.blocks[0].register_forward_pre_hook(lambda m, a: (bar.wait(), None)[1], prepend=True)
    wrong = []
    errors = run_threads([loop_calls(model, xs[j:] + xs[:j], expect[j:] + expect[:j], 10, wrong) for j in range(3)])
    assert not errors and not wrong, (errors, wrong)
    assert managers_of(model)[0].stats()["calls"]["calls_max"] == 3


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # (it dies of it)
def test_a_call_abandoned_inside_a_layer_stops_ranking_in_the_schedule():
    """A thread's forward left inside a layer by a KeyboardInterrupt (no post-hook
    ran) stays on record as computing; the call still under way must not keep
    putting off its fetches for it (each by Cohort.AGE_S) until the end of its
    forward: it is dropped at the first look at the schedule."""
    model, ref = configured()
    x = shapes(1)[0]
    expect = alone(ref, [x])[0]
    bar = threading.Barrier(2, timeout=HANG_S)
    model.transformer_blocks[0].register_forward_pre_hook(lambda m, a: (bar.wait(), None)[1], prepend=True)
    victim = threading.Thread(target=lambda: (torch.set_grad_enabled(False), model(x)), name="victim", daemon=True)

    def kill(mod, args):
        if threading.current_thread() is victim:
            raise KeyboardInterrupt("the thread dies inside layer 2")

    model.transformer_blocks[2].register_forward_pre_hook(kill)
    # (the other call reaches layer 4 once the victim has died: prepended, it holds nothing meanwhile)
    model.transformer_blocks[4].register_forward_pre_hook(
        lambda m, a: None if threading.current_thread() is victim else victim.join(HANG_S), prepend=True)
    got = []
    other = threading.Thread(target=lambda: (torch.set_grad_enabled(False), got.append(model(x))), daemon=True)
    victim.start()
    other.start()
    join([victim, other])
    assert torch.equal(got[0], expect)
    calls = managers_of(model)[0].stats()["calls"]
    assert (calls["calls_now"], calls["dropped"]) == (0, 1), calls
