"""tune: each group's placement (resident layers, prefetch depth) chosen from
measurement, applied in place, and checked.

    plan = layerwise.tune(model, lambda m: m(x), device_budget=8 << 30)
    print(plan)            # per group: resident layers, depth; predicted, measured, floor

`run(model)` performs one representative step (a forward, a denoise step, a
pipeline call). `tune`

1. runs it with a probe on (`Probe`): per layer call, the compute between the
   pre- and post-hook, the hooks' own cost and the model's code between calls
   (host clock on the CPU backend, CUDA events on the compute stream); per
   fetch, its time on the bus (the copy engine's events, Meter.listen);
2. predicts the step time of candidate placements with the pipeline model of
   layerwise.planning.cost_model: the placement in force, the fixed `leading` and
   `strided` policies at the largest share that fits, and a greedy choice that
   makes resident the layers whose transfer is least hidden (by gain, and by gain
   per device byte), each at the prefetch depths asked;
3. applies the fastest that fits the device budget (counted as `device_budget`
   counts at configure: non-layer weights + rings + resident layers + the routed
   experts' caches, whose size set_residency does not change) and, on a CPU device
   (whose memory is the host's), the host budget in force, with
   LayerwiseOffloadManager.set_residency: the ring changes, the host side does
   not (the host and pin budgets stay as planned);
4. measures the step again and returns a `TunePlan`. The prediction must hold:
   measured within 10% of predicted, or the plan says why not (`TunePlan.note`).

Another thread may serve the model meanwhile: the probe records the calls of
the thread that called tune only (its layers wait for the other thread's, which
the measured times then include), and each placement change waits for a layer
in flight on another thread (set_residency).

Interrupt-safe: the probe is removed and every group keeps its old placement
unless every group's new one was applied (a group that fails puts the others
back); a failure or an interrupt while the new placement is measured puts every
group's old one back (a tune that raises changes nothing). `apply=False` chooses and predicts only.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import numbers
import statistics
import threading
import time

import torch

from layerwise import contract
from layerwise.configure import managers_of
from layerwise.contract import compile_guard
from layerwise.options import validate_bytes, validate_count
from layerwise.planning import cost_model as pm
from layerwise.planning.device_budget import fmt_bytes, non_layer_bytes, resolve_budget
from layerwise.runtime.group import Lifecycle

log = logging.getLogger("layerwise")

HONEST = 0.10  # measured within 10% of predicted, or the plan says why


class _Clock:
    """Timestamps on the compute stream (CUDA events) or the host clock (CPU)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device

    def mark(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(torch.cuda.current_stream(self.device))
            return ev
        return time.perf_counter()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def seconds(self, a, b) -> float:
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a


class Probe:
    """Timestamps around the hooks of every layer of `managers` for the calls of a
    run: before and after our pre-hook, before and after our post-hook (hooks of
    its own, registered around the manager's), and every fetch timed (Meter.listen).

    Only the calls of the thread that built it are recorded: another thread serving
    the same model meanwhile interleaves its layer calls with the run's (the model's
    lock serialises layers, not steps), and its calls are not the step measured.
    They are counted (`others`), so that a run that called the model only on
    another thread is told so."""

    def __init__(self, managers, clock: _Clock):
        self.managers, self.clock = managers, clock
        self.thread = threading.get_ident()  # whose calls are the run's
        self.calls: list = []  # [group, layer, pre_in, pre_out, post_in, post_out]
        self.others = 0  # layer calls of other threads since the last reset
        self._open: list = []  # the run's layer calls still inside (their post-hook not yet run)
        self._handles = []  # the hooks' handles, removed by close()
        try:
            for gi, m in enumerate(managers):
                m.meter.listen(True)
                for lp in m.plan.layers:
                    mod, key = lp.module, (gi, lp.index)
                    self._handles += [  # (run eagerly under torch.compile, as the manager's)
                        compile_guard.register_hook(mod.register_forward_pre_hook, self._pre_in(key), prepend=True),
                        compile_guard.register_hook(mod.register_forward_pre_hook, self._pre_out(key)),
                        compile_guard.register_hook(mod.register_forward_hook, self._post_in(key), prepend=True,
                                                   always_call=True),
                        compile_guard.register_hook(mod.register_forward_hook, self._post_out(key), always_call=True),
                    ]
        except BaseException:
            self.close()
            raise

    def _pre_in(self, key):
        def hook(module, args):
            if threading.get_ident() != self.thread:
                self.others += 1
                return
            rec = [key[0], key[1], self.clock.mark(), None, None, None]
            self.calls.append(rec)
            self._open.append(rec)
        return hook

    def _pre_out(self, key):
        def hook(module, args):
            if self._open and threading.get_ident() == self.thread:
                self._open[-1][3] = self.clock.mark()
        return hook

    def _post_in(self, key):
        def hook(module, args, output):
            if self._open and threading.get_ident() == self.thread:
                self._open[-1][4] = self.clock.mark()
        return hook

    def _post_out(self, key):
        def hook(module, args, output):
            if self._open and threading.get_ident() == self.thread:
                self._open.pop()[5] = self.clock.mark()
        return hook

    def copies(self) -> list:
        """Per group: [(layer, bytes, seconds)] of the fetches timed so far (waits for them)."""
        out = []
        for m in self.managers:
            m.stats(sync=True)  # every copy done and its timing resolved
            out.append(list(m.meter.copy_log or []))
        return out

    def reset(self) -> None:
        """Forget what was recorded: a new run begins."""
        self.calls, self._open, self.others = [], [], 0

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        for m in self.managers:
            m.meter.listen(False)


@dataclasses.dataclass
class TunePlan:
    """What tune chose, what it predicted and what it measured (seconds).

    Read as attributes or as items: plan.predicted_step_s == plan["predicted_step_s"]
    (the step time predicted for the placement applied), plan["measured_step_s"]
    (measured after applying it; None with apply=False); `predicted_s` and
    `measured_s` are the same figures under their short names. plan.keys() lists
    every name an item access takes."""

    groups: list  # [{"group", "layers", "resident", "prefetch_depth"}] in force after tune
    predicted_s: float
    measured_s: float | None  # None with apply=False
    floor_s: float
    before_s: float  # measured with the placement in force before
    before_predicted_s: float  # the model's prediction of that placement (its own check)
    alternatives: dict  # {name: predicted seconds} of the candidates it compared
    device_bytes: int  # non-layer weights + rings + resident layers (+ expert caches) of the chosen placement
    budget: int
    bus_gbps: float | None
    applied: bool
    note: str = ""

    @property
    def predicted_step_s(self) -> float:
        return self.predicted_s

    @property
    def measured_step_s(self) -> float | None:
        return self.measured_s

    @property
    def error(self) -> float | None:
        """measured / predicted - 1."""
        return None if self.measured_s is None else self.measured_s / self.predicted_s - 1.0

    def keys(self) -> list[str]:
        return [*_PLAN_ALIASES, *(f.name for f in dataclasses.fields(self)), "error"]

    def __getitem__(self, key: str):
        if not isinstance(key, str) or key not in self.keys():
            raise KeyError(f"layerwise.TunePlan has no item {key!r}; it has {self.keys()}")
        return getattr(self, key)

    def __contains__(self, key) -> bool:
        return isinstance(key, str) and key in self.keys()

    def __iter__(self):  # (as a dict iterates: its keys; dict(plan) gives every item)
        return iter(self.keys())

    def summary(self) -> str:
        meas = f"{self.measured_s * 1e3:.2f} ms" if self.measured_s is not None else "not measured (apply=False)"
        return (f"layerwise.tune: predicted {self.predicted_s * 1e3:.2f} ms, measured {meas}, floor "
                f"{self.floor_s * 1e3:.2f} ms (before: {self.before_s * 1e3:.2f} ms)")

    def __str__(self) -> str:
        rows = [("group", "resident", "depth")]
        for g in self.groups:
            res = g["resident"]
            text = f"{len(res)} of {g['layers']}" + (f": {_ranges(res)}" if res else "")
            rows.append((g["group"], text, str(g["prefetch_depth"])))
        widths = [max(len(r[k]) for r in rows) for k in range(3)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        meas = (f"{self.measured_s * 1e3:.2f} ms ({self.error * 100:+.1f}% of predicted)"
                if self.measured_s is not None else "not measured (apply=False)")
        lines += [
            f"step: predicted {self.predicted_s * 1e3:.2f} ms, measured {meas}, floor {self.floor_s * 1e3:.2f} ms",
            f"before: measured {self.before_s * 1e3:.2f} ms (predicted {self.before_predicted_s * 1e3:.2f} ms)",
            "compared: " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in self.alternatives.items()),
            f"device: {fmt_bytes(self.device_bytes)} of a {fmt_bytes(self.budget)} budget; bus "
            + (f"{self.bus_gbps:.2f} GB/s (fitted)" if self.bus_gbps else "not timed"),
        ]
        if self.note:
            lines.append(f"note: {self.note}")
        return "\n".join(lines)


_PLAN_ALIASES = ("predicted_step_s", "measured_step_s")  # docs/design.md's names of predicted_s / measured_s


def _ranges(idx) -> str:
    out, start, prev = [], None, None
    for i in list(idx) + [None]:
        if start is None:
            start = prev = i
        elif i is not None and i == prev + 1:
            prev = i
        else:
            out.append(str(start) if start == prev else f"{start}-{prev}")
            start = prev = i
    return ",".join(out)


def _models(obj) -> list:
    from layerwise import pipelines

    if pipelines.is_offloaded_pipeline(obj):
        return [m for _, m in pipelines.streamed_components(obj)]
    if not managers_of(obj):
        raise RuntimeError(f"layerwise.tune: {type(obj).__name__} is not offloaded by layerwise "
                           "(configure_layerwise_offload, load_offloaded or offload_pipeline first)")
    return [obj]


def _whole_bytes(obj) -> int:
    """A pipeline's components kept whole on the device (offload_pipeline counts them in its budget)."""
    from layerwise import pipelines

    return pipelines.resident_component_bytes(obj) if pipelines.is_offloaded_pipeline(obj) else 0


def _timed_runs(run, obj, clock: _Clock, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        clock.sync()
        t0 = time.perf_counter()
        run(obj)
        clock.sync()
        out.append(time.perf_counter() - t0)
    return out


def _measure(run, obj, managers, clock: _Clock, repeats: int) -> pm.Step:
    """The Step of `run` (placement.Step) from `repeats` probed runs: per call the
    median over the runs, per layer its fastest fetch (a fetch that queued behind
    another group's on the bus took longer than its own)."""
    index = {id(m): gi for gi, m in enumerate(managers)}
    probe = Probe(managers, clock)
    runs, walls = [], []
    try:
        for _ in range(repeats):
            probe.reset()
            clock.sync()
            start = clock.mark()
            run(obj)
            end = clock.mark()
            clock.sync()
            if not probe.calls and probe.others:
                raise RuntimeError(
                    f"layerwise.tune: run(model) called no streamed layer on the thread that called tune, while "
                    f"another thread called {probe.others} layer(s) of the model: tune measures the calls of its "
                    "own thread only (another thread serving the model meanwhile is not the step measured). Give "
                    "tune a run that calls the model itself, on this thread")
            if not probe.calls or any(c[5] is None or c[3] is None or c[4] is None for c in probe.calls):
                raise RuntimeError("layerwise.tune: run(model) called no streamed layer to the end (or raised "
                                   "inside one): give tune a run that performs one representative step")
            runs.append(probe.calls)
            walls.append((start, end))
        copies = probe.copies()
    finally:
        probe.close()
    seq = [(c[0], c[1]) for c in runs[-1]]
    kept = [(r, w) for r, w in zip(runs, walls) if [(c[0], c[1]) for c in r] == seq]  # calls the same way each time
    s = clock.seconds
    per_run = []
    for r, (start, end) in kept:
        inside = s(r[0][2], r[-1][5])
        per_run.append({
            "compute": [s(c[3], c[4]) for c in r],
            "gap": [0.0] + [max(0.0, s(a[5], b[2])) for a, b in zip(r, r[1:])],
            "pre": [s(c[2], c[3]) for c in r],
            "post": [s(c[4], c[5]) for c in r],
            "outside": max(0.0, s(start, end) - inside),
        })

    def med(key, k):
        return statistics.median(p[key][k] for p in per_run)

    calls = [pm.Call(g, i, med("compute", k), med("gap", k)) for k, (g, i) in enumerate(seq)]
    pre = min(statistics.median(p["pre"][k] for p in per_run) for k in range(len(seq)))
    post = statistics.median(statistics.median(p["post"]) for p in per_run)
    outside = statistics.median(p["outside"] for p in per_run)
    groups, copy_s = [], []
    samples = [(b, t) for log_ in copies for _, b, t in log_]
    fit = pm.fit_bus(samples)
    for gi, m in enumerate(managers):
        fetch = m.fetch_bytes()
        best: dict = {}
        for layer, _, t in copies[gi]:
            if layer >= 0 and t > 0:
                best[layer] = min(best.get(layer, t), t)
        lat, gbps = fit if fit is not None else (0.0, None)
        copy_s.append([best.get(i, lat + fetch[i] / (gbps * 1e9) if gbps else 0.0) for i in range(m.num_layers)])
        groups.append(pm.Group(m.layer_name, m.num_layers, [lp.nbytes for lp in m.plan.layers], fetch,
                               index.get(id(m.next_manager), gi)))
    return pm.Step(groups, calls, copy_s, pre, post, outside, fit[1] if fit is not None else None)


def _budget(device, device_budget, fixed: int, current: int) -> int:
    if device_budget is None:
        return current
    if isinstance(device_budget, str):
        if device_budget != "auto":
            raise ValueError(f"device_budget must be a number of bytes, 'auto' or None, got {device_budget!r}")
        if device.type == "cpu":
            log.info("layerwise.tune: device_budget='auto' on a CPU device: the placement keeps the device bytes "
                     "it uses now (%s); pass bytes to plan against a budget", fmt_bytes(current))
            return current
        return resolve_budget(device, "auto", None)
    if isinstance(device_budget, bool) or not isinstance(device_budget, (int, float)) or not \
            math.isfinite(device_budget) or device_budget < 0:
        raise ValueError(f"device_budget must be a finite number of bytes >= 0, 'auto' or None, got {device_budget!r}")
    return int(device_budget)


def _host_rooms(managers) -> list:
    """On a CPU device, per host budget in force (layerwise.planning.host_budget.HostBudget):
    (bytes it leaves, the indices of its groups in `managers`, their device bytes now)."""
    out: dict = {}
    for k, m in enumerate(managers):
        b = m.tiers.host_budget
        if b is not None and m.device.type == "cpu":
            out.setdefault(id(b), (b, []))[1].append(k)
    return [(b.room(), idx, {k: managers[k].device_bytes() for k in idx}) for b, idx in out.values()]


def _why(plan: TunePlan, before: pm.Step, after: pm.Step | None, predicted: pm.Prediction, stall_s) -> str:
    """Why the measured step is off the prediction by more than HONEST."""
    parts = [f"measured {plan.measured_s * 1e3:.2f} ms is {plan.error * 100:+.1f}% off the predicted "
             f"{plan.predicted_s * 1e3:.2f} ms"]
    if after is not None:
        c0 = sum(c.compute_s for c in before.calls)
        c1 = sum(c.compute_s for c in after.calls)
        if c0 > 0 and abs(c1 / c0 - 1) > HONEST / 2:
            parts.append(f"the layers' compute took {c1 * 1e3:.2f} ms after against {c0 * 1e3:.2f} ms measured "
                         "before (the compute itself changed: other work on the machine, or on the CPU backend the "
                         "copies sharing its cores)")
    if stall_s is not None:
        parts.append(f"the compute waited {stall_s * 1e3:.2f} ms on copies against {predicted.stall_s * 1e3:.2f} ms "
                     "predicted")
    if plan.before_predicted_s and abs(plan.before_s / plan.before_predicted_s - 1) > HONEST:
        parts.append(f"the model was already off for the placement before ({plan.before_s * 1e3:.2f} ms measured, "
                     f"{plan.before_predicted_s * 1e3:.2f} ms predicted)")
    return "; ".join(parts)


def tune(model_or_pipe, run, device_budget=None, *, depths=(1, 2), repeats: int = 3, apply: bool = True) -> TunePlan:
    """Choose, apply and check each streamed group's placement (module doc).

    device_budget: bytes the non-layer weights, rings and resident layers may take
    (as at configure); None: what they take now (a re-placement at the same memory);
    "auto": free device memory less 10% (on a CPU device: what they take now).
    depths: the prefetch depths to consider. repeats: probed and timed runs per
    measurement (medians). apply=False: choose and predict, change nothing.
    `run` must call the model on the thread that calls tune (only its calls are
    measured)."""
    if not callable(run):
        raise TypeError("layerwise.tune(model, run, ...): run(model) must be a callable that performs one step")
    # The values configure takes for the same things (numpy and 0-D tensor integers too).
    repeats = validate_count("repeats", repeats, 1, allow_none=False)
    if device_budget is not None and not isinstance(device_budget, str):
        device_budget = validate_bytes("device_budget", device_budget, "'auto' or None")
    depths = tuple(depths)
    if not depths or any(isinstance(d, bool) or not isinstance(d, numbers.Integral) or d < 0 for d in depths):
        raise ValueError(f"depths must be prefetch depths (ints >= 0), got {depths!r}")
    depths = tuple(sorted({int(d) for d in depths}))
    models = _models(model_or_pipe)
    managers = [m for model in models for m in managers_of(model) if m.enabled and m.state is Lifecycle.STREAMING]
    if not managers:
        raise RuntimeError("layerwise.tune: no layer group streams")
    if any(m.options.split_fetch is not None for m in managers):
        raise RuntimeError("layerwise.tune: a split-fetch group's placement is fixed at configure (each rank keeps "
                           "only its share of the streamed layers); tune it by configuring again")
    device = managers[0].device
    clock = _Clock(device)
    fixed = sum(non_layer_bytes(model, managers_of(model)) for model in models) + _whole_bytes(model_or_pipe)
    caches = sum(m.expert_cache_bytes() for m in managers)  # (routed experts: fixed in size while streaming)
    fixed += caches
    old = [(list(m.resident), m.prefetch_depth) for m in managers]
    notes = [m.placement for m in managers]
    with torch.no_grad():
        run(model_or_pipe)  # warm: caches, first-call work, the wrap-around's prefetches
        before_s = statistics.median(_timed_runs(run, model_or_pipe, clock, repeats))
        step = _measure(run, model_or_pipe, managers, clock, repeats)
    current = pm.Placement(tuple(tuple(r) for r, _ in old), tuple(d for _, d in old))
    budget = _budget(device, device_budget, fixed, fixed + current.device_bytes(step))

    hosts = _host_rooms(managers)

    def fits(p: pm.Placement) -> bool:
        if fixed + p.device_bytes(step) > budget:
            return False
        # On a CPU device the rings and resident layers are host memory: within the host budget too.
        return all(sum(managers[k].device_bytes(p.resident[k], p.depth[k]) - now[k] for k in idx) <= room
                   for room, idx, now in hosts)

    cands = pm.candidates(step, current, depths, fits)
    if not cands:
        bare = pm.Placement(tuple(() for _ in managers), tuple(min(depths) for _ in managers))  # nothing resident
        raise RuntimeError(
            f"layerwise.tune: no placement fits a device budget of {fmt_bytes(budget)} ({budget} bytes): the "
            f"non-layer weights take {fmt_bytes(fixed - caches)}"
            + (f", the expert caches {fmt_bytes(caches)}" if caches else "")
            + f" and the rings at depth {min(depths)} with nothing resident "
            f"{fmt_bytes(bare.device_bytes(step))}"
            + (f"; on this CPU device the host budget leaves {fmt_bytes(sum(r for r, _, _ in hosts))} for more rings "
               "and resident layers than it holds now" if hosts else ""))
    best, preds = pm.choose(step, cands, fits)
    chosen, pred = cands[best], preds[best]
    plan = TunePlan(
        groups=[{"group": m.layer_name, "layers": m.num_layers, "resident": list(r), "prefetch_depth": d}
                for m, r, d in zip(managers, chosen.resident, chosen.depth)],
        predicted_s=pred.step_s, measured_s=None, floor_s=pred.floor_s, before_s=before_s,
        before_predicted_s=pm.predict(step, current).step_s,
        alternatives={k: v.step_s for k, v in preds.items()}, device_bytes=fixed + chosen.device_bytes(step),
        budget=budget, bus_gbps=step.bus_gbps, applied=False)
    if not apply:
        return plan
    _apply(managers, chosen, old, f"layerwise.tune ({best}): predicted {pred.step_s * 1e3:.2f} ms", notes)
    try:
        _check(plan, run, model_or_pipe, managers, clock, repeats, step, pred, best)
    except BaseException as err:
        # The step failed under the new placement (a block that calls another one of its
        # list and now shares its slot, say), or was interrupted: every group gets its old
        # placement back; a tune that raises changes nothing.
        with contract.defer_interrupts():
            for m in managers:
                _forget_abandoned_forward(m)
            _restore(managers, managers, old, notes)
        if isinstance(err, Exception):
            err.add_note(f"layerwise.tune: raised while measuring the placement it chose ({best}); every group's "
                         "old placement was put back")
        raise
    log.info("%s", plan.summary())
    return plan


def _check(plan: TunePlan, run, model_or_pipe, managers, clock, repeats, step, pred, best) -> None:
    """Measure the step under the placement applied, and record it (module doc, 4)."""
    plan.applied = True
    with torch.no_grad():
        run(model_or_pipe)
        plan.measured_s = statistics.median(_timed_runs(run, model_or_pipe, clock, repeats))
        stalls = [m.stats()["last_step"] for m in managers]
        stall_s = sum(s["stall_s"] for s in stalls) if all(s and s.get("stall_s") is not None
                                                           for s in stalls) else None
        after = None
        if abs(plan.error) > HONEST:
            after = _measure(run, model_or_pipe, managers, clock, repeats)
    note = (f"layerwise.tune ({best}): predicted {pred.step_s * 1e3:.2f} ms, measured {plan.measured_s * 1e3:.2f} ms, "
            f"floor {pred.floor_s * 1e3:.2f} ms")
    if abs(plan.error) > HONEST:
        plan.note = _why(plan, step, after, pred, stall_s)
        note += f" ({plan.note})"
    for m in managers:
        m.set_residency(m.resident, m.prefetch_depth, note=note)  # (the same placement: only its note)


def _forget_abandoned_forward(m) -> None:
    """run() returned or raised: no forward of this thread is in flight, so a layer
    still marked computing (and the lock still held) was left so by a forward that
    an exception or an interrupt abandoned (as the model's root pre-hook clears it)."""
    m.lock.release_all()
    with m.lock:
        m.forget_abandoned_forward()


def _restore(managers, which, old, notes) -> None:
    """The groups `which` back to their old placements (and the notes that said who chose them)."""
    for m in which:
        k = managers.index(m)
        r, d = old[k]
        m.set_residency(r, d, note=notes[k])


def _apply(managers, chosen: pm.Placement, old, note: str, notes) -> None:
    """Every group's new placement, or (a failure, an interrupt) every group's old one."""
    done = []
    try:
        for m, res, d in zip(managers, chosen.resident, chosen.depth):
            m.set_residency(list(res), d, note=note)
            done.append(m)
    except BaseException:
        with contract.defer_interrupts():
            _restore(managers, done, old, notes)
        raise
