"""Smoke test of `python -m layerwise.bench`: every CPU suite at test sizes
(the hidden --tiny flag), the JSON it writes, the plot, and the exit status
when a suite fails; the table a human reads: 120 columns by default, every
column with --wide, quantiles that stay within what was measured, a legend."""
import io
import json
import math
import random
import re
import subprocess
import sys

import pytest
import torch

from layerwise.bench import cli, hooks, report, stream
from layerwise.bench.common import Context, Row, Skip, Stat, SuiteResult, Target, fmt_value
from layerwise.bench.stream import regime

CPU_SUITES = ["h2d", "stream", "bus", "tune", "startup", "hooks", "quant", "moe", "compile"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    json_path, plot_path = out / "bench.json", out / "stream.png"
    proc = subprocess.run(
        [sys.executable, "-m", "layerwise.bench", "--tiny", "--device", "cpu",
         "--json", str(json_path), "--plot", str(plot_path), "--markdown", str(out / "bench.md")],
        capture_output=True, text=True, timeout=300,
    )
    return proc, json_path, plot_path


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _median(v):
    return v["median"] if isinstance(v, dict) else v


def test_cli_runs_every_cpu_suite(tiny_run):
    proc, json_path, plot_path = tiny_run
    assert proc.returncode == 0, proc.stderr[-4000:]
    for name in CPU_SUITES:
        assert f"[{name}]" in proc.stderr
    assert "met" in proc.stdout and "stream" in proc.stdout  # the table
    assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md_text = (plot_path.parent / "bench.md").read_text()
    md = md_text.splitlines()
    assert md[0].startswith("Command: `python -m layerwise.bench --tiny") and " (cpu, " in md_text  # command, machine
    header = md.index("| measured | ours: median [q20, q80] | unit | vs baseline | met |")
    assert md[header + 1] == "|---|---|---|---|---|"
    # a section is "name: title", or "name" alone for a suite without a title in report.SUITE_TITLES
    sections = [re.match(r"\| [*_]+(\w+)(: |\*\* \|)", line) for line in md
                if line.startswith("| **") or line.startswith("| _")]
    assert {m.group(1) for m in sections if m} == {"h2d", "scatter", "stream", "bus", "tune", "startup", "hooks", "disk", "quant", "moe", "compile"}
    assert "| _scatter: skipped: " in md_text


def test_json_has_environment_and_finite_positive_figures(tiny_run):
    _, json_path, _ = tiny_run
    doc = json.loads(json_path.read_text())
    env = doc["environment"]
    for key in ("date", "hostname", "cpu_count", "device", "device_name", "torch", "triton", "layerwise",
                "build_info", "argv", "args"):
        assert key in env, key
    assert env["device"] == "cpu" and "--tiny" in env["argv"]

    suites = doc["suites"]
    assert set(suites) == {"h2d", "scatter", "stream", "bus", "tune", "startup", "hooks", "disk", "quant", "moe",
                           "compile"}
    assert suites["scatter"]["status"] == "skipped" and "CUDA" in suites["scatter"]["reason"]
    # disk: skipped only where no disk-backed file system is writable (the reason says so)
    assert suites["disk"]["status"] == "ok" or (suites["disk"]["status"] == "skipped" and
                                                "file system" in suites["disk"]["reason"]), suites["disk"]
    for name in CPU_SUITES + (["disk"] if suites["disk"]["status"] == "ok" else []):
        suite = suites[name]
        assert suite["status"] == "ok", (name, suite["reason"])
        assert suite["rows"], name
        for row in suite["rows"]:
            for key in ("suite", "measure", "unit", "ours", "baselines", "ratios", "targets", "met"):
                assert key in row, (name, key)
            ours = _median(row["ours"])
            # a difference of two timings (hook time less the copy wait) may come out 0 at tiny sizes
            assert _finite(ours) and (ours > 0 or "without the copy wait" in row["measure"] and ours == 0), (name, row)
            if isinstance(row["ours"], dict):
                q = row["ours"]
                assert min(q["samples"]) <= q["q20"] <= ours <= q["q80"] <= max(q["samples"]), (name, row)
                assert q["q20"] >= 0, (name, row)  # every figure here is a time, a rate or a size
            assert all(_finite(_median(v)) for v in row["baselines"].values()), (name, row)
            assert all(_finite(v) for v in row["ratios"].values()), (name, row)
            assert row["met"] in (True, False, None)


def test_suite_specific_figures(tiny_run):
    _, json_path, _ = tiny_run
    suites = json.loads(json_path.read_text())["suites"]
    # startup: layerwise moves exactly the non-layer bytes, once, in every order.
    for label in ("2 groups", "3 groups"):
        data = suites["startup"]["data"][label]
        runs = data["runs"]["layerwise"]
        assert len(runs) == (2 if label == "2 groups" else 6)
        assert all(r["to_calls_bytes"] == [data["non_layer_bytes"]] for r in runs)
        # ... while the naive per-group order carries a group not packed yet along.
        naive = data["runs"]["naive per-group"]
        assert max(r["moved_bytes"] for r in naive) > data["non_layer_bytes"]
    # tune: every placement within the one budget, the bus chosen against the compute, tune's row
    # against both policies and its own prediction (the figures of the row, from its data)
    tune = suites["tune"]["data"]
    assert tune["bus"]["gbps"] > 0 and tune["bus_source"].startswith("chosen")
    assert set(tune["placements"]) == {"tune", "leading", "strided"}
    assert all(b <= tune["budget"] for b in tune["device_bytes"].values()), tune["device_bytes"]
    plan = tune["plan"]
    # (the floor's bus time may include a fetch of the next step still crossing at the step's end)
    assert plan["floor_ms"] <= plan["predicted_ms"] * 1.02 and plan["measured_ms"] > 0
    assert "strided, depth 1" in plan["alternatives_ms"] and "in force" in plan["alternatives_ms"]
    (row,) = [r for r in suites["tune"]["rows"] if "layerwise.tune" in r["measure"]]
    ms = tune["step_ms"]
    assert row["ratios"]["/leading"] == pytest.approx(ms["tune"] / ms["leading"])
    assert row["ratios"]["/predicted"] == pytest.approx(ms["tune"] / plan["predicted_ms"])
    assert [t["label"] for t in row["targets"]] == ["<= 1x leading", "<= 1x strided", "<= 1.1x predicted",
                                                    ">= 0.9x predicted"]
    # stream: every point timed every method; CPU rows carry no pass/fail.
    stream = suites["stream"]
    for point in stream["data"]["points"]:
        assert set(point["step_ms"]) == set(stream["data"]["methods"])
        assert point["streamed_bytes"] > 0
    assert all(row["met"] is None for row in stream["rows"])
    # bus: a simulated bus chosen against the compute; every row has the floor, and no step is
    # faster than its bytes over the configured bus (the bus sleeps: whatever the machine's load), less
    # the copies of the first `depth` layers, which the untimed step before it may have done
    # (the main thread descheduled between that step and the clock's start: seen under load)
    bus = suites["bus"]
    assert bus["status"] == "ok", bus["reason"]
    gbps = bus["data"]["bus"]["gbps"]
    assert gbps > 0 and bus["data"]["bus_source"].startswith("chosen")
    for row in bus["rows"]:
        assert "floor" in row["baselines"] and "/floor" in row["ratios"], row
    for p in bus["data"]["points"]:
        for name, last in p["last_step"].items():
            assert last["bytes_copied"] > 0, (name, p)
            ahead = 1 - int(name.split("d=")[1]) / bus["data"]["config"]["layers"]
            assert _median(p["step_ms"][name]) >= 0.95 * ahead * last["bytes_copied"] / (gbps * 1e9) * 1e3, (name, p)
    regimes = {p["regime"] for p in bus["data"]["points"]}
    assert "transfer-bound" in regimes, bus["data"]["points"]
    # quant: every form streamed bitwise (checked in the suite), moving its quantized bytes and no more:
    # about half the bf16 bytes for 8-bit forms, about a quarter for quanto's packed int4.
    quant = suites["quant"]
    assert quant["status"] == "ok", quant["reason"]
    forms = quant["data"]["forms"]
    bf16 = quant["data"]["config"]["bf16_layer_bytes"]
    assert {"bf16", "fp8 (torchao)", "int8 (torchao)", "qint4 (quanto)", "GGUF Q8_0", "GGUF Q4_0"} <= set(forms), (
        set(forms), quant["data"])
    for name, f in forms.items():
        for label, copied in f["bytes_per_step"].items():
            assert copied <= 1.15 * f["quantized_bytes"], (name, label, copied, f["quantized_bytes"])
        if name != "bf16":
            assert f["bytes_per_step"]["layerwise"] < 0.6 * bf16, (name, f)
    assert forms["qint4 (quanto)"]["bytes_per_step"]["layerwise"] < 0.35 * bf16
    assert forms["GGUF Q4_0"]["bytes_per_step"]["layerwise"] < 0.35 * bf16  # 18 bytes per 32 values
    assert forms["bf16"]["bytes_per_step"]["layerwise, compress"] < 0.8 * bf16  # (random-init bf16 weights)
    bytes_rows = [r for r in quant["rows"] if r["measure"].startswith("bytes per step")]
    assert all(r["met"] in (True, None) for r in bytes_rows), [r for r in bytes_rows if r["met"] is False]
    # ... and every step row, without a bus and over the simulated bus chosen for bf16 to be transfer-bound, has
    # its floor max(resident quantized step, bytes per step / measured bandwidth) and ours/floor
    gbps = quant["data"]["bus"]["gbps"]
    assert gbps > 0 and quant["data"]["bus"]["source"].startswith("chosen"), quant["data"]["bus"]
    step_rows = [r for r in quant["rows"] if r["measure"].startswith("step")]
    assert len(step_rows) == 2 * sum(len(f["step"]) for f in forms.values()) > 0
    for name, f in forms.items():
        assert set(f["step"]) == set(f["bus_step"]) == set(f["bytes_per_step"]), (name, f)
        for kind, bandwidth in (("step", quant["data"]["bandwidth_GiBps"]),
                                ("bus_step", quant["data"]["bus"]["bandwidth_GiBps"])):
            for label, d in f[kind].items():
                transfer_ms = d["bytes_per_step"] / (bandwidth * 2**30) * 1e3
                assert d["transfer_ms"] == pytest.approx(transfer_ms)
                assert d["floor_ms"] == pytest.approx(max(_median(d["resident_ms"]), transfer_ms)), (name, label, d)
        for label, d in f["bus_step"].items():  # the bus sleeps (as above; prefetch depth 1)
            assert d["bytes_per_step"] == f["bytes_per_step"][label]
            ahead = 1 - 1 / quant["data"]["config"]["layers"]
            assert _median(d["step_ms"]) >= 0.95 * ahead * d["bytes_per_step"] / (gbps * 1e9) * 1e3, (name, label, d)
    for row in step_rows:
        ours, base = _median(row["ours"]), row["baselines"]
        assert base["floor"] >= _median(base["resident"]) > 0, row
        assert row["ratios"]["/floor"] == pytest.approx(ours / base["floor"]), row
        assert row["ratios"]["/resident"] == pytest.approx(ours / _median(base["resident"])), row
        if row["met"] is False:  # a miss says what the step waited on
            assert "missed: the step waited" in row["note"], row
    bf16_bus = [r for r in step_rows
                if r["measure"].startswith("step over the simulated bus") and ", bf16, layerwise (C/T" in r["measure"]]
    # (the bus is chosen for C/T 0.1 against the compute measured a moment before: the regime the step
    # then shows is the machine's pace; the targets must follow the regime it shows)
    assert len(bf16_bus) == 1, bf16_bus
    labels = [t["label"] for t in bf16_bus[0]["targets"]]
    if "transfer-bound" in bf16_bus[0]["measure"]:
        assert labels == ["<= 1.1x floor"], bf16_bus
    elif "compute-bound" in bf16_bus[0]["measure"]:
        assert labels == ["<= 1.05x resident"], bf16_bus
    else:
        assert labels == [], bf16_bus
    # hooks: the flatness row has its target.
    assert suites["hooks"]["rows"][-1]["targets"]
    # disk: the reader read with O_DIRECT, compared with a plain O_DIRECT read in the same run.
    disk = suites["disk"]
    if disk["status"] == "ok":
        assert disk["data"]["reader_stats"]["runs_direct"] > 0 and disk["data"]["reader_stats"]["failed"] == 0
        # ... against the best plain O_DIRECT read of 1, 2 and 4 threads, not one thread only
        assert disk["rows"][0]["targets"][0]["label"] == ">= 0.9x O_DIRECT best of 1/2/4 threads"
        assert {"O_DIRECT 1 thread", "O_DIRECT 2 threads", "O_DIRECT 4 threads"} <= set(disk["rows"][0]["baselines"])
        bw = disk["data"]["bandwidth_GiBps"]
        best = max(_median(bw[k]) for k in ("O_DIRECT 1 thread", "O_DIRECT 2 threads", "O_DIRECT 4 threads"))
        assert disk["rows"][0]["ratios"]["/O_DIRECT best"] == pytest.approx(_median(bw["reader"]) / best)
        assert disk["data"]["filesystem"] not in ("tmpfs", "ramfs")
        # ... and a model streamed with host_budget at 25%: layers read from the checkpoint every step,
        # host memory within the budget.
        stream = disk["data"]["stream"]
        assert stream["disk_layers"] > 0 and stream["disk_bytes_per_step"] > 0 and stream["bytes_direct"] > 0
        # ... against its floor max(resident step, read floor, bus floor), each figure shown, and on the CPU the
        # same step over a simulated bus
        steps = [r for r in disk["rows"] if r["measure"].startswith(("step, host_budget", "step over the simulated"))]
        assert [r["short"].split(",")[0] for r in steps] == ["step", "bus step"], steps
        for row, d in zip(steps, (stream, stream["over_bus"])):
            base = row["baselines"]
            assert {"resident", "read floor", "bus floor", "floor"} <= set(base), row
            assert base["floor"] == pytest.approx(max(_median(base["resident"]), base["read floor"], base["bus floor"]))
            assert base["floor"] >= _median(base["resident"]) > 0, row
            copied = d["last_step"]["bytes_copied"]
            assert copied >= d["last_step"]["bytes_read"] > 0  # (layers read from disk are copied too)
            assert base["bus floor"] == pytest.approx(copied / (d["h2d_bandwidth_GiBps"] * 2**30)), (row, d)
            assert row["ratios"]["/floor"] == pytest.approx(_median(row["ours"]) / base["floor"]), row
            assert row["ratios"]["/read floor"] == pytest.approx(_median(row["ours"]) / base["read floor"]), row
        assert "in memory" in steps[0]["baselines"] and "/in memory" in steps[0]["ratios"]
        # over the bus: chosen so that its copies take BUS_OVER (4) times the first pass's read floor or resident
        # step, the longer (C/T <= 0.25: transfer-bound with room for a slower second pass) ...
        over = stream["over_bus"]
        assert over["bus_over"] >= 4 and over["chosen_for_s"] == pytest.approx(
            max(stream["read_floor_s"], stream["step_s"]["resident"])), over
        assert over["bus"]["gbps"] * 1e9 * over["bus_over"] * over["chosen_for_s"] == pytest.approx(
            stream["bytes_copied_per_step"], rel=1e-4), over  # (the bus keeps 5 digits of GB/s)
        # ... the row names the regime its own figures show (resident / bus floor) and carries that regime's
        # target (a loaded CI machine can slow the second pass's compute; the targets follow what it shows)
        ct = _median(steps[1]["baselines"]["resident"]) / steps[1]["baselines"]["bus floor"]
        kind = regime(ct)
        assert f"({kind})" in steps[1]["measure"], (ct, steps[1])
        assert [t["label"] for t in steps[1]["targets"]] == {
            "transfer-bound": ["<= 1.1x floor"], "compute-bound": ["<= 1.05x resident"], "balanced": []}[kind], steps
        assert steps[1]["ratios"]["/resident"] == pytest.approx(
            _median(steps[1]["ours"]) / _median(steps[1]["baselines"]["resident"]))
        assert steps[1]["met"] is not False or "missed: the step waited" in steps[1]["note"], steps[1]
        # the bus sleeps: the step over it is no faster than its copies across the configured bus (as above)
        gbps, last = stream["over_bus"]["bus"]["gbps"], stream["over_bus"]["last_step"]
        ahead = 1 - 1 / last["copies"]
        assert _median(steps[1]["ours"]) >= 0.95 * ahead * last["bytes_copied"] / (gbps * 1e9), stream["over_bus"]
        # what the budget promises, measured as memory: anonymous + shared + the checkpoint's cache
        rss = [r for r in disk["rows"] if r["measure"].startswith("host memory of load")]
        assert len(rss) == 1 and rss[0]["met"] is True, rss
        assert rss[0]["targets"][0]["label"].startswith("<= budget + 5%"), rss


# ------------------------------------------------------------ units
# sizes in MiB, bandwidths in GiB/s, nowhere a decimal MB, GB or GB/s beside them
_DECIMAL_UNIT = re.compile(r"\b[KMGT]B(/s)?\b")
UNITS = {"MiB", "GiB/s", "s", "ms", "us", "us/layer", "x", "B/B", ""}


def _row_texts(row: dict) -> list[str]:
    return [row["measure"], row["short"], row["note"], *(t["label"] for t in row["targets"]), *row["baselines"],
            *row["ratios"]]


def test_every_row_uses_mib_and_gib_per_second(tiny_run, tmp_path):
    proc, json_path, _ = tiny_run
    suites = json.loads(json_path.read_text())["suites"]
    units = {row["unit"] for suite in suites.values() for row in suite["rows"]}
    assert units <= UNITS, units - UNITS
    assert {"MiB", "GiB/s"} <= units  # (sizes and bandwidths are both shown)
    for name, suite in suites.items():
        for row in suite["rows"]:
            assert not [t for t in _row_texts(row) if _DECIMAL_UNIT.search(t)], (name, row)
    shown = proc.stdout + (json_path.parent / "bench.md").read_text()
    assert not _DECIMAL_UNIT.findall(shown), sorted({line for line in shown.splitlines() if _DECIMAL_UNIT.search(line)})
    assert "GiB/s = 2^30 bytes per second" in " ".join(proc.stdout.split())  # the legend says so
    # a size in a label is the bytes measured / 2^20
    sizes = suites["h2d"]["data"]["sizes"]
    assert [row["measure"] for row in suites["h2d"]["rows"][:len(sizes)]] == [
        f"{size['bytes'] / 2**20:g} MiB copy" for size in sizes]


# ------------------------------------------------------------ streaming
def test_each_suite_prints_its_rows_as_it_finishes(tmp_path):
    # stdout and stderr in one pipe, as a terminal shows them: each suite's progress
    # line, then its table, before the next suite starts; the summary last
    proc = subprocess.run(
        [sys.executable, "-m", "layerwise.bench", "--tiny", "--device", "cpu", "h2d", "scatter", "hooks",
         "--json", str(tmp_path / "b.json")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300,
    )
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:]
    order = []
    for k, name in enumerate(("h2d", "scatter", "hooks"), 1):
        start = out.index(f"[{name}] suite {k} of 3: {report.SUITE_TITLES[name]}")
        section = re.compile(rf"^\W*{name}: " + ("skipped: " if name == "scatter" else ""), re.M)  # (in a table cell)
        order += [start, section.search(out, start).start()]
    summary = out.index("Summary: 3 suite(s)")
    assert order == sorted(order) and order[-1] < summary, order
    assert out.index("peak over sizes") < order[2]  # the h2d rows, before scatter starts
    assert out.index("Legend:") > summary


def test_progress_line_quotes_the_quick_duration():
    default = {name for name in cli.SUITES if name not in cli.ON_REQUEST}
    assert set(cli.QUICK_CPU_S) == default
    first = next(name for name in cli.SUITES if name not in cli.ON_REQUEST)
    assert first == "h2d"  # a figure within seconds of the start
    cpu = torch.device("cpu")
    assert f"about {cli.QUICK_CPU_S['stream']} s on 2 cores" in cli._expected("stream", Context(cpu, "quick"))
    assert cli._expected("h2d", Context(cpu, "tiny")) == ""  # no figure where none was measured


def test_an_interrupted_run_keeps_the_suites_that_finished(monkeypatch, tmp_path, capsys):
    json_path, md_path = tmp_path / "out.json", tmp_path / "out.md"
    seen = {}

    def first(ctx):
        return SuiteResult("first", rows=[Row("first", "a figure", "ms", 1.0, targets=[Target("< 2 ms", True)])])

    def second(ctx):
        seen["json"] = json.loads(json_path.read_text())  # written when the first suite finished
        raise KeyboardInterrupt

    def third(ctx):
        raise AssertionError("runs after an interruption")

    monkeypatch.setattr(cli, "SUITES", {"first": first, "second": second, "third": third})
    assert cli.main(["--device", "cpu", "--tiny", "--json", str(json_path), "--markdown", str(md_path)]) == 130
    captured = capsys.readouterr()
    assert list(seen["json"]["suites"]) == ["first"]
    assert list(json.loads(json_path.read_text())["suites"]) == ["first"]
    assert "a figure" in md_path.read_text()
    assert "interrupted during second" in captured.err
    assert "Summary: 1 suite(s)" in captured.out and "interrupted during second" in captured.out
    assert not list(tmp_path.glob("*.tmp"))


def test_a_file_rewritten_after_a_suite_is_replaced_whole(monkeypatch, tmp_path):
    # a run stopped while the JSON is rewritten keeps the previous complete file
    path = tmp_path / "out.json"
    one = [SuiteResult("first", rows=[Row("first", "a figure", "ms", 1.0)])]
    report.write_json(str(path), one, {"argv": []})

    def stopped(x):
        raise KeyboardInterrupt

    monkeypatch.setattr(report, "_jsonable", stopped)
    with pytest.raises(KeyboardInterrupt):
        report.write_json(str(path), one + [SuiteResult("second")], {"argv": []})
    assert list(json.loads(path.read_text())["suites"]) == ["first"]
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize("rich", [False, True])
def test_summary_counts_targets_and_lists_the_misses(monkeypatch, rich):
    results = _cuda_like_results()
    results[0].wall_s = 12.3
    results.insert(1, SuiteResult("disk", "skipped", "no disk-backed file system"))
    results.append(SuiteResult("quant", "error", "RuntimeError: boom"))
    monkeypatch.setattr(report, "_has_rich", lambda: rich)
    buf = io.StringIO()
    report.render_summary(results, buf)
    text = buf.getvalue()
    assert not _too_long(text), _too_long(text)
    flat = " ".join(text.split())
    assert "Summary: 7 suite(s) in 12 s" in flat
    for line in text.splitlines():  # h2d: 4 rows with a target (copies of 64 MiB and more, the peak), all met
        if line.lstrip("│ ").startswith("h2d"):
            assert "6 rows" in line and "4 of 4 rows" in line and "12 s" in line, line
            break
    else:
        raise AssertionError(text)
    assert "skipped: no disk-backed file system" in flat and "FAILED: RuntimeError: boom" in flat
    assert "startup: 2 groups: peak host RSS growth, worst order: <= largest layer + 5% of model" in flat
    assert "Legend:" in flat and "C/T = time the block's compute takes" in flat

def test_failing_suite_is_reported_and_the_others_still_run(monkeypatch, tmp_path, capsys):
    def boom(ctx):
        raise RuntimeError("suite exploded")

    def skipped(ctx):
        raise Skip("not here")

    def fine(ctx):
        return SuiteResult("fine", rows=[Row("fine", "a figure", "s", 1.0)])

    monkeypatch.setattr(cli, "SUITES", {"boom": boom, "skipped": skipped, "fine": fine})
    path = tmp_path / "out.json"
    assert cli.main(["--device", "cpu", "--tiny", "--json", str(path)]) == 1
    captured = capsys.readouterr()
    assert "suite exploded" in captured.err and "Traceback" in captured.err
    suites = json.loads(path.read_text())["suites"]
    assert suites["boom"]["status"] == "error" and "suite exploded" in suites["boom"]["reason"]
    assert suites["skipped"] == {**suites["skipped"], "status": "skipped", "reason": "not here"}
    assert suites["fine"]["status"] == "ok"


def test_unknown_suite_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["nope"])
    assert e.value.code == 2
    assert "unknown suite" in capsys.readouterr().err


