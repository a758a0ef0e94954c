"""layerwise.report(model): what streaming costs and moves, across every group."""
from __future__ import annotations

from .configure import managers_of

_COLUMNS = [
    ("group", "group", str), ("layers", "layers", str), ("resident", "resident", str), ("slots", "slots", str),
    ("MiB/step", "mib_per_step", "{:.1f}".format), ("copies/step", "copies_per_step", str),
    ("sync loads", "sync_loads", str), ("stall ms/step", "stall_ms_per_step", "{:.2f}".format),
    ("GB/s", "gbps", "{:.2f}".format), ("arena MiB", "arena_mib", "{:.1f}".format),
    ("pinned", "arena_pinned", str), ("ring MiB", "ring_mib", "{:.1f}".format),
    ("resident MiB", "resident_mib", "{:.1f}".format),
]


class Report(dict):
    """A dict ({"groups": [...], "total": {...}}) that prints as a table."""

    def __str__(self) -> str:
        rows = self["groups"] + [self["total"]]
        cells = [[h for h, _, _ in _COLUMNS]]
        for r in rows:
            cells.append([fmt(r[k]) if r.get(k) is not None else "-" for _, k, fmt in _COLUMNS])
        widths = [max(len(row[c]) for row in cells) for c in range(len(_COLUMNS))]
        lines = ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)


def _row(s: dict) -> dict:
    last = s["last_step"] or {}
    wall = last.get("wall_s")
    return {
        "group": s["group"], "layers": s["layers"], "resident": len(s["resident_layers"]), "slots": s["slots"],
        "steps": s["steps"], "bytes_per_step": last.get("bytes_copied"),
        "mib_per_step": last["bytes_copied"] / 2**20 if last else None,
        "copies_per_step": last.get("copies"), "sync_loads": s["sync_loads"],
        "stall_ms_per_step": last["stall_s"] * 1e3 if last else None,
        "gbps": last["bytes_copied"] / wall / 1e9 if wall else None,
        "bytes_copied": s["bytes_copied"], "copies": s["copies"], "stall_s": s["stall_s"],
        "arena_bytes": s["arena_bytes"], "arena_mib": s["arena_bytes"] / 2**20, "arena_pinned": s["arena_pinned"],
        "ring_bytes": s["ring_bytes"], "ring_mib": s["ring_bytes"] / 2**20,
        "resident_bytes": s["resident_bytes"], "resident_mib": s["resident_bytes"] / 2**20,
    }


def report(model) -> Report:
    """Telemetry of every group streamed in `model`: per step (the last complete
    one) and in total; bytes streamed, copies, synchronous loads, compute-stream
    stall, achieved GB/s over the step, arena / ring / resident bytes."""
    managers = managers_of(model)
    if not managers:
        raise RuntimeError(f"{type(model).__name__} is not configured for layerwise offload")
    stats = [m.stats() for m in managers]  # each synchronises the device on CUDA: once
    groups = [_row(st) for st in stats]
    total = {"group": "total", "layers": sum(g["layers"] for g in groups),
             "resident": sum(g["resident"] for g in groups), "slots": sum(g["slots"] for g in groups),
             "arena_pinned": all(g["arena_pinned"] for g in groups)}
    for key in ("bytes_per_step", "mib_per_step", "copies_per_step", "stall_ms_per_step"):
        vals = [g[key] for g in groups]
        total[key] = sum(vals) if all(v is not None for v in vals) else None
    for key in ("sync_loads", "bytes_copied", "copies", "stall_s", "arena_bytes", "arena_mib", "ring_bytes",
                "ring_mib", "resident_bytes", "resident_mib"):
        total[key] = sum(g[key] for g in groups)
    walls = [st["last_step"] for st in stats]
    wall = max((w.get("wall_s") or 0) for w in walls if w) if any(walls) else 0
    total["gbps"] = total["bytes_per_step"] / wall / 1e9 if wall and total["bytes_per_step"] else None
    return Report(groups=groups, total=total)
