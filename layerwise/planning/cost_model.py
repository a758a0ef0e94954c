"""placement: the step time of a placement, predicted from measured per-layer
figures with a model of the pipeline the manager runs (what layerwise.tune
chooses with). Pure: no model, no device; numbers in, numbers out.

A step is the sequence of layer calls measured in one representative run
(`Step.calls`, several groups, a layer called more than once where the run
does so), with per call: the compute between the pre- and post-hook, the
hooks' own cost, and the model's code between it and the call before. A
placement (`Placement`) gives per group the resident layers and the prefetch
depth. `predict` walks the calls the way the hooks do (runtime/group.py):

- each group's streamed layers have fixed slots (plan.assign_slots); a slot
  holds the last layer fetched into it;
- the pre-hook of a call issues the fetch of its own layer if its slot does not
  hold it (a synchronous load), then the fetches of the next `depth` streamed
  layers after it, into the following groups and around to the first at the
  end (LayerwiseOffloadManager._prefetch_after), skipping a slot whose layer
  computes; then it waits for its own;
- fetches cross one bus, one after the other, each starting when it was issued
  (the compute up to that point done: the fetch waits for what the compute
  stream has enqueued) and the bus is free, and taking its layer's copy time
  (`Step.copy_s`: measured, or from the bus fit for layers never fetched);
- between steps the model's work outside its layers runs (`Step.outside_s`)
  while fetches go on.

Three passes over the calls; the last is the steady state (the wrap-around's
prefetches made in the ones before). The floor of a placement is max(the resident
step, the time its fetches take on the bus).
"""
from __future__ import annotations

import dataclasses

from layerwise.planning.layout import assign_slots

PASSES = 3  # walks over the calls; the last one is the steady state predicted


@dataclasses.dataclass
class Group:
    name: str
    num_layers: int
    layer_bytes: list  # plan bytes of each layer (what a slot must hold)
    fetch_bytes: list  # bytes of each layer's fetch over the bus (encoded, a share)
    next: int = 0  # the group whose layers its last layer prefetches (next_manager; itself alone)


@dataclasses.dataclass
class Call:
    group: int
    layer: int
    compute_s: float  # between the pre-hook's end and the post-hook's start
    gap_s: float  # the model's own code since the call before (0 for the first)


@dataclasses.dataclass
class Step:
    groups: list  # [Group], in the order the hooks chain them (next_manager)
    calls: list  # [Call], in the order of one representative run
    copy_s: list  # per group, per layer: its fetch's time on the bus (seconds)
    pre_hook_s: float  # a pre-hook's own cost (its wait excluded)
    post_hook_s: float
    outside_s: float  # the run's time outside its layers (before the first, after the last)
    bus_gbps: float | None  # the fitted bus bandwidth (floor), None where nothing was timed

    def resident_s(self) -> float:
        """The step with every layer resident: compute and the model's own code."""
        return self.outside_s + sum(c.compute_s + c.gap_s for c in self.calls)


@dataclasses.dataclass(frozen=True)
class Placement:
    resident: tuple  # per group: a tuple of resident layer indices
    depth: tuple  # per group: prefetch depth

    def device_bytes(self, step: Step) -> int:
        """Ring + resident bytes over the groups (plan.device_bytes)."""
        total = 0
        for g, res, d in zip(step.groups, self.resident, self.depth):
            r = set(res)
            streamed = [b for i, b in enumerate(g.layer_bytes) if i not in r]
            _, slots = assign_slots(len(streamed), d)
            total += slots * max(streamed, default=0) + sum(g.layer_bytes[i] for i in r)
        return total


@dataclasses.dataclass
class Prediction:
    step_s: float
    stall_s: float  # the calls' waits for their fetches
    bus_bytes: int  # bytes fetched in the steady-state step
    floor_s: float


