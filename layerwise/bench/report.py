"""Output of a run: the final table (rich when importable, else plain text),
the JSON file with every figure and the environment, and the stream plot."""
from __future__ import annotations

import datetime
import json
import math
import os
import platform
import socket
import sys

import torch

import layerwise

from .common import Row, Stat, SuiteResult, fmt_num, fmt_value

COLUMNS = ("suite", "measured", "unit", "ours [q20-q80]", "baselines", "ratio", "target", "met")


def _met(row: Row) -> str:
    return {None: "n/a", True: "yes", False: "NO"}[row.met]


def _cells(row: Row, sep: str) -> list[str]:
    return [
        row.suite, row.measure + (f" ({row.note})" if row.note else ""), row.unit, fmt_value(row.ours),
        sep.join(f"{k}: {fmt_value(v.median if isinstance(v, Stat) else v)}" for k, v in row.baselines.items()),
        sep.join(f"{fmt_num(v)} {k}" for k, v in row.ratios.items()),
        sep.join(t.label for t in row.targets) or "n/a", _met(row),
    ]


def _status_line(res: SuiteResult) -> str:
    return f"{res.status}: {res.reason}"


def render_table(results: list[SuiteResult], file=None) -> None:
    """Every row of every suite; skipped and failed suites get one line saying why."""
    file = file or sys.stdout
    try:
        from rich.console import Console
        from rich.markup import escape
        from rich.table import Table
    except ImportError:
        _render_plain(results, file)
        return
    table = Table(title="layerwise benchmark", show_lines=True)
    for c in COLUMNS:
        table.add_column(escape(c), overflow="fold")
    for res in results:
        if res.status != "ok":
            style = "red" if res.status == "error" else "yellow"
            table.add_row(res.name, f"[{style}]{escape(_status_line(res))}[/{style}]", *[""] * (len(COLUMNS) - 2))
        for row in res.rows:
            cells = [escape(c) for c in _cells(row, "\n")]
            cells[-1] = {"yes": "[green]yes[/green]", "NO": "[bold red]NO[/bold red]"}.get(cells[-1], cells[-1])
            table.add_row(*cells)
    width = None if file.isatty() else 200
    Console(file=file, width=width).print(table)


def _render_plain(results: list[SuiteResult], file) -> None:
    lines = [list(COLUMNS)]
    for res in results:
        if res.status != "ok":
            lines.append([res.name, _status_line(res)] + [""] * (len(COLUMNS) - 2))
        lines += [_cells(row, "; ") for row in res.rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(COLUMNS))]
    for k, line in enumerate(lines):
        print("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip(), file=file)
        if k == 0:
            print("  ".join("-" * w for w in widths), file=file)


def write_markdown(path: str, results: list[SuiteResult], env: dict) -> None:
    """The table as Markdown, headed by the command, machine and date (for BENCHMARKS.md)."""
    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    lines = [
        f"`python -m layerwise.bench {' '.join(env['argv'])}` on {env['device_name']} "
        f"({env['device']}, {env['cpu_count']} CPUs, torch {env['torch']}, {env['torch_threads']} compute thread(s)), "
        f"{env['date']}",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    for res in results:
        if res.status != "ok":
            lines.append("| " + " | ".join([res.name, cell(_status_line(res))] + [""] * (len(COLUMNS) - 2)) + " |")
        lines += ["| " + " | ".join(cell(c) for c in _cells(row, "; ")) + " |" for row in res.rows]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


# ------------------------------------------------------------------- JSON
def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(device: torch.device, argv: list[str], args: dict) -> dict:
    try:
        import triton

        triton_version = triton.__version__
    except Exception:  # noqa: BLE001 - Triton is optional
        triton_version = None
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "hostname": socket.gethostname(),
        "cpu_count": os.cpu_count(),
        "device": str(device),
        "device_name": device_name(device),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton_version,
        "layerwise": layerwise.__version__,
        "build_info": layerwise.build_info(),
        "argv": argv,
        "args": args,
    }


def _jsonable(x):
    """Plain JSON values: Stats and rows as dicts, NaN/inf as null, anything else as str."""
    if isinstance(x, (Stat, Row)):
        return _jsonable(x.to_json())
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if x is None or isinstance(x, (bool, int, str)):
        return x
    return str(x)


def write_json(path: str, results: list[SuiteResult], env: dict) -> None:
    doc = {
        "environment": env,
        "suites": {
            r.name: {"status": r.status, "reason": r.reason, "wall_s": r.wall_s, "rows": r.rows, "data": r.data}
            for r in results
        },
    }
    with open(path, "w") as f:
        json.dump(_jsonable(doc), f, indent=1, allow_nan=False)
        f.write("\n")


# ------------------------------------------------------------------- plot
def write_plot(path: str, stream: SuiteResult, title: str) -> None:
    """Step time against compute/transfer ratio (log-log), one line per method,
    the bandwidth floor max(resident, transfer) dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator

    points = sorted(stream.data["points"], key=lambda p: p["compute_transfer_ratio"])
    x = [p["compute_transfer_ratio"] for p in points]
    fig, ax = plt.subplots(figsize=(8, 5.5), dpi=120)
    ax.plot(x, [p["floor_ms"] for p in points], "-", color="0.6", lw=7, alpha=0.45, zorder=1,
            label="floor: max(resident, bytes / bandwidth)")
    for name in stream.data["methods"]:
        stats = [p["step_ms"][name] for p in points]
        y = [s.median for s in stats]
        err = [[s.median - s.q20 for s in stats], [s.q80 - s.median for s in stats]]
        ax.errorbar(x, y, yerr=err, marker="o", ms=4, capsize=3, label=name,
                    lw=2.2 if name.startswith("layerwise") else 1.4)
    ax.plot(x, [p["transfer_ms"] for p in points], ":", color="0.4", lw=1.2,
            label=f"transfer at {stream.data['h2d_bandwidth_GBps']:.1f} GB/s")
    for xi, p in zip(x, points):
        ax.annotate(f"{p['tokens']} tok", (xi, 0), xycoords=("data", "axes fraction"), textcoords="offset points",
                    xytext=(0, 4), ha="center", fontsize=7, color="0.35")
    ax.set_xscale("log")
    ax.set_yscale("log")
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        axis.set_major_formatter(plain)
        axis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
    ax.set_xlabel("compute / transfer per layer (resident step time / streamed bytes at measured bandwidth)")
    ax.set_ylabel("step time (ms, median, 20-80% bars)")
    cfg = stream.data["config"]
    ax.set_title(f"{title}\nDiT stack: hidden {cfg['hidden']}, {cfg['layers']} layers, {cfg['dtype']}",
                 fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
