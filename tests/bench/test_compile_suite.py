"""The compile suite at test sizes, in a fresh interpreter (`python -m layerwise.bench
--tiny compile`): a streamed model compiled whole with fullgraph=True, no graph break,
no recompile while timed, its output bitwise equal to the compiled twin's (every
layer resident, the same operator boundaries), its copies really crossing the
simulated bus; every figure of the JSON and every row's ratios and targets follow
from the measured figures."""
import json
import subprocess
import sys

import pytest

from layerwise.bench import compile as compile_suite

CONFIGS = {"eager resident", "eager streamed", "compiled resident", "compiled twin", "compiled streamed"}


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    path = tmp_path_factory.mktemp("compile") / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "layerwise.bench", "--tiny", "--device", "cpu", "compile",
                           "--json", str(path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads(path.read_text())["suites"]["compile"]
    assert doc["status"] == "ok", doc["reason"]
    return doc


def _median(v):
    return v["median"] if isinstance(v, dict) else v


def test_streamed_model_compiles_whole_without_breaks_or_recompiles_and_matches_its_twin(suite):
    data = suite["data"]
    assert data["fullgraph"] is True
    # explain: the forward and the root module's two hooks, each its own graph; no break reason
    assert data["explain"]["graph_breaks"] == 0 and data["explain"]["break_reasons"] == []
    assert data["graph_breaks"] == 0 and data["recompiles"] == 0 and data["bitwise_vs_twin"] is True
    size = compile_suite.SIZES[("tiny", "cpu")]
    assert set(data["compile"]) == {str(t) for t in size.tokens}
    for shape in data["compile"].values():
        assert shape["bitwise_vs_twin"] is True
        assert set(shape["configs"]) == {"compiled resident", "compiled streamed", "compiled twin"}
        for name, c in shape["configs"].items():
            assert c["first_call_s"] > 0 and c["graph_breaks"] == 0, (name, c)
        assert shape["configs"]["compiled resident"]["graphs"] >= 1  # (the others may reuse cached frames)
    assert len(data["points"]) == len(size.tokens)
    for p in data["points"]:
        assert set(p["step_ms"]) == CONFIGS
        assert p["recompiles"] == {"compiled resident": 0, "compiled streamed": 0, "compiled twin": 0}
        assert p["bitwise_vs_twin"] is True and isinstance(p["bitwise_vs_compiled_resident"], bool)


def test_compiled_streaming_crosses_the_bus_and_the_ratios_follow_from_the_figures(suite):
    data = suite["data"]
    size = compile_suite.SIZES[("tiny", "cpu")]
    layer_bytes = data["config"]["layer_bytes"]
    for p, ct in zip(data["points"], size.bus_ct):
        # every layer crosses the bus every step (more layers than the depth-1 ring holds), compiled or eager
        assert p["bytes_moved"] == size.layers * layer_bytes
        assert p["last_step"]["eager streamed"]["bytes_copied"] == p["bytes_moved"]
        ms = {k: _median(v) for k, v in p["step_ms"].items()}
        # the bus sleeps: the compiled streamed step is no faster than its copies across the configured
        # bus, less the first layer's, which the untimed step before it may have done
        gbps = p["bus"]["gbps"]
        assert gbps > 0 and p["bus_ct_chosen"] == ct
        assert ms["compiled streamed"] >= 0.95 * (1 - 1 / size.layers) * p["bytes_moved"] / (gbps * 1e9) * 1e3, p
        transfer_ms = p["bytes_moved"] / (p["bandwidth_GiBps"] * 2**30) * 1e3
        assert p["transfer_ms"] == pytest.approx(transfer_ms)
        assert p["floor_ms"] == pytest.approx(max(ms["compiled resident"], transfer_ms))
        assert p["eager_floor_ms"] == pytest.approx(max(ms["eager resident"], transfer_ms))
        assert p["compute_transfer_ratio"] == pytest.approx(ms["compiled resident"] / transfer_ms)
        assert p["ratios"]["compiled streamed /compiled resident"] == pytest.approx(
            ms["compiled streamed"] / ms["compiled resident"])
        assert p["ratios"]["compiled streamed /floor"] == pytest.approx(ms["compiled streamed"] / p["floor_ms"])


def test_compiled_streamed_rows_carry_the_targets_of_their_regime(suite):
    rows = [r for r in suite["rows"] if r["measure"].startswith("step") and r["measure"].endswith("compiled streamed")]
    points = suite["data"]["points"]
    assert len(rows) == len(points)
    for row, p in zip(rows, points):
        assert f", {p['regime']})" in row["measure"], (row, p["regime"])
        timing = {"compute-bound": ["<= 1.05x compiled resident"], "transfer-bound": ["<= 1.1x floor"],
                  "balanced": []}[p["regime"]]
        labels = [t["label"] for t in row["targets"]]
        assert labels == timing + ["0 graph breaks", "0 recompiles", "bitwise = twin"], labels
        assert all(t["met"] for t in row["targets"][len(timing):]), row
        assert row["ratios"]["/compiled"] == pytest.approx(_median(row["ours"]) / _median(
            row["baselines"]["compiled resident"]))
        assert row["ratios"]["/floor"] == pytest.approx(_median(row["ours"]) / row["baselines"]["floor"])
        if row["met"] is False:  # a miss says what the step waited on
            assert "missed: the step waited" in row["note"], row
    first = [r for r in suite["rows"] if r["measure"].startswith("first call")]
    assert len(first) == len(suite["data"]["compile"]) and all(r["unit"] == "s" for r in first)