# ------------------------------------------------------------ the table
WIDTH = 120


def _cuda_like_results() -> list[SuiteResult]:
    """A realistic GPU run (the rows the suites write on CUDA, the stream rows
    made by the suite's own code): the widest case the default table meets,
    with three ratios per stream row, notes and a missed target."""
    rng = random.Random(0)

    def st(m, spread=0.03):
        return Stat.of([m * (1 + rng.uniform(-spread, spread)) for _ in range(9)])

    h2d = SuiteResult("h2d")
    for mb, bw in ((1, 21.5), (16, 48.2), (64, 52.7), (256, 53.1), (1024, 53.0)):
        targets = [Target.at_least(bw / 53.4, 0.95, "pinned copy_")] if mb >= 64 else []
        h2d.rows.append(Row("h2d", f"{mb} MiB copy", "GiB/s", st(bw),
                            {"pinned copy_": st(53.4), "pageable copy_": st(24.9)},
                            {"/pinned copy_": bw / 53.4}, targets,
                            note="" if targets else "small copy: latency-bound, no target"))
    h2d.rows.append(Row("h2d", "peak over sizes", "GiB/s", 53.1, {"pinned copy_": 53.4, "pageable copy_": 25.0},
                        {"/pinned copy_": 0.994}, [Target.at_least(0.994, 0.95, "pinned copy_")]))
    scatter = SuiteResult("scatter", rows=[
        Row("scatter", "layer of 200 small tensors", "us/layer", st(41.2), {"copy_ loop": st(1480.0)},
            {"speedup": 35.9}, [Target(">= 5x faster than copy_ loop", True)]),
        Row("scatter", "100 MiB into 100 contiguous tensors", "GiB/s", st(1650.0),
            {"copy_ loop": st(1480.0), "d2d copy_": st(1890.0)}, {"/d2d copy_": 0.873},
            [Target.at_least(0.873, 0.8, "d2d copy_")]),
        Row("scatter", "96 MiB into 6 transposed tensors", "GiB/s", st(1210.0), {"copy_ loop": st(1190.0)},
            {"/copy_ loop": 1.017}),
    ])
    rows = []
    managers = {"layerwise d=1": None, "layerwise d=2": None}
    others = ["accelerate cpu_offload", "diffusers group offload"]
    for tokens, resident, transfer in ((256, 0.31, 10.7), (4096, 5.2, 10.7), (16384, 21.9, 10.7), (65536, 88.5, 10.7)):
        ms = {"resident": st(resident), "layerwise d=1": st(max(resident, transfer) * 1.02),
              "layerwise d=2": st(max(resident, transfer) * 1.01),
              "accelerate cpu_offload": st(resident + 4 * transfer),
              "diffusers group offload": st(max(resident, transfer) * (1.3 if tokens < 65536 else 0.99))}
        c = resident / transfer
        point = {"tokens": tokens, "compute_transfer_ratio": c, "regime": stream.regime(c), "step_ms": ms,
                 "floor_ms": max(resident, transfer)}
        rows += stream._rows(Context(torch.device("cuda")), point, managers, others, "diffusers group offload")
    sweep = SuiteResult("stream", rows=rows)
    startup = SuiteResult("startup")
    for label, n in (("2 groups", 2), ("3 groups", 6)):
        startup.rows += [
            Row("startup", f"{label}: bytes moved by model.to, worst of {n} orders", "MiB", 268.4,
                {"naive worst": 4563.0, "naive best": 805.3, "non-layer": 268.4}, {"/non-layer": 1.0},
                [Target("= non-layer, 1 call, every order", True)]),
            Row("startup", f"{label}: device peak during configure, worst order", "MiB", 1342.2,
                {"naive worst": 4831.8, "naive best": 1073.7, "non-layer + ring": 1342.2}, {"/expected": 1.0},
                [Target("= non-layer + ring, every order", True)]),
            Row("startup", f"{label}: configure time, over orders", "ms", st(1234.5, 0.1),
                {"naive per-group": st(1450.2, 0.1)}, {"/naive per-group": 0.851}),
            Row("startup", f"{label}: peak host RSS growth, worst order", "MiB", 1088.0,
                {"naive per-group": 2210.0, "largest layer": 1073.7, "model": 4563.0}, {"/model": 0.238},
                [Target("<= largest layer + 5% of model", False)]),
            Row("startup", f"{label}: host arena bytes per streamed byte", "B/B", 1.0, {"per model byte": 0.941}),
        ]
    hook = SuiteResult("hooks")
    for p in (8, 200):
        hook.rows.append(Row("hooks", f"pre+post hook time per layer, {p} params", "us", st(18.5, 0.2),
                             {"naive hooks": st(30.0 * p), "accelerate cpu_offload": st(41.0 * p)},
                             {"/naive hooks": 18.5 / (30.0 * p), "/accelerate cpu_offload": 18.5 / (41.0 * p)},
                             short=f"hook time, {p} params"))
    hook.rows.append(Row("hooks", "hook time growth, 200 vs 8 params", "x", 1.02,
                         {"naive hooks": 25.0, "accelerate cpu_offload": 25.1}, {"200/8": 1.02},
                         [Target.at_most(1.02, 1.5, "8-param cost")]))
    return [h2d, scatter, sweep, startup, hook]


