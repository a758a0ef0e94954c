"""run_together: a server's batch of calls of one streamed model or pipeline, run
at once on threads so that they share each layer's fetch (docs/cohort.md)."""
from __future__ import annotations

import copy
import inspect
import threading
import time

import torch
from torch import nn

from layerwise import contract, lifecycle, pipelines
from layerwise.runtime import cohort, turns

_CANCELLED = "layerwise.run_together: cancelled by Ctrl-C"


def _takes_target(fn) -> bool:
    """`fn` takes one positional argument (the model or pipeline); False: none.
    Optional parameters only (`lambda x=x: model(x)`, the usual way to bind a loop
    variable) take none: the target passed there would replace what they bound."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # (a builtin without a signature: called with the target)
        return True
    params = [p for p in sig.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in params if p.default is p.empty]
    var = any(p.kind is p.VAR_POSITIONAL for p in sig.parameters.values())
    keyword_only = [p.name for p in sig.parameters.values() if p.kind is p.KEYWORD_ONLY and p.default is p.empty]
    if keyword_only:
        raise ValueError(f"layerwise.run_together: each call is called with the model or pipeline as its one "
                         f"positional argument (or with none); {getattr(fn, '__name__', fn)!r} requires the "
                         f"keyword argument(s) {keyword_only}: bind them (functools.partial, or a default)")
    if len(required) > 1:
        raise ValueError(f"layerwise.run_together: each call takes at most one argument (the model or pipeline), "
                         f"{getattr(fn, '__name__', fn)!r} requires {len(required)}")
    return bool(required) or var


def call_view(pipe):
    """A pipeline for one call: the pipeline's attributes (its streamed components
    among them, shared), with a scheduler of its own. A diffusers pipeline's
    __call__ sets per-call state on the pipeline (`_guidance_scale`,
    `_num_timesteps`, `_current_timestep`...) and steps its scheduler: two calls on
    one object would change each other's."""
    view = copy.copy(pipe)
    scheduler = getattr(pipe, "scheduler", None)
    if scheduler is not None and not isinstance(scheduler, nn.Module):
        object.__setattr__(view, "scheduler", copy.deepcopy(scheduler))  # (diffusers' __setattr__ writes its config)
    return view


def run_together(model_or_pipe, calls) -> list:
    """Run `calls` at once, each on its own thread, and return their results in
    order. Streamed layers are fetched once for all the calls that need them at
    the same time (a model's threads share fetches by default: this is the
    convenience for a server's batch loop).

    model_or_pipe: an offloaded model (configure_layerwise_offload,
        load_offloaded) or an offloaded pipeline (offload_pipeline).
    calls: callables. Each takes the model or pipeline as its one argument
        (`lambda m: m(x)`, `lambda p: p(prompt, height=h)`); for a pipeline each
        call gets a view of its own (call_view: the same components, its own
        scheduler and per-call attributes). A model's call may take none.

    If a call raises, the others still run to their end; then the failure that
    came first is raised (where more than one failed, with a note naming
    them). Ctrl-C
    stops every call at its next streamed layer (each raises inside its forward,
    so the model stays exact), waits for them, and raises KeyboardInterrupt (a
    second Ctrl-C raises it at once; the calls still stop at their next layer)."""
    is_pipe = not isinstance(model_or_pipe, nn.Module)
    # torch.compile(model) wraps the model: its hooks, groups and turns are the wrapped
    # model's; the calls get the compiled module they were given.
    inner = None if is_pipe else getattr(model_or_pipe, "_orig_mod", None)
    model = inner if isinstance(inner, nn.Module) and not lifecycle.is_offloaded(model_or_pipe) else model_or_pipe
    if is_pipe:
        if not pipelines.is_offloaded_pipeline(model_or_pipe):
            raise ValueError("layerwise.run_together takes an offloaded model or pipeline; "
                             f"{type(model_or_pipe).__name__} is not offloaded: call "
                             "layerwise.offload_pipeline(pipe) (or configure_layerwise_offload(model, ...)) first")
    elif not lifecycle.is_offloaded(model):
        raise ValueError(f"layerwise.run_together takes an offloaded model or pipeline; this "
                         f"{type(model_or_pipe).__name__} is not offloaded: call "
                         "layerwise.configure_layerwise_offload(model, ...) first (or, if a model holding it was "
                         "configured, pass that model: its forward is what the calls share)")
    if callable(calls) or not hasattr(calls, "__iter__") or isinstance(calls, (str, bytes, dict, torch.Tensor)):
        raise TypeError("layerwise.run_together(model_or_pipe, calls): `calls` is a list of callables, each "
                        f"taking the model or pipeline (lambda m: m(x)); got {type(calls).__name__}")
    calls = list(calls)
    bad = [k for k, fn in enumerate(calls) if not callable(fn) or fn is model_or_pipe]
    if bad:
        raise TypeError(f"layerwise.run_together: calls {bad} are not callables that take the model or pipeline: "
                        "pass a list like [lambda m: m(x1), lambda m: m(x2)]")
    takes = [_takes_target(fn) for fn in calls]
    if is_pipe and not all(takes):
        raise ValueError("layerwise.run_together: with a pipeline, each call takes the pipeline as its argument "
                         "(lambda p: p(...)), so that it runs on a view of its own (its own scheduler and "
                         "per-call state); calls " + str([k for k, t in enumerate(takes) if not t]) + " take none")

    # On split-fetch models the calls take turns that every rank agrees on (runtime/turns.py).
    models = [m for _, m in pipelines.streamed_components(model_or_pipe)] if is_pipe else [model]
    session = turns.open_session(len(calls)) if any(turns.TURNS in m.__dict__ for m in models) else None
    try:
        return _run(model_or_pipe, calls, takes, is_pipe, session)
    finally:
        if session is not None:
            turns.close_session(session)


