"""layerwise.report(model): what streaming costs and moves, across every group.

The Report is a dict ({"groups": [...], "total": {...}, "host_budget": {...} or
None}); printed, it is a table (within 120 columns), the host budget in force
and its use, then one plain-language line per group that says what the figures
mean (the last step, and averages over the last steps) and what, if anything,
is off (a group where streaming saves no device memory, a group held entirely
on disk).
"""
from __future__ import annotations

import textwrap

from layerwise.configure import managers_of
from layerwise.planning.device_budget import fmt_bytes, non_layer_bytes, streaming_saves_nothing

WIDTH = 120  # the table and the plain lines stay within this many columns


# (header, key, format). Per-step figures are those of the last complete step.
_COLUMNS = [
    ("group", "group", str),
    ("resident", "resident_of", str),
    ("per step", "bytes_per_step", fmt_bytes),
    ("step", "step_ms", "{:.1f} ms".format),
    ("stall", "stall_ms_per_step", "{:.2f} ms".format),
    ("sync loads", "sync_loads", str),
    ("GB/s", "gbps", "{:.2f}".format),
    ("arena", "arena_bytes", fmt_bytes),
    ("ring", "ring_bytes", fmt_bytes),
    ("resident size", "resident_bytes", fmt_bytes),
]
_LEGEND = ("per step, step (host time of the step), stall: the last complete step (averages over the last "
           "steps below); stall: compute waiting on copies; sync loads: all steps; GB/s: over copy time")


def _wrap(parts: list[str], width: int, indent: str = "    ") -> list[str]:
    """Join `parts` with "; ", breaking lines between parts (within one only if it alone is too long)."""
    lines: list[str] = []
    cur = ""
    for i, part in enumerate(parts):
        piece = part + (";" if i < len(parts) - 1 else "")
        cand = f"{cur} {piece}" if cur else (indent if lines else "") + piece
        if len(cand) <= width:
            cur = cand
            continue
        if cur:
            lines.append(cur)
        first = indent if lines else ""
        cur = first + piece
        if len(cur) > width:
            *full, cur = textwrap.wrap(piece, width, initial_indent=first, subsequent_indent=indent,
                                       break_on_hyphens=False)
            lines += full
    if cur:
        lines.append(cur)
    return lines


def _elide(text: str, width: int) -> str:
    return text if len(text) <= width else "..." + text[len(text) - width + 3:]


class Report(dict):
    """A dict ({"groups": [...], "total": {...}}) that prints as a table, then
    one plain-language line per group."""

    def table(self) -> str:
        rows = self["groups"] + [self["total"]]
        cells = [[h for h, _, _ in _COLUMNS]]
        for r in rows:
            cells.append(["-" if r.get(k) is None else fmt(r[k]) for _, k, fmt in _COLUMNS])
        widths = [max(len(row[c]) for row in cells) for c in range(len(_COLUMNS))]
        over = sum(widths) + 2 * (len(widths) - 1) - WIDTH
        if over > 0:  # long group names: elide their start, keep their distinctive end
            widths[0] = max(len("group"), widths[0] - over)
            for row in cells:
                row[0] = _elide(row[0], widths[0])
        lines = ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)

    def lines(self) -> list[str]:
        """The plain-language lines, each wrapped to WIDTH columns."""
        out = []
        hb = self.get("host_budget")
        if hb:
            out += _wrap(hb["text"].split("; "), WIDTH)
        for g in self["groups"]:
            out += _wrap(g["summary"].split("; "), WIDTH)
        return out

    def __str__(self) -> str:
        return "\n".join([self.table(), *textwrap.wrap(_LEGEND, WIDTH), "", *self.lines()])


class NotOffloaded(dict):
    """layerwise.report of a model or pipeline that is not offloaded: a dict with
    "offloaded" (False, or True for a pipeline whose components stream on their own),
    the report's lists empty ("groups" / "components") and "text", which says so;
    prints as its text."""

    def table(self) -> str:
        return self["text"]

    def lines(self) -> list[str]:
        return textwrap.wrap(self["text"], WIDTH)

    def __str__(self) -> str:
        return self["text"]