def _cpu_results(json_path) -> list[SuiteResult]:
    """The tiny run's rows, read back from its JSON (what the CPU suites really wrote)."""
    def stat(v):
        return Stat(v["median"], v["q20"], v["q80"], v["samples"]) if isinstance(v, dict) else v

    out = []
    for name, suite in json.loads(json_path.read_text())["suites"].items():
        rows = [Row(r["suite"], r["measure"], r["unit"], stat(r["ours"]),
                    {k: stat(v) for k, v in r["baselines"].items()}, r["ratios"],
                    [Target(t["label"], t["met"]) for t in r["targets"]], r["note"], r["short"])
                for r in suite["rows"]]
        out.append(SuiteResult(name, suite["status"], suite["reason"], rows))
    return out


def _renderings(results, tmp_path, wide=False) -> dict[str, str]:
    """The table as rich prints it (not a terminal), as plain text and as Markdown."""
    out = {}
    for name, render in (("rich", report.render_rich), ("plain", report.render_plain)):
        buf = io.StringIO()
        render(results, buf, wide)
        out[name] = buf.getvalue()
    env = {"argv": ["--device", "cuda", "--json", str(tmp_path / "bench.json"), "--plot", str(tmp_path / "s.png"),
                    "--markdown", str(tmp_path / "bench.md")],
           "device_name": "NVIDIA H200", "device": "cuda:0", "cpu_count": 16, "torch": "2.13.0",
           "torch_threads": 16, "date": "2026-11-30T00:00:00+00:00"}
    report.write_markdown(str(tmp_path / "bench.md"), results, env, wide=wide)
    out["markdown"] = (tmp_path / "bench.md").read_text()
    return out


