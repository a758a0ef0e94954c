"""Output of a run: each suite's table as the suite finishes, a summary of
every suite and the legend at the end (rich when importable, else plain
text), the Markdown and JSON files with every figure and the environment
(rewritten after every suite), and the stream plot.

Units: sizes in MiB (2^20 bytes), bandwidths in GiB/s (2^30 bytes per
second), so a bandwidth is the MiB it moved / 1024 over the seconds it took."""
from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import platform
import socket
import sys
import textwrap

import torch

import layerwise
from layerwise.bench.common import Row, Stat, SuiteResult, fmt_num, fmt_value

WIDTH = 120  # the default table, its notes and its legend fit this many columns

# The default table: one column per question a reader asks (what, how fast,
# compared with what, target met?). The suite is a section row, baselines'
# own figures and target labels move to --wide (targets are listed under the
# table), notes become numbered footnotes.
COLUMNS = ("measured", "ours: median [q20, q80]", "unit", "vs baseline", "met")
# Widest each column may be (plain text: 109 + 4 gaps of 2 = 117; rich shrinks them to fit WIDTH).
CAPS = (44, 23, 8, 30, 4)
WIDE_COLUMNS = ("suite", "measured", "unit", "ours: median [q20, q80]", "baselines", "ratio", "target", "met")

SUITE_TITLES = {
    "h2d": "copy bandwidth out of layerwise's pinned host arena (to the device; on a CPU, host to host)",
    "scatter": "Triton scatter of a packed layer into its tensors",
    "stream": "step time of a DiT-like stack whose layers are streamed",
    "startup": "configuring a multi-group model: bytes moved, memory, time",
    "hooks": "CPU time of the offload hooks per layer",
    "compress": "lossless compression of weights: ratio vs ZipNN and the entropy bounds, C++ encode/decode, "
                "Triton decode",
    "bus": "the stream sweep over the CPU backend's simulated bus (its speed set from the compute)",
    "tune": "layerwise.tune against the leading and strided policies at one device budget",
    "quant": "a quantized model streamed as its quantized bytes (torchao, optimum-quanto), beside bf16",
    "split": "split fetch over torch.distributed: N ranks each fetch 1/N of a layer, then all-gather",
    "shared": "share_host: N processes stream one model from one shared host arena, against N separate arenas",
    "compile": "torch.compile(fullgraph=True) of a streamed model beside eager and resident (simulated bus)",
    "moe": "routed experts: bytes per token and step of tiny MoE models against the ideal (simulated bus)",
    "cohort": "K concurrent calls of one streamed model (run_together) against the same calls one after another "
              "(simulated bus)",
}


def _met(row: Row) -> str:
    return {None: "n/a", True: "yes", False: "NO"}[row.met]


def _baselines(row: Row, sep: str) -> str:
    return sep.join(f"{k}: {fmt_value(v.median if isinstance(v, Stat) else v)}" for k, v in row.baselines.items())


def _ratios(row: Row, sep: str) -> str:
    return sep.join(f"{fmt_num(v)} {k}" for k, v in row.ratios.items())


def _wide_cells(row: Row, sep: str) -> list[str]:
    return [
        row.suite, row.measure + (f" ({row.note})" if row.note else ""), row.unit, fmt_value(row.ours),
        _baselines(row, sep), _ratios(row, sep), sep.join(t.label for t in row.targets) or "n/a", _met(row),
    ]


class _Notes:
    """Footnotes of the default table, numbered in order of first use; the same text shares a number."""

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.cut = False  # a Markdown row lost ratios to fit WIDTH

    def mark(self, text: str) -> str:
        if text not in self.texts:
            self.texts.append(text)
        return f"[{self.texts.index(text) + 1}]"


def _cells(row: Row, notes: _Notes) -> list[str]:
    """The default table's cells: a short label with footnote marks (the row's note,
    the targets it missed), our figure, the unit, the ratios to the baselines (or,
    without ratios, the baselines' figures) and whether the targets are met."""
    marks = []
    if row.note:
        marks.append(notes.mark(row.note))
    missed = [t.label for t in row.targets if not t.met]
    if missed:
        marks.append(notes.mark("target missed: " + "; ".join(missed)))
    label = " ".join([row.short or row.measure, *marks])
    return [label, fmt_value(row.ours), row.unit, _ratios(row, "; ") or _baselines(row, "; "), _met(row)]


