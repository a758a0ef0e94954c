"""Smoke test of `python -m layerwise.bench`: every CPU suite at test sizes
(the hidden --tiny flag), the JSON it writes, the plot, and the exit status
when a suite fails."""
import json
import math
import subprocess
import sys

import pytest

from layerwise.bench import cli
from layerwise.bench.common import Row, Skip, SuiteResult

CPU_SUITES = ["h2d", "stream", "startup", "hooks"]


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
    md = (plot_path.parent / "bench.md").read_text().splitlines()
    assert md[0].startswith("`python -m layerwise.bench --tiny") and " (cpu, " in md[0]  # command, machine
    assert md[2].startswith("| suite | measured |") and md[3].startswith("|---|")
    rows = [line for line in md[4:] if line.startswith("| ")]
    assert {r.split(" | ")[0][2:] for r in rows} == {"h2d", "scatter", "stream", "startup", "hooks"}


def test_json_has_environment_and_finite_positive_figures(tiny_run):
    _, json_path, _ = tiny_run
    doc = json.loads(json_path.read_text())
    env = doc["environment"]
    for key in ("date", "hostname", "cpu_count", "device", "device_name", "torch", "triton", "layerwise",
                "build_info", "argv", "args"):
        assert key in env, key
    assert env["device"] == "cpu" and "--tiny" in env["argv"]

    suites = doc["suites"]
    assert set(suites) == {"h2d", "scatter", "stream", "startup", "hooks"}
    assert suites["scatter"]["status"] == "skipped" and "CUDA" in suites["scatter"]["reason"]
    for name in CPU_SUITES:
        suite = suites[name]
        assert suite["status"] == "ok", (name, suite["reason"])
        assert suite["rows"], name
        for row in suite["rows"]:
            for key in ("suite", "measure", "unit", "ours", "baselines", "ratios", "targets", "met"):
                assert key in row, (name, key)
            ours = _median(row["ours"])
            # a difference of two timings (hook time less the copy wait) may be <= 0 at tiny sizes
            assert _finite(ours) and (ours > 0 or "without the copy wait" in row["measure"]), (name, row)
            if isinstance(row["ours"], dict):
                assert row["ours"]["q20"] <= ours <= row["ours"]["q80"]
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
    # stream: every point timed every method; CPU rows carry no pass/fail.
    stream = suites["stream"]
    for point in stream["data"]["points"]:
        assert set(point["step_ms"]) == set(stream["data"]["methods"])
        assert point["streamed_bytes"] > 0
    assert all(row["met"] is None for row in stream["rows"])
    # hooks: the flatness row has its target.
    assert suites["hooks"]["rows"][-1]["targets"]


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