def _too_long(text: str) -> list[str]:
    return [line for line in text.splitlines() if len(line) > WIDTH]


def test_default_table_fits_120_columns(tiny_run, tmp_path):
    proc, json_path, _ = tiny_run
    assert not _too_long(proc.stdout), _too_long(proc.stdout)  # what the CLI printed (rich, not a terminal)
    assert not _too_long((json_path.parent / "bench.md").read_text())
    for label, results in (("cpu", _cpu_results(json_path)), ("cuda", _cuda_like_results())):
        for kind, text in _renderings(results, tmp_path).items():
            assert not _too_long(text), (label, kind, _too_long(text))
            assert "NO" in text or label == "cpu"
            for row in (r for res in results for r in res.rows):  # no row left out
                assert fmt_value(row.ours) in text.replace("\n", " ") or kind != "markdown", (label, kind, row)


def test_cuda_rows_keep_their_figures_and_notes(tmp_path):
    md = _renderings(_cuda_like_results(), tmp_path)["markdown"]
    assert "[1] small copy: latency-bound, no target" in md  # a note: a footnote, given once
    assert md.count("small copy: latency-bound") == 1
    assert "target missed: <= largest layer + 5% of model" in md and "| NO |" in md
    assert "/resident" in md and "/floor" in md and "/diffusers" in md
    assert "| 65536 tok, C/T 8.3, d=2 [3] |" in md  # the short label; C/T and d= are in the legend
    assert "; ..." not in md  # every ratio fits