def _section(res: SuiteResult) -> str:
    """The section line of a suite: what it measures, or why it did not run."""
    if res.status != "ok":
        return f"{res.name}: {res.status}: {res.reason}"
    title = SUITE_TITLES.get(res.name)
    return f"{res.name}: {title}" if title else res.name


def _status_line(res: SuiteResult) -> str:
    return f"{res.status}: {res.reason}"


# ----------------------------------------------------------------- legend
def _wrap(text: str, width: int = WIDTH, indent: str = "") -> list[str]:
    """`text` wrapped at spaces; continuation lines under the text after a bullet
    ("- "), else indented 2 more."""
    more = " " * len(indent) if indent.strip() else indent + "  "
    return textwrap.wrap(text, width, initial_indent=indent, subsequent_indent=more,
                         break_long_words=False, break_on_hyphens=False) or [indent]


def _legend_items(results: list[SuiteResult], text: str, wide: bool) -> list[str]:
    """What the table's columns and abbreviations mean; an entry only when the
    table uses what it explains (`text`: everything the table shows)."""
    from layerwise.bench.stream import COMPUTE_BOUND, TRANSFER_BOUND

    rows = [row for res in results for row in res.rows]

    items = [
        "ours: layerwise's figure; median [q20, q80] over the timed repetitions (20th and 80th percentiles, "
        "always within the measured range); a figure without a range is a single value (a count, a peak, a "
        "worst case).",
        ("ratio" if wide else "vs baseline") + ": ours divided by the named baseline's figure (\"0.810 /torch "
        "copy_\": 0.81 times what torch's copy_ achieved); for times below 1 is better, for GiB/s above 1."
        + ("" if wide else " A row without a ratio shows the baselines' own figures."),
        "met: yes = every target of the row holds, NO = one is missed"
        + (" (its footnote names it)" if not wide else "") + ", n/a = no target for this row on this device.",
    ]
    if "C/T" in text:
        items.append(
            "C/T = time the block's compute takes / time its weights take to cross the bus (resident step time "
            "over streamed bytes at the bandwidth measured in the same run); above 1 the copy hides behind "
            f"compute (compute-bound), below 1 the bus is the limit (transfer-bound). A point counts as "
            f"compute-bound from C/T {COMPUTE_BOUND:g}, as transfer-bound up to {TRANSFER_BOUND:g} (balanced in "
            "between); that decides its target on CUDA and over the CPU backend's simulated bus (the bus "
            "suite, the quant suite's \"bus step\" rows). Elsewhere on a CPU the \"bus\" is a host memory copy.")
    if " tok" in text:
        items.append("N tok: tokens per step, the batch each block processes.")
    if "d=" in text:
        items.append("d=N: layerwise with prefetch depth N, the copies of the next N layers in flight while a layer "
                     "computes.")
    if "floor" in text:
        items.append("floor = max(resident step, streamed bytes / measured bandwidth): the fastest a streamed step "
                     "can be" + ("; for the disk tier also at least its read floor (disk bytes / the best plain "
                                 "O_DIRECT bandwidth of the run)." if "read floor" in text else "."))
    if "resident" in text:
        items.append("resident: the whole model kept on the device, no streaming.")
    if "compiled twin" in text:
        items.append("eager / compiled: the model as is / under torch.compile (\"/eager\", \"/compiled\": against the "
                     "resident model run so); compiled twin: configured with every layer resident (nothing streams) "
                     "and compiled like the streamed model, so with its operator boundaries around every block: the "
                     "reference compiled streaming equals bitwise (the plain compiled model may differ in the last "
                     "bits, inductor fusing across blocks there).")
    if "RSS" in text:
        items.append("RSS: resident set size, the host memory the process holds.")
    glossary = [("us", "microseconds"), ("ms", "milliseconds"), ("s", "seconds"), ("GiB/s", "2^30 bytes per second"),
                ("MiB", "2^20 bytes"), ("B/B", "bytes per byte"), ("x", "times (a ratio)")]
    tokens = {row.unit for row in rows} | {row.unit.split("/")[0] for row in rows}
    used = [f"{u} = {meaning}" for u, meaning in glossary if u in tokens]
    if used:
        items.append("Units: " + ", ".join(used) + ".")
    if "d2d" in text:
        items.append("d2d = device to device.")
    return items


