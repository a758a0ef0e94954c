"""scripts/gpu_check.sh and scripts/gpu_smoke.py on the CPU: the one run a GPU
lease gets must fit it (at most 360 s of stages, at most 8 files, build first,
then the smoke test), a stage at its limit must leave no files but its own, the
smoke test's code (JSON, figures, key-figure lines) must run, and the test stage
must select the tests that need the device, new ones included."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def env(**extra):
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            "PYTHON": sys.executable, **extra}


def dry_run(*args, **extra) -> dict:
    proc = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env(**extra),
                          timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    stages = re.findall(r"^\s+\d+\. (\S+)\s+(\d+) s\s+files: (\S+)\s+(.*)$", out, re.M)
    total = int(re.search(r"^total: (\d+) s", out, re.M).group(1))
    files = re.search(r"^files \((\d+) of at most 8\): (.*)$", out, re.M).group(2).split()
    return {"text": out, "stages": stages, "total": total, "files": files}


def test_the_dry_run_fits_the_lease():
    for plan in (dry_run("--dry-run"), dry_run(DRY_RUN="1")):
        names = [s[0] for s in plan["stages"]]
        assert names[:2] == ["build", "smoke"], plan["text"]
        assert names.index("cuda") < names.index("kernels") < names.index("bench"), plan["text"]
        assert plan["total"] == sum(int(s[1]) for s in plan["stages"]) <= 360, plan["text"]
        assert len(plan["files"]) <= 8 and {"summary.txt", "run.log", "smoke.json"} <= set(plan["files"])
        declared = {f for s in plan["stages"] if s[2] != "-" for f in s[2].split(",")}
        assert declared | {"summary.txt", "run.log"} == set(plan["files"])
        smoke = dict((s[0], s) for s in plan["stages"])["smoke"]
        assert int(smoke[1]) <= 60 and "gpu_smoke.py" in smoke[3]
        bench = dict((s[0], s) for s in plan["stages"])["bench"][3]
        assert re.search(r"layerwise\.bench --quick h2d compress stream\b", bench), bench
    # the CPU variants are CI's: the test stages run only what needs the device
    assert "LAYERWISE_CUDA_ONLY=1" in plan["text"] and "-k \"not cuda\"" not in plan["text"]


def test_a_stage_at_its_limit_leaves_only_its_own_files(tmp_path):
    """GPU_CHECK_SELFTEST=1: a stage that writes its file and a stray one, then runs past
    its limit; and a quick one after it. RESULTS_DIR gets the stage's own file, the
    summary and the log, nothing else; the stage is stopped, the next one runs."""
    out = tmp_path / "out"
    proc = subprocess.run(["bash", str(SCRIPT), str(out)], capture_output=True, text=True,
                          env=env(GPU_CHECK_SELFTEST="1"), timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["run.log", "smoke.json", "summary.txt"], proc.stdout
    summary = (out / "summary.txt").read_text()
    assert re.search(r"^slow\s+rc=124 .*STOPPED AT ITS LIMIT", summary, re.M), summary
    assert re.search(r"^quick\s+rc=0 ", summary, re.M), summary
    log = (out / "run.log").read_text()
    assert "slow: sleeping" in log and "quick: done" in log


def test_the_smoke_test_runs_on_the_cpu_backend(tmp_path):
    """Every section of scripts/gpu_smoke.py on the CPU backend (small sizes, the C++
    decoder): the JSON is whole, the stream is bitwise with every fetch timed, and the
    key-figure lines summary.txt gets are there."""
    path = tmp_path / "smoke.json"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_smoke.py"), str(path), "--cpu"],
                          capture_output=True, text=True, env=env(), timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(path.read_text())
    for name in ("build", "device", "h2d", "stream", "decode"):
        assert name in doc and "error" not in doc[name], (name, doc.get(name))
    assert doc["mode"] == "cpu" and doc["build"]["layerwise"]["with_cuda"] in (True, False)
    assert [s["mb"] for s in doc["h2d"]["sizes"]] == [4, 16]
    assert all(s["arena_gbs"] > 0 and s["torch_gbs"] > 0 for s in doc["h2d"]["sizes"])
    for k in ("raw", "lossless"):
        row = doc["stream"][k]
        assert row["bitwise"] and row["fetches_without_start"] == 0 and row["copy_s"] > 0, row
    assert doc["stream"]["lossless"]["bytes_copied"] < doc["stream"]["raw"]["bytes_copied"]
    assert doc["decode"]["bitwise"] and doc["decode"]["decode_gbs"] > 0
    figures = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_smoke.py"), "--key-figures", str(path)],
                             capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert figures.returncode == 0, figures.stderr
    lines = figures.stdout.splitlines()
    for start in ("build:", "device:", "h2d 4 MiB:", "h2d 16 MiB:", "stream raw:", "stream lossless:", "decode "):
        assert any(line.startswith(start) for line in lines), (start, lines)
    assert not any("FAILED" in line or "not read" in line or "not reached" in line for line in lines), lines


def test_the_test_stages_select_what_needs_the_device():
    """LAYERWISE_CUDA_ONLY=1 (tests/conftest.py) over the files of the test stages: the
    cuda variants and the GPU-only tests, the new ones among them, and no CPU variant."""
    plan = dry_run("--dry-run")
    stages = {s[0]: s[3] for s in plan["stages"]}
    files = [f for name in ("cuda", "kernels") for f in stages[name].split() if f.startswith("tests/")]
    assert files[:6] == ["tests/runtime/test_native.py", "tests/runtime/test_manager.py",
                         "tests/runtime/test_cuda_path.py", "tests/runtime/test_residency.py", "tests/test_tune.py",
                         "tests/test_loading.py"]
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files],
                          capture_output=True, text=True, env=env(LAYERWISE_CUDA_ONLY="1"), timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ids = [line for line in proc.stdout.splitlines() if "::" in line]
    assert ids and not any("[cpu" in i or "-cpu" in i for i in ids), ids
    for want in ("test_cuda_path.py::test_bitwise_with_the_gpu_behind_the_host[",
                 "test_cuda_path.py::test_the_next_copy_overlaps_a_decode_that_waits_for_its_slot[cuda]",
                 "test_cuda_path.py::test_every_fetch_is_timed_from_its_first_copy[cuda-encoded]",
                 "test_cuda_path.py::test_split_fetch_times_every_gather_from_its_local_copy[cuda]",
                 "test_moe.py::test_routed_on_cuda_is_bitwise_with_the_gpu_behind_the_host[",
                 "test_moe.py::test_speculative_prefetch_on_cuda_costs_bytes_never_correctness",
                 "test_moe.py::test_compressed_routed_experts_on_cuda_decode_their_rows_bitwise[",
                 "test_tune.py::test_tune_with_compression_gets_bus_samples_and_stays_bitwise[cuda]",
                 "test_cuda_path.py::test_decode_path_is_ready_on_this_gpu_host",
                 "test_codec.py::test_triton_header_argument[cuda"):
        assert any(want in i for i in ids), (want, ids)