def test_wide_gives_every_column(tiny_run, tmp_path):
    _, json_path, _ = tiny_run
    results = _cuda_like_results()
    default, wide = _renderings(results, tmp_path), _renderings(results, tmp_path, wide=True)
    header = [line for line in wide["markdown"].splitlines() if line.startswith("| suite")][0]
    assert header.count(" | ") + 1 == len(report.WIDE_COLUMNS) > len(report.COLUMNS)
    for kind in default:
        head_default, head_wide = (next(line for line in t.splitlines() if "measured" in line)
                                   for t in (default[kind], wide[kind]))
        for column in ("suite", "baselines", "target"):
            assert column in head_wide and column not in head_default, (kind, head_default)
        assert "naive per-group: 1," in wide[kind] and "naive per-group: 1," not in default[kind]
    assert _too_long(wide["markdown"])  # nothing squeezed: wider than 120
    assert "compute-bound" in wide["markdown"]  # the full label, regime included

    # the CLI passes --wide on
    path = tmp_path / "cli.md"
    suites = {r.name: (lambda ctx, r=r: r) for r in _cpu_results(json_path)}
    cli.SUITES, saved = suites, cli.SUITES
    try:
        assert cli.main(["--device", "cpu", "--tiny", "--markdown", str(path), "--wide"]) == 0
        assert "| suite | measured | unit |" in path.read_text()
        assert cli.main(["--device", "cpu", "--tiny", "--markdown", str(path)]) == 0
        assert "| measured | ours: median [q20, q80] |" in path.read_text()
    finally:
        cli.SUITES = saved