def _run(model_or_pipe, calls: list, takes: list, is_pipe: bool, session) -> list:
    results: list = [None] * len(calls)
    failures: list = []  # (time, index, exception)
    done = [threading.Event() for _ in calls]
    mu = threading.Lock()  # (running and stopping change together)
    running: dict[int, int] = {}  # call index -> its thread's ident, while the call runs
    stopping: list = []  # non-empty once Ctrl-C cancelled the calls

    # Every call begins once every thread is up. Started one by one, the calls would
    # begin up to milliseconds apart (each start needs the GIL, which the calls already
    # started hold between their ops); a call that begins after the others passed its
    # first layers fetches them again, and the others wait for it (the schedule serves
    # the call behind first).
    go = threading.Event()
    # A new thread computes with torch's default number of intra-op threads, not the
    # caller's torch.set_num_threads: a matmul split another way sums in another order,
    # and a call would differ in its last bits from the same call made by the caller.
    intra_op = torch.get_num_threads()

    def run(k: int) -> None:
        me = threading.get_ident()
        if session is not None:
            session.enlist(k)
        go.wait()
        try:
            with mu:
                if stopping:  # (cancelled before it began)
                    raise RuntimeError(_CANCELLED)
                running[k] = me
            torch.set_num_threads(intra_op)
            fn = calls[k]
            if not takes[k]:
                results[k] = fn()
            else:
                results[k] = fn(call_view(model_or_pipe) if is_pipe else model_or_pipe)
        except BaseException as err:  # noqa: BLE001 - reported to the caller
            failures.append((time.monotonic(), k, err))
        finally:
            # The thread takes its own cancellation back as it ends: its ident may be
            # reused by a thread that is none of these calls.
            with mu:
                running.pop(k, None)
                cohort.uncancel([me])
            if session is not None:
                session.discharge(k)
            done[k].set()

    threads = [threading.Thread(target=run, args=(k,), name=f"layerwise-call-{k}", daemon=True)
               for k in range(len(calls))]
    interrupted = False
    try:
        try:
            with contract.defer_interrupts():  # (a Ctrl-C meanwhile comes after: every call started is cancelled)
                for t in threads:
                    t.start()
        finally:
            go.set()  # (also where a start failed: the calls started must not wait for ever)
        _wait_all(done)
    except KeyboardInterrupt:
        interrupted = True
        with contract.defer_interrupts(), mu:
            stopping.append(True)
            cohort.cancel(running.values(), _CANCELLED)
        # A second Ctrl-C stops this wait only: the calls stay cancelled, and stop at their next layer.
        _wait_all(done)
    if interrupted:
        raise KeyboardInterrupt
    if failures:
        failures.sort(key=lambda f: f[0])
        _, k, err = failures[0]
        if len(failures) > 1:
            err.add_note(f"layerwise.run_together: call {k} failed first; calls "
                         f"{sorted(j for _, j, _ in failures)} failed")
        raise err
    return results


def _wait_all(done) -> None:
    """Wait until every call has ended, in short waits (Ctrl-C reaches the caller
    between them). On the calls' own events, not Thread.join: a KeyboardInterrupt
    inside Thread.join can mark a running thread as stopped (CPython 3.11's
    _wait_for_tstate_lock), and the caller would then return while it runs."""
    for d in done:
        while not d.wait(0.1):
            pass