def _pin_error(s: dict):
    return s.get("arena_pin_error", s.get("pin_error")) or None


def _summary(r: dict) -> str:
    """One plain sentence list about a group's row."""
    streamed = r["layers"] - r["resident"]
    parts = [f"{r['group']}: {streamed} of {r['layers']} layers streamed ({r['resident']} resident), "
             f"{r['slots']} slot{'' if r['slots'] == 1 else 's'}, prefetch depth {r['prefetch_depth']}"]
    if r["has_last_step"]:
        per = f"{fmt_bytes(r['bytes_per_step'])} per step in {r['copies_per_step']} copies"
        if r["gbps"] is not None:
            per += f" at {r['gbps']:.2f} GB/s while copies were in flight"
        parts.append(per)
        stall = r["stall_ms_per_step"]
        parts.append((f"compute waited {stall:.2f} ms per step on copies" if stall is not None else
                      "compute's wait on copies was not timed in the last step")
                     + f" (sync loads: {r['sync_loads_per_step']})")
        rec = r["recent"]
        if rec["steps"] > 1:
            text = (f"over the last {rec['steps']} steps: step mean {rec['step_ms_mean']:.2f} ms (min "
                    f"{rec['step_ms_min']:.2f}, max {rec['step_ms_max']:.2f})")
            if rec["stall_steps"]:
                text += (f", stall mean {rec['stall_ms_mean']:.2f} ms (min {rec['stall_ms_min']:.2f}, max "
                         f"{rec['stall_ms_max']:.2f}" + (f", {rec['stall_steps']} steps timed" if
                                                        rec["stall_steps"] < rec["steps"] else "") + ")")
            parts.append(text)
    else:
        parts.append(f"no complete step yet ({r['steps']} started): per-step figures appear after the first "
                     "complete forward")
    d = r.get("disk")
    if not r["arena_bytes"] and d and d["layers"] == r["layers"] - r["resident"]:
        parts.append(f"no host arena: all {d['layers']} streamed layers stay on disk (in "
                     f"{'spill files' if d['spill'] else 'the checkpoint'}) and are read at every step; host memory "
                     f"holds only the staging slots")
    elif r["arena_pinned"]:
        parts.append(f"arena {fmt_bytes(r['arena_bytes'])} pinned")
    elif r["arena_bytes"]:
        why = r["pin_error"] or ("pin_memory=False" if r["pin_memory"] is False else "no reason reported")
        text = f"arena {fmt_bytes(r['arena_bytes'])} NOT pinned: {why}"
        if r["device"].startswith("cuda"):
            text += " (copies from pageable memory are slower and may not overlap compute)"
        else:
            text += " (on a CPU device this only means its pages may be swapped out)"
        parts.append(text)
    sh = r.get("share_host")
    if sh:
        if sh["role"] == "private":
            parts.append(f"share_host: the packer at {sh['address']} did not finish in time: this process packed a "
                         "private copy")
        else:
            holders = sh["holders"]
            text = (f"share_host: {fmt_bytes(sh['shared_bytes'])} in the machine's shared arena {sh['address']}, "
                    f"{'packed here' if sh['role'] == 'packer' else 'packed by process ' + str(sh['packer_pid'])}"
                    + (f", held by {holders} process{'es' if holders != 1 else ''}" if holders else "")
                    + f"; {fmt_bytes(sh['private_bytes'])} of this process's own")
            if sh["copied_layers"]:
                text += f" ({len(sh['copied_layers'])} layer(s) copied on write: {sh['copied_layers']})"
            parts.append(text)
    parts.append(f"on the device: ring {fmt_bytes(r['ring_bytes'])}, resident layers {fmt_bytes(r['resident_bytes'])}")
    if r.get("placement"):
        parts.append(f"placement in force: {r['placement']}")
    if r.get("side_tensor_bytes"):
        parts.append(f"side tensors of streamed parameters (quant_state, scales) stay resident: "
                     f"{fmt_bytes(r['side_tensor_bytes'])}")
    if r["saves_nothing"]:
        parts.append(f"WARNING: streaming saves no device memory: {r['saves_nothing']}")
    if d:
        text = (f"disk tier: {d['layers']} layers ({fmt_bytes(d['layer_bytes'])}) stay in "
                f"{'spill files' if d['spill'] else 'the checkpoint'}, staging {fmt_bytes(d['staging_bytes'])} "
                f"in {d['staging_slots']} slots")
        if r["disk_bytes_per_step"] is not None:
            text += (f", {fmt_bytes(r['disk_bytes_per_step'])} read per step, compute waited "
                     f"{r['disk_wait_ms_per_step']:.2f} ms per step on reads")
        if d["read_gbps"] is not None:
            text += f", {d['read_gbps']:.2f} GB/s per read"
        if d["read_failures"]:
            text += f", {d['read_failures']} failed reads"
        if d.get("reads_on_demand"):
            text += (f"; routed experts' rows read on demand: {d['reads_on_demand']} reads, "
                     f"{fmt_bytes(d['bytes_read_on_demand'])}")
        parts.append(text)
    c = r.get("compress")
    if c:
        raw = f", {len(c['layers_raw'])} travel raw (encoding saved too little): {c['layers_raw']}" \
            if c["layers_raw"] else ""
        parts.append(f"compress='lossless': {c['layers']} layers kept encoded, {fmt_bytes(c['stored_bytes'])} "
                     f"for {fmt_bytes(c['raw_bytes'])} ({c['ratio']:.3f}x){raw}" if c["ratio"] is not None else
                     "compress='lossless': no layer to encode")
    x = r.get("experts")
    if x:
        text = (f"routed experts: {x['modules']} expert modules; {x['experts_used']} experts used, {x['hits']} hits "
                f"({x['cache_hits']} from the device cache, {x['slot_hits']} in the slot already), {x['misses']} "
                f"misses ({fmt_bytes(x['demand_bytes'])} copied on demand)")
        if x["cache_bytes"]:
            text += f"; cache {fmt_bytes(x['cache_bytes'])} ({x['cached']} of {x['cache_entries']} entries held)"
        if x.get("cache_asked_bytes", 0) > x["cache_bytes"]:
            text += (f"; cache capped at {fmt_bytes(x['cache_bytes'])} of the {fmt_bytes(x['cache_asked_bytes'])} "
                     "asked (whole experts, at most one entry per expert of the layers streamed when it was made)")
        if x["speculative_bytes"]:
            text += (f"; speculative {fmt_bytes(x['speculative_bytes'])}, "
                     f"{fmt_bytes(x['speculative_wasted_bytes'])} of it not used (yet)")
        parts.append(text)
    sf = r.get("split_fetch")
    if sf:
        text = (f"split fetch, rank {sf['rank']} of {sf['world']} ({sf['backend']}): holds "
                f"{fmt_bytes(sf['share_bytes'])} of its {sf['split_layers']} split layers (host "
                f"{fmt_bytes(sf['host_bytes'])}), in total copied {fmt_bytes(sf['bytes_local'])} locally and "
                f"gathered {fmt_bytes(sf['bytes_gathered'])} in {sf['gathers']} all-gathers")
        if sf["gather_s"] is not None:
            text += (f"; waited {sf['copy_wait_s'] * 1e3:.1f} ms on local copies and {sf['gather_s'] * 1e3:.1f} ms "
                     "in all-gathers")
        parts.append(text)
    if r["sync_loads"]:
        n, last = r["sync_loads"], r["sync_loads_per_step"]
        where = f" ({last} in the last step)" if last is not None else ""
        why = ("prefetch_depth is 0, so every streamed layer loads when it is called, with no overlap"
               if r["prefetch_depth"] == 0 else
               "layers were called out of order (or again), so their copies were not prefetched")
        parts.append(f"{n} synchronous loads{where}: {why}")
    return "; ".join(parts)