def test_legend_explains_the_abbreviations(tiny_run, tmp_path):
    proc, json_path, _ = tiny_run
    md = (json_path.parent / "bench.md").read_text()
    for text in (proc.stdout, md):
        assert "Legend:" in text
        flat = " ".join(text.split())
        assert "C/T = time the block's compute takes / time its weights take to cross the bus" in flat
        assert "above 1 the copy hides behind compute (compute-bound)" in flat
        assert "below 1 the bus is the limit (transfer-bound)" in flat
        assert "median [q20, q80]" in flat and "20th and 80th percentiles" in flat
        assert "d=N: layerwise with prefetch depth N" in flat and "N tok: tokens per step" in flat
    flat = " ".join(_renderings(_cuda_like_results(), tmp_path)["plain"].split())
    assert "floor = max(resident step, streamed bytes / measured bandwidth)" in flat
    assert "d2d = device to device" in flat and "Targets (the met column):" in flat
    # an entry only for what the table uses
    only_h2d = _renderings(_cuda_like_results()[:1], tmp_path)["plain"]
    assert "Legend:" in only_h2d and "C/T" not in only_h2d and "tok" not in only_h2d


_RANGE = re.compile(r"^(-?[\d,.e+-]+) \[(-?[\d,.e+-]+), (-?[\d,.e+-]+)\]$")