def predict(step: Step, placement: Placement) -> Prediction:
    """The steady-state step time of `placement` (module doc)."""
    groups = step.groups
    n_groups = len(groups)  # (a walk over the chain of groups, bounded as the manager's)
    streamed: list[list[int]] = []  # per group: its streamed layers, in order
    slot_of: list[list[int]] = []  # per group, per layer: its slot (-1: resident)
    next_pos: list[list[int]] = []  # per group, per layer: its position in `streamed`, or the next streamed one's
    for g, res in zip(groups, placement.resident):
        r = set(res)
        s = [i for i in range(g.num_layers) if i not in r]
        colours, _ = assign_slots(len(s), placement.depth[len(streamed)])
        so = [-1] * g.num_layers
        for pos, i in enumerate(s):
            so[i] = colours[pos]
        nxt, pos = [0] * g.num_layers, len(s)
        for i in reversed(range(g.num_layers)):
            if i not in r:
                pos -= 1
            nxt[i] = pos
        streamed.append(s)
        slot_of.append(so)
        next_pos.append(nxt)
    holder: list[dict[int, int]] = [dict() for _ in groups]  # slot -> layer fetched into it last
    ready: list[dict[int, float]] = [dict() for _ in groups]  # layer -> when its last fetch completes
    bus = [0.0]
    moved = [0]

    busy = [0.0]

    def fetch(gi: int, j: int, t: float) -> None:
        start = max(t, bus[0])
        bus[0] = start + step.copy_s[gi][j]
        busy[0] += step.copy_s[gi][j]
        holder[gi][slot_of[gi][j]] = j
        ready[gi][j] = bus[0]
        moved[0] += groups[gi].fetch_bytes[j]

    t = 0.0
    stall = 0.0
    for p in range(PASSES):
        if p == PASSES - 1:
            t += step.outside_s
            t0, stall0, moved0, busy0 = t, stall, moved[0], busy[0]
        for c in step.calls:
            gi, i = c.group, c.layer
            t += c.gap_s
            s = slot_of[gi][i]
            if s >= 0 and holder[gi].get(s) != i:
                fetch(gi, i, t)  # not prefetched: loaded now
            # the next `depth` streamed layers after i, through the following groups
            want = placement.depth[gi]
            g, pos = gi, next_pos[gi][i] + (1 if s >= 0 else 0)
            for _ in range(2 * n_groups + 1):
                for j in streamed[g][pos : pos + want]:
                    if g == gi and j == i:
                        want = 0
                        break
                    sj = slot_of[g][j]
                    if holder[g].get(sj) != j and not (g == gi and sj == s):
                        fetch(g, j, t)
                    want -= 1
                if want <= 0:
                    break
                g, pos = groups[g].next, 0
            t += step.pre_hook_s
            if s >= 0:
                wait = max(0.0, ready[gi][i] - t)
                stall += wait
                t += wait
            t += c.compute_s + step.post_hook_s
    step_s = t - t0 + step.outside_s
    # (the floor's transfer: the bus time of the step's fetches, each at its own measured copy time,
    # as the walk above charges them: never above the prediction)
    return Prediction(step_s, stall - stall0, moved[0] - moved0, max(step.resident_s(), busy[0] - busy0))


def fit_bus(samples) -> tuple[float, float] | None:
    """(latency s, bandwidth GB/s) fitted to [(bytes, seconds)] by least squares
    (a proportional fit where the sizes do not vary); None without samples."""
    pts = [(b, s) for b, s in samples if b > 0 and s > 0]
    if not pts:
        return None
    n = len(pts)
    mb = sum(b for b, _ in pts) / n
    ms = sum(s for _, s in pts) / n
    var = sum((b - mb) ** 2 for b, _ in pts)
    if var > 0:
        slope = sum((b - mb) * (s - ms) for b, s in pts) / var
        lat = ms - slope * mb
        if slope > 0 and lat >= 0:
            return lat, 1.0 / slope / 1e9
    slope = sum(s for _, s in pts) / sum(b for b, _ in pts)
    return 0.0, 1.0 / slope / 1e9


def candidates_by_policy(step: Step, depths, fits, policies=("leading", "strided")) -> dict:
    """{(policy, depth): Placement}: per policy and depth, the largest shared share
    of resident layers (as layerwise.planning.device_budget plans it) whose placement `fits`."""
    from layerwise.options import resolve_resident
    from layerwise.planning.device_budget import largest_share

    def at(share: float, policy: str, d: int) -> Placement:
        return Placement(tuple(tuple(resolve_resident(share, g.num_layers, policy)) for g in step.groups),
                         tuple(d for _ in step.groups))

    out = {}
    for policy in policies:
        for d in depths:
            share = largest_share(lambda f: fits(at(f, policy, d)))
            if share is not None:
                out[(policy, d)] = at(share, policy, d)
    return out