def _spread(values: list, key: str) -> dict:
    if not values:
        return {f"{key}_mean": None, f"{key}_min": None, f"{key}_max": None}
    return {f"{key}_mean": sum(values) / len(values), f"{key}_min": min(values), f"{key}_max": max(values)}


def _recent(steps: list) -> dict:
    """Host time and stall of the last complete steps (stats()["recent_steps"]):
    one step's figures vary a lot between identical runs; their spread says how much."""
    wall = [st["wall_s"] * 1e3 for st in steps if st.get("wall_s") is not None]
    stall = [st["stall_s"] * 1e3 for st in steps if st.get("stall_s") is not None]
    return {"steps": len(wall), "stall_steps": len(stall), **_spread(wall, "step_ms"), **_spread(stall, "stall_ms")}


def _host_budget(model, managers, groups: list) -> dict | None:
    """The host budget in force (a group's host_budget: layerwise.planning.device_budget.record_host_budget)
    and what the streamed weights use of it now: the arenas, the disk tier's staging slots
    and, on a CPU device, the non-layer weights, rings, resident layers and expert caches."""
    hb = next((m.host_budget for m in managers if m.host_budget is not None), None)
    if hb is None:
        return None
    arena = sum(g["arena_bytes"] for g in groups)
    staging = sum(g["disk"]["staging_bytes"] for g in groups if g.get("disk"))
    used, parts = arena + staging, [f"arenas {fmt_bytes(arena)}", f"staging {fmt_bytes(staging)}"]
    if all(g["device"] == "cpu" for g in groups):
        device = non_layer_bytes(model, managers) + sum(g["ring_bytes"] + g["resident_bytes"] for g in groups)
        device += sum(m.expert_cache_bytes() for m in managers)
        used += device
        parts.append(f"non-layer weights, rings, resident layers and expert caches {fmt_bytes(device)} (the device "
                     "is host memory)")
    shared = set(hb["groups"]) - {m.layer_name for m in managers}
    text = (f"host budget {fmt_bytes(hb['bytes'])} ({hb['source']}"
            + (", shared with the other components of the pipeline" if shared else "") + f"): {fmt_bytes(used)} "
            f"used by this model ({100 * used / hb['bytes']:.0f}%)" if hb["bytes"] else
            f"host budget 0 B ({hb['source']}): {fmt_bytes(used)} used by this model")
    text += f"; {', '.join(parts)}"
    return {"bytes": hb["bytes"], "source": hb["source"], "used_bytes": used, "arena_bytes": arena,
            "staging_bytes": staging, "text": text}