def _targets_items(results: list[SuiteResult]) -> list[str]:
    """The targets behind the met column, per suite (the default table has no target column)."""
    items = []
    for res in results:
        labels = list(dict.fromkeys(t.label for row in res.rows for t in row.targets))
        if labels:
            items.append(f"{res.name}: " + "; ".join(labels) + ".")
    return items


def _below(results: list[SuiteResult], notes: _Notes | None, text: str, wide: bool, bullet: str,
           legend: bool = True) -> list[str]:
    """The lines under the table: footnotes, targets, legend (unless not `legend`),
    each entry wrapped to WIDTH."""
    lines: list[str] = []
    if notes is not None and notes.texts:
        lines += ["", "Notes:"]
        for k, note in enumerate(notes.texts, 1):
            lines += _wrap(f"[{k}] {note}", indent=bullet)
    targets = [] if wide else _targets_items(results)
    if targets:
        lines += ["", "Targets (the met column):"]
        for item in targets:
            lines += _wrap(item, indent=bullet)
    if not legend:
        return lines
    lines += ["", "Legend:"]
    items = _legend_items(results, text, wide)
    if notes is not None and notes.cut:
        items.append("...: more ratios, too many for 120 columns; --wide shows them all.")
    for item in items:
        lines += _wrap(item, indent=bullet)
    return lines


# ------------------------------------------------------------------ table
def _has_rich() -> bool:
    try:
        import rich  # noqa: F401
    except ImportError:
        return False
    return True


def render_table(results: list[SuiteResult], file=None, wide: bool = False) -> None:
    """Every row of every suite, then notes, targets and the legend. The default
    table fits WIDTH columns; `wide`: every column, as wide as it takes."""
    file = file or sys.stdout
    (render_rich if _has_rich() else render_plain)(results, file, wide)


def render_suite(res: SuiteResult, file=None, wide: bool = False) -> None:
    """One suite's table, printed as soon as the suite finishes: its section, its
    rows, its notes and the targets behind its met column (the legend comes once,
    with the summary). Flushed, so a pipe sees it now."""
    file = file or sys.stdout
    if _has_rich():
        render_rich([res], file, wide, title=None, legend=False, fixed=True)
    else:
        render_plain([res], file, wide, legend=False)
    print(file=file)
    file.flush()


SUMMARY_COLUMNS = ("suite", "result", "targets met", "time")
SUMMARY_CAPS = (10, 80, 16, 8)  # 114 + 3 gaps of 2 = 120


def _summary_cells(res: SuiteResult) -> list[str]:
    n = len(res.rows)
    result = {"ok": f"{n} row{'' if n == 1 else 's'}", "skipped": f"skipped: {res.reason}",
              "error": f"FAILED: {res.reason}"}[res.status]
    judged = [row for row in res.rows if row.met is not None]
    met = f"{sum(row.met for row in judged)} of {len(judged)} row{'' if len(judged) == 1 else 's'}" if judged \
        else "no target here"
    return [res.name, result, met, f"{res.wall_s:.0f} s"]


def _missed(results: list[SuiteResult]) -> list[str]:
    return [f"{res.name}: {row.short or row.measure}: " + "; ".join(t.label for t in row.targets if not t.met)
            for res in results for row in res.rows if row.met is False]


