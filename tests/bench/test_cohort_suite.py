"""The `cohort` bench suite at its tiny size (python -m layerwise.bench cohort):
its three rows per model, bus point and K, the byte counts it reads, and every
call run together bitwise equal to the same call alone and to the resident
model. No timing is asserted (the machine's load decides those)."""
import os
import statistics

import pytest
import torch

from layerwise.bench import cohort
from layerwise.bench.common import Context, Skip

pytest.importorskip("diffusers")
pytest.importorskip("transformers")


@pytest.fixture
def one_compute_thread():
    # As the command line on a small machine: with every core in torch's pool, an
    # OpenMP barrier waiting on a preempted thread makes a tiny forward take 100x longer.
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
    yield
    torch.set_num_threads(threads)


def test_the_cohort_suite_runs_every_call_together_exactly(one_compute_thread, monkeypatch):
    monkeypatch.delenv(cohort.bus.ENV, raising=False)
    result = cohort.run(Context(torch.device("cpu"), "tiny", False))
    rows = {row.short: row for row in result.rows}
    assert len(rows) == len(result.rows) == 2 * len(cohort.POINTS) * len(cohort.KS) * 3
    for name, model in result.data["models"].items():
        assert model["pass_bytes"] > 0
        for point, pd in model["points"].items():
            assert [run["K"] for run in pd["runs"]] == list(cohort.KS)
            # the bus was set from the measured compute: the point's C/T is the one asked for
            assert pd["C/T"] == pytest.approx(1 / cohort.POINTS[point], rel=1e-3)
            for run in pd["runs"]:
                k = run["K"]
                tag = f"{name}, {point} (C/T {pd['C/T']:.2g}), K={k}"
                wall, moved, latency = rows[f"wall, {tag}"], rows[f"bytes/call, {tag}"], rows[f"latency, {tag}"]
                assert run["equal_alone"] and run["equal_resident"], (tag, run)
                assert [t.label for t in latency.targets] == ["bitwise = alone and resident"]
                assert latency.met, latency
                assert "bitwise equal to alone: yes, to resident: yes" in latency.note
                assert set(latency.ratios) == {"x alone", "worst"}
                assert latency.ratios["worst"] >= latency.ratios["x alone"]
                assert len(run["latency_x_alone"]) == k
                assert wall.ratios["x serial"] > 0 and wall.baselines["serial"].median > 0
                # every call alone streams every layer of every forward (more layers than the ring
                # holds), less what the ring kept from the run before (less than one forward's)
                full = k * model["forwards_per_call"] * model["pass_bytes"]
                assert all(full - model["pass_bytes"] < alone <= full for alone in run["bytes"]["serial"]), run
                assert moved.baselines["alone"] * 2**20 * k == pytest.approx(statistics.median(run["bytes"]["serial"]))
                if k == 1:  # one call is never shared: the bytes of the call alone, from the same ring
                    assert run["bytes"]["together"] == run["bytes"]["serial"], run
                    assert run["calls"]["joins"] == 0
                # the targets are those of K=4 only
                labels = [t.label for t in wall.targets + moved.targets]
                if k != cohort.TARGET_K:
                    assert labels == []
                elif point == "transfer-bound":
                    assert labels == [">= 3.2x serial", "<= 0.3x alone"]
                else:
                    assert labels == [">= 0.95x serial"]


def test_the_cohort_suite_says_why_a_model_is_left_out(monkeypatch):
    monkeypatch.setattr(cohort, "WORKLOADS", {"Flux": (cohort.Flux, "no_such_package_for_flux"),
                                              "Llama": (cohort.Llama, "no_such_package_for_llama")})
    with pytest.raises(Skip, match="Flux: no_such_package_for_flux is not importable.*"
                                   "Llama: no_such_package_for_llama is not importable"):
        cohort.run(Context(torch.device("cpu"), "tiny", False))