def _row(m, s: dict) -> dict:
    last = s["last_step"]
    has = last is not None
    copy_s = last.get("copy_s") if has else None
    row = {
        "group": s["group"], "device": s.get("device", ""), "layers": s["layers"],
        "resident": len(s["resident_layers"]), "resident_of": f"{len(s['resident_layers'])} of {s['layers']}",
        "slots": s["slots"], "prefetch_depth": s.get("prefetch_depth"), "steps": s["steps"], "has_last_step": has,
        "bytes_per_step": last["bytes_copied"] if has else None,
        "mib_per_step": last["bytes_copied"] / 2**20 if has else None,
        "copies_per_step": last.get("copies") if has else None,
        "sync_loads_per_step": last.get("sync_loads") if has else None,
        # None where the engine did not time this step's stall (sampled, or events still pending).
        "stall_ms_per_step": last["stall_s"] * 1e3 if has and last.get("stall_s") is not None else None,
        # Over the time copies were in flight, never over wall time (which includes compute).
        "copy_s_per_step": copy_s,
        "gbps": last["bytes_copied"] / copy_s / 1e9 if copy_s else None,
        "sync_loads": s["sync_loads"], "bytes_copied": s["bytes_copied"], "copies": s["copies"],
        "stall_s": s["stall_s"],
        "arena_bytes": s["arena_bytes"], "arena_mib": s["arena_bytes"] / 2**20, "arena_pinned": s["arena_pinned"],
        "pin_memory": getattr(m, "pin_memory", None), "pin_error": _pin_error(s),
        "ring_bytes": s["ring_bytes"], "ring_mib": s["ring_bytes"] / 2**20,
        # compress="lossless": bytes the same loads hold uncompressed, and the codec's figures
        "raw_bytes_per_step": last.get("bytes_raw") if has else None,
        "compress": s.get("compress"),
        "compress_ratio": (s.get("compress") or {}).get("ratio"),
        "resident_bytes": s["resident_bytes"], "resident_mib": s["resident_bytes"] / 2**20,
        "side_tensor_bytes": s.get("side_tensor_bytes", 0),
        "disk": s.get("disk"),
        "disk_bytes_per_step": last.get("bytes_read") if has and s.get("disk") else None,
        "disk_wait_ms_per_step": last["read_wait_s"] * 1e3 if has and s.get("disk") else None,
        "share_host": s.get("share_host"),  # runtime/host_share.py: role, key, holders, shared / private bytes
        "split_fetch": s.get("split_fetch"),  # stages/split/: shares, bytes copied locally / gathered, waits
        "experts": s.get("experts"),  # experts="routed" (stages/experts.py): hits, misses, speculative bytes, cache
        "step_ms": last["wall_s"] * 1e3 if has and last.get("wall_s") is not None else None,
        "recent": _recent(s.get("recent_steps") or ([last] if has else [])),
        "saves_nothing": streaming_saves_nothing(m),
        "placement": s.get("placement"),
        "host_budget": m.host_budget,
    }
    row["summary"] = _summary(row)
    return row