def _shown(stat: Stat) -> tuple[float, float, float]:
    """(median, q20, q80) read back from the printed figure."""
    m = _RANGE.match(fmt_value(stat))
    assert m, fmt_value(stat)  # "median [q20, q80]", a comma between the quantiles
    return tuple(float(g.replace(",", "")) for g in m.groups())


@pytest.mark.parametrize("seed", range(20))
def test_quantiles_stay_within_the_measured_samples(seed):
    rng = random.Random(seed)
    samples = [rng.lognormvariate(0, 1.5) * 10 ** rng.randint(-2, 3) for _ in range(rng.randint(1, 12))]
    for s in (Stat.of(samples), Stat.of(samples).map(lambda t: 1 / t)):
        assert min(s.samples) <= s.q20 <= s.median <= s.q80 <= max(s.samples)
        med, q20, q80 = _shown(s)
        assert 0 <= q20 <= med <= q80


def test_a_range_is_clamped_to_what_was_measured():
    # a statistic with quantiles outside its samples (built by hand, or from a difference of
    # medians) prints within [min, max] of the samples, ordered, without a minus sign
    s = Stat(14.82, -32.35, 146.4, [3.0, 9.5, 14.82, 20.0, 100.0])
    assert fmt_value(s) == "14.82 [3.000, 100.0]"
    assert fmt_value(Stat(5.0, 7.0, 2.0, [1.0, 5.0, 9.0])) == "5.000 [5.000, 5.000]"
    assert fmt_value(Stat(2.0, 1.0, 3.0)) == "2.000 [1.000, 3.000]"  # no samples: as given