def candidates(step: Step, current: Placement, depths, fits) -> dict:
    """{name: Placement} that fit: the placement in force, the fixed policies at the
    largest share (candidates_by_policy), and the greedy choices, at each depth."""
    out: dict = {}
    if fits(current):
        out["in force"] = current
    for (policy, d), p in candidates_by_policy(step, depths, fits).items():
        out[f"{policy}, depth {d}"] = p
    for d in depths:
        depth = tuple(d for _ in step.groups)
        if not fits(Placement(tuple(() for _ in step.groups), depth)):
            continue
        out[f"greedy, depth {d}"] = greedy(step, depth, fits, by_bytes=False)
        out[f"greedy per byte, depth {d}"] = greedy(step, depth, fits, by_bytes=True)
    return out


def choose(step: Step, cands: dict, fits) -> tuple[str, dict]:
    """(the name of the fastest predicted candidate, refined one change at a time by
    `improve`: added to `cands` as "<name>, improved"; {name: Prediction} of them all).
    Ties go to the fewer device bytes."""
    preds = {k: predict(step, p) for k, p in cands.items()}
    best = min(cands, key=lambda k: (round(preds[k].step_s, 9), cands[k].device_bytes(step)))
    better = improve(step, cands[best], fits)
    if better != cands[best]:
        best = f"{best}, improved"
        cands[best], preds[best] = better, predict(step, better)
    return best, preds


def greedy(step: Step, depth: tuple, fits, by_bytes: bool) -> Placement:
    """Make resident, one at a time, the layer whose residency shortens the predicted
    step most (per device byte it adds, with `by_bytes`) while the placement fits;
    stops when none shortens it. Lazy: a layer's gain is computed again only when it
    is the best on record (gains shrink as layers become resident)."""
    import heapq

    res: list[set[int]] = [set() for _ in step.groups]

    def placement(extra=None) -> Placement:
        sets = [set(r) for r in res]
        if extra is not None:
            sets[extra[0]].add(extra[1])
        return Placement(tuple(tuple(sorted(r)) for r in sets), depth)

    current = placement()
    now = predict(step, current).step_s
    base_bytes = current.device_bytes(step)

    def score(gi, i):
        p = placement((gi, i))
        if not fits(p):
            return None
        gain = now - predict(step, p).step_s
        added = p.device_bytes(step) - base_bytes
        return gain / max(added, 1) if by_bytes else gain

    heap: list[tuple[float, int, int]] = []  # (-gain, group, layer)
    for gi, g in enumerate(step.groups):
        for i in range(g.num_layers):
            sc = score(gi, i)
            if sc is not None and sc > 0:
                heapq.heappush(heap, (-sc, gi, i))
    while heap:
        _, gi, i = heapq.heappop(heap)
        sc = score(gi, i)
        if sc is None or sc <= 0:
            continue
        if heap and -heap[0][0] > sc * (1 + 1e-9):
            heapq.heappush(heap, (-sc, gi, i))  # stale: its gain fell below the next one's
            continue
        res[gi].add(i)
        current = placement()
        now = predict(step, current).step_s
        base_bytes = current.device_bytes(step)
    return current


def improve(step: Step, start: Placement, fits, max_rounds: int = 32, max_predictions: int = 20000) -> Placement:
    """Local search from `start`: the best single change (a layer made resident, one
    made streamed, or one swapped for another, within a group) that shortens the
    predicted step and fits, until none does (bounded)."""
    best, best_s = start, predict(step, start).step_s
    spent = 0
    for _ in range(max_rounds):
        found = None
        for gi, g in enumerate(step.groups):
            res = set(best.resident[gi])
            out = [i for i in range(g.num_layers) if i not in res]
            moves = [(None, i) for i in out] + [(r, None) for r in res] + [(r, i) for r in res for i in out]
            for r, i in moves:
                new = set(res)
                if r is not None:
                    new.discard(r)
                if i is not None:
                    new.add(i)
                groups = list(best.resident)
                groups[gi] = tuple(sorted(new))
                p = Placement(tuple(groups), best.depth)
                if not fits(p):
                    continue
                spent += 1
                t = predict(step, p).step_s
                if t < best_s * (1 - 1e-6) and (found is None or t < found[1]):
                    found = (p, t)
                if spent >= max_predictions:
                    break
        if found is None:
            break
        best, best_s = found
        if spent >= max_predictions:
            break
    return best