def render_summary(results: list[SuiteResult], file=None, wide: bool = False, interrupted: str = "") -> None:
    """After the last suite (or an interruption): one line per suite (rows, how
    many met their targets, time), the rows that missed a target, then the legend
    of every table printed before."""
    file = file or sys.stdout
    cells = [_summary_cells(res) for res in results]
    total = sum(res.wall_s for res in results)
    title = f"Summary: {len(results)} suite(s) in {total:.0f} s" + (
        f", interrupted during {interrupted} (the suites before it are kept)" if interrupted else "")
    if _has_rich():
        from rich.console import Console
        from rich.markup import escape
        from rich.table import Table

        console = Console(file=file, width=min(Console(file=file).width, WIDTH) if file.isatty() else WIDTH)
        console.print(escape(title), soft_wrap=False)
        table = Table(width=console.width)
        for c, cap in zip(SUMMARY_COLUMNS, SUMMARY_CAPS):
            table.add_column(c, overflow="fold", max_width=cap, ratio=cap)
        for res, row in zip(results, cells):
            marked = [escape(c) for c in row]
            style = {"ok": "", "error": "bold red", "skipped": "yellow"}[res.status]
            if style:
                marked[1] = f"[{style}]{marked[1]}[/{style}]"
            if _missed([res]):
                marked[2] = f"[bold red]{marked[2]}[/bold red]"
            table.add_row(*marked)
        console.print(table)
    else:
        for line in _wrap(title):
            print(line, file=file)
        _plain_rows([list(SUMMARY_COLUMNS)] + cells, SUMMARY_CAPS, file, header=True)
    missed = _missed(results)
    lines = ["", "Targets missed:" if missed else "Targets missed: none."]
    for item in missed:
        lines += _wrap(item, indent="  ")
    # the legend explains what the tables above showed
    notes = None if wide else _Notes()
    shown = [_wide_cells(row, "; ") if wide else _cells(row, notes) for res in results for row in res.rows]
    lines += ["", "Legend:"]
    for item in _legend_items(results, _table_text(results, shown), wide):
        lines += _wrap(item, indent="  ")
    for line in lines:
        print(line, file=file)
    file.flush()


def _plain_rows(rows: list[list[str]], caps, file, header: bool = False) -> None:
    """Rows of cells as plain text, each cell wrapped to its column's width (at most
    its cap; continuations of the first cell indented), a rule under the header."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    if caps is not None:
        widths = [min(w, cap) for w, cap in zip(widths, caps)]
    for k, cells in enumerate(rows):
        wrapped = [textwrap.wrap(c, w, subsequent_indent="    " if i == 0 else "", break_on_hyphens=False) or [""]
                   for i, (c, w) in enumerate(zip(cells, widths))]
        for j in range(max(len(w) for w in wrapped)):
            parts = [(w[j] if j < len(w) else "").ljust(width) for w, width in zip(wrapped, widths)]
            print("  ".join(parts).rstrip(), file=file)
        if header and k == 0:
            print("  ".join("-" * w for w in widths), file=file)


def _table_text(results: list[SuiteResult], cells: list[list[str]]) -> str:
    return " ".join([_section(res) for res in results] + [c for row in cells for c in row])


def render_rich(results: list[SuiteResult], file, wide: bool = False, title: str | None = "layerwise benchmark",
                legend: bool = True, fixed: bool = False) -> None:
    """The table with rich; `fixed`: as wide as the console allows (at most WIDTH),
    every column but the label at its CAPS width, so that the tables of one suite
    after another line up."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    tty = file.isatty()
    if wide:
        console = Console(file=file, width=None if tty else 1000)
    else:
        console = Console(file=file, width=min(Console(file=file).width, WIDTH) if tty else WIDTH)
    columns, caps = (WIDE_COLUMNS, [None] * len(WIDE_COLUMNS)) if wide else (COLUMNS, CAPS)
    fixed = fixed and not wide
    table = Table(title=title, show_lines=True, width=console.width if fixed else None)
    for c, cap in zip(columns, caps):
        # (fixed: the label column takes what the others, at their widest, leave)
        shares = fixed and c == "measured"
        table.add_column(escape(c), overflow="fold", max_width=cap, ratio=cap if shares else None,
                         width=cap if fixed and not shares else None)
    notes = None if wide else _Notes()
    shown = []
    for res in results:
        if not wide or res.status != "ok":
            style = {"ok": "bold", "error": "red", "skipped": "yellow"}[res.status]
            text = _section(res) if not wide else res.name
            first = [f"[{style}]{escape(text)}[/{style}]"]
            if wide:
                first.append(f"[{style}]{escape(_status_line(res))}[/{style}]")
            table.add_row(*first, *[""] * (len(columns) - len(first)))
        for row in res.rows:
            cells = _wide_cells(row, "\n") if wide else _cells(row, notes)
            shown.append(cells)
            marked = [escape(c) for c in cells]
            marked[-1] = {"yes": "[green]yes[/green]", "NO": "[bold red]NO[/bold red]"}.get(cells[-1], marked[-1])
            table.add_row(*marked)
    console.print(table)
    for line in _below(results, notes, _table_text(results, shown), wide, "  ", legend):
        print(line, file=file)