def test_hook_cost_is_never_negative():
    # forwards that came out faster than the plain median (noise) cost 0, not a negative time
    plain_s, layers = 1e-3, 64
    forward = Stat.of([plain_s + d * 1e-6 for d in (-2500, -900, -10, 300, 900, 1800, 2600, 4000)])
    cost = hooks.per_layer_cost(forward, plain_s, layers)
    assert min(cost.samples) == 0 and cost.q20 >= 0 and cost.q20 <= cost.median <= cost.q80
    assert cost.median == pytest.approx(((300 + 900) / 2) / layers)  # us per layer
    for w in (0.0, 5.0, 100.0):
        less = hooks.less_wait(cost, w)
        assert min(less.samples) >= 0 and 0 <= less.q20 <= less.median <= less.q80
        assert "-" not in fmt_value(less)


def test_a_markdown_row_too_wide_for_120_columns_loses_ratios_and_says_so(tmp_path):
    many = {f"/baseline number {k}": 1.0 + k / 10 for k in range(6)}
    row = Row("stream", "a figure compared with many baselines", "ms", Stat.of([1.0, 1.1, 1.2]), {}, many)
    md = _renderings([SuiteResult("stream", rows=[row])], tmp_path)["markdown"]
    assert not _too_long(md)
    assert "1.000 /baseline number 0; " in md and "; ... |" in md
    assert "more ratios, too many for 120 columns; --wide shows them all" in " ".join(md.split())
    wide = _renderings([SuiteResult("stream", rows=[row])], tmp_path, wide=True)["markdown"]
    assert all(f"{k}" in wide for k in many) and "; ..." not in wide