def report(model, sync: bool = False) -> Report:
    """Telemetry of every group streamed in `model`: per step (the last complete
    one, once a forward has completed) and in total; bytes streamed, copies,
    synchronous loads, compute-stream stall, GB/s while copies were in flight
    (where the engine measures that time; never over wall time), arena / ring /
    resident bytes. Printed: a table, then a plain line per group. Never waits for the
    device unless sync=True. A model that is not offloaded gives a NotOffloaded
    report that says so, not an error."""
    managers = managers_of(model)
    if not managers:
        return NotOffloaded(offloaded=False, groups=[], total=None, host_budget=None,
                            text=f"{type(model).__name__} is not offloaded: no layer group streams "
                                 "(layerwise.configure_layerwise_offload or load_offloaded streams one)")
    # Non-blocking by default: a server can call this per request without draining the
    # device; sync=True waits for every copy first so that every figure is final.
    stats = [m.stats(sync=sync) for m in managers]
    groups = [_row(m, st) for m, st in zip(managers, stats)]
    total = {"group": "total", "layers": sum(g["layers"] for g in groups),
             "resident": sum(g["resident"] for g in groups), "slots": sum(g["slots"] for g in groups),
             "arena_pinned": all(g["arena_pinned"] for g in groups if g["arena_bytes"])}
    total["steps"] = max((g["steps"] for g in groups), default=0)
    total["resident_of"] = f"{total['resident']} of {total['layers']}"
    for key in ("bytes_per_step", "mib_per_step", "copies_per_step", "sync_loads_per_step", "stall_ms_per_step",
                "copy_s_per_step", "disk_bytes_per_step", "disk_wait_ms_per_step"):
        vals = [g[key] for g in groups]
        total[key] = sum(vals) if all(v is not None for v in vals) else None
    for key in ("sync_loads", "bytes_copied", "copies", "stall_s", "arena_bytes", "arena_mib", "ring_bytes",
                "ring_mib", "resident_bytes", "resident_mib", "side_tensor_bytes"):
        total[key] = sum(g[key] for g in groups)
    # Copy time summed over groups: copies of consecutive groups rarely overlap, so this errs low.
    copy_s = total["copy_s_per_step"]
    total["gbps"] = total["bytes_per_step"] / copy_s / 1e9 if copy_s and total["bytes_per_step"] else None
    steps = [g["step_ms"] for g in groups if g["step_ms"] is not None]
    total["step_ms"] = max(steps) if steps else None  # every group runs inside the same model step
    return Report(offloaded=True, groups=groups, total=total, host_budget=_host_budget(model, managers, groups))