def render_plain(results: list[SuiteResult], file, wide: bool = False, legend: bool = True) -> None:
    """The table as plain text (no rich). Default: a suite's line, then its rows
    indented under it, every cell wrapped to CAPS (continuations indented)."""
    columns = WIDE_COLUMNS if wide else COLUMNS
    notes = None if wide else _Notes()
    body: list[tuple[str, list[str]]] = []  # ("section", [text]) or ("row", cells)
    shown = []
    for res in results:
        if wide:
            if res.status != "ok":
                body.append(("row", [res.name, _status_line(res)] + [""] * (len(columns) - 2)))
        else:
            body.append(("section", [_section(res)]))
        for row in res.rows:
            cells = _wide_cells(row, "; ") if wide else _cells(row, notes)
            shown.append(cells)
            body.append(("row", cells if wide else ["  " + cells[0]] + cells[1:]))
    rows = [cells for kind, cells in body if kind == "row"] + [list(columns)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(columns))]
    if not wide:
        widths = [min(w, cap) for w, cap in zip(widths, CAPS)]

    def emit(cells: list[str]) -> None:
        wrapped = [textwrap.wrap(c, w, subsequent_indent="    " if i == 0 else "", break_on_hyphens=False) or [""]
                   for i, (c, w) in enumerate(zip(cells, widths))]
        for k in range(max(len(w) for w in wrapped)):
            parts = [(w[k] if k < len(w) else "").ljust(width) for w, width in zip(wrapped, widths)]
            print("  ".join(parts).rstrip(), file=file)

    emit(list(columns))
    print("  ".join("-" * w for w in widths), file=file)
    for kind, cells in body:
        if kind == "section":
            for line in _wrap(cells[0]):
                print(line, file=file)
        else:
            emit(cells)
    for line in _below(results, notes, _table_text(results, shown), wide, "  ", legend):
        print(line, file=file)


def write_markdown(path: str, results: list[SuiteResult], env: dict, wide: bool = False) -> None:
    """The table as Markdown, headed by the command, machine and date (for
    BENCHMARKS.md), then notes, targets and the legend. By default every line
    fits WIDTH columns: a suite is a section row, and a row that would still
    be too long loses its last ratios ("..."; --wide has them all)."""
    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(cell(c) for c in cells) + " |"

    head = (f"Command: `python -m layerwise.bench {' '.join(env['argv'])}` on {env['device_name']} "
            f"({env['device']}, {env['cpu_count']} CPUs, torch {env['torch']}, "
            f"{env['torch_threads']} compute thread(s)), {env['date']}")
    columns = WIDE_COLUMNS if wide else COLUMNS
    lines = (_wrap(head, indent="") if not wide else [head]) + ["", line(list(columns)), "|" + "---|" * len(columns)]
    notes = None if wide else _Notes()
    shown = []
    for res in results:
        if wide:
            if res.status != "ok":
                lines.append(line([res.name, _status_line(res)] + [""] * (len(columns) - 2)))
        else:
            style = "**" if res.status == "ok" else "_"
            lines.append(line([f"{style}{_section(res)}{style}"] + [""] * (len(columns) - 1)))
        for row in res.rows:
            cells = _wide_cells(row, "; ") if wide else _cells(row, notes)
            shown.append(cells)
            text = line(cells)
            if not wide:
                ratios = [f"{fmt_num(v)} {k}" for k, v in row.ratios.items()]
                while len(text) > WIDTH and ratios:  # (a row's footnote numbers vary from run to run)
                    ratios.pop()
                    cells = cells[:3] + ["; ".join(ratios + ["..."])] + cells[4:]
                    text = line(cells)
                    notes.cut = True
            lines.append(text)
    lines += _below(results, notes, _table_text(results, shown), wide, "- ")
    with _replacing(path) as tmp, open(tmp, "w") as f:
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
    with _replacing(path) as tmp, open(tmp, "w") as f:
        json.dump(_jsonable(doc), f, indent=1, allow_nan=False)
        f.write("\n")


@contextlib.contextmanager
def _replacing(path: str):
    """A temporary name beside `path`, moved over `path` once written: a run stopped
    while a file is rewritten after a suite keeps the previous complete file."""
    tmp = f"{path}.tmp"
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


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
            label=f"transfer at {stream.data['h2d_bandwidth_GiBps']:.1f} GiB/s")
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
    with _replacing(path) as tmp:
        fig.savefig(tmp, format=os.path.splitext(path)[1][1:] or "png")
    plt.close(fig)
