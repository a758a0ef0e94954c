"""shared: one host copy per machine (share_host, docs/share-host.md).

N processes on this machine (N = 1, 2, 4) load one checkpoint of a stack of
MLP blocks with `load_offloaded` and stream it, each at its own pace with its
own inputs, two ways:

  shared     share_host=True: the first process packs one arena, the others
             map it;
  separate   share_host=False: every process packs its own (what N replicas do
             today).

Each process measures its proportional set size (PSS: a page shared by k
processes counts 1/k in each) of anonymous and shared memory (not of files:
the libraries' and the checkpoint's pages) before it loads and once every
process holds the model, the wall time of its load, and its median step time. The
processes start one at a time, each once the one before is ready (the first
packs, the others attach), so that each load time is its own; then all stream
at once.

Rows:
- host memory: the sum over the N processes of their PSS growth, shared
  against separate, and against one process alone (target: <= 1.15x for N=4).
  On a CPU device each process's ring and resident layers (the device's
  memory, which there is the host's) are left out, and given in the note;
- attach time: the median load time of processes 2..N against the packer's
  (target: <= 0.1x);
- step time: each process's median step against one process alone, for both
  ways (the separate run is the control: on a CPU the N processes share the
  cores, so "within noise" is "within the separate run's slowdown").

    python -m layerwise.bench shared [--quick]
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from layerwise.bench.common import Context, MiB, Row, Stat, SuiteResult, Target, finish_processes, mlp_stack
from layerwise.stages.disk.reader import held_interrupts

NAME = "shared"
COUNTS = (1, 2, 4)
# layers, hidden size (an MLP block of 2 * 4 * d * d fp32 weights: d=640 -> 12.5 MiB)
SHAPE = {"full": (32, 1024), "quick": (32, 640), "tiny": (4, 256)}
STEPS = {"full": 20, "quick": 20, "tiny": 3}
TIMEOUT_S = {"full": 600, "quick": 300, "tiny": 120}


def _pss() -> int:
    """This process's proportional set size in anonymous and shared memory, in
    bytes (smaps_rollup's Pss_Anon + Pss_Shmem). File-backed pages are left out:
    the libraries' pages are shared by more processes as more start, which would
    make the PSS of every process shrink by itself; and the checkpoint's page
    cache is the file system's, whoever reads it."""
    got = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("Pss_Anon", "Pss_Shmem"):
                got[key] = int(rest.split()[0]) * 1024
    if len(got) != 2:
        raise RuntimeError("no Pss_Anon / Pss_Shmem in /proc/self/smaps_rollup (Linux 5.4 or later has them)")
    return got["Pss_Anon"] + got["Pss_Shmem"]


def _barrier(tmp: str, name: str, index: int, n: int, timeout: float) -> None:
    open(os.path.join(tmp, f"{name}.{index}"), "w").close()
    end = time.monotonic() + timeout
    while not all(os.path.exists(os.path.join(tmp, f"{name}.{j}")) for j in range(n)):
        if time.monotonic() > end:
            raise TimeoutError(f"shared bench: barrier {name}")
        time.sleep(0.005)


def _worker(index: int, n: int, tmp: str, mode: str, layers: int, d: int, steps: int, device: str) -> None:
    """One process: load, wait for all, time `steps` steps, write its figures."""
    import torch

    import layerwise

    torch.set_num_threads(1)  # N processes share this machine's cores
    dev = torch.device(device)
    before = _pss()
    model = layerwise.empty_model(mlp_stack, layers, d)
    t0 = time.perf_counter()
    managers = layerwise.load_offloaded(model, os.path.join(tmp, "model.safetensors"), "blocks", device=dev,
                                        share_host=mode == "shared")
    ready = time.perf_counter() - t0
    open(os.path.join(tmp, f"{mode}-{n}-ready.{index}"), "w").close()
    torch.manual_seed(1 + index)
    x = torch.randn(8, d, device=dev)

    def step():
        with torch.inference_mode():
            y = x
            for b in model.blocks:
                y = b(y)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    step()  # every page touched once: what a process that streams holds
    _barrier(tmp, f"{mode}-{n}-held", index, n, 120)
    after = _pss()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    st = managers[0].stats()
    share = st["share_host"]
    # On a CPU device the ring and resident layers are the device's memory, which is the host's:
    # each process has its own, shared or not (on a GPU they are not host memory at all).
    device_side = st["ring_bytes"] + st["resident_bytes"] if dev.type == "cpu" else 0
    out = {"before": before, "after": after, "device_side": device_side, "ready_s": ready, "times": times,
           "role": share["role"] if share else "separate", "streamed_bytes": managers[0].plan.managed_bytes}
    with open(os.path.join(tmp, f"{mode}-{n}-{index}.json"), "w") as f:
        json.dump(out, f)
    _barrier(tmp, f"{mode}-{n}-done", index, n, 120)  # (every process still held it while the others measured)


def _launch(n: int, mode: str, tmp: str, layers: int, d: int, steps: int, device: str, timeout: float) -> list:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}

    def start(i):
        return subprocess.Popen([sys.executable, "-m", "layerwise.bench.shared", str(i), str(n), tmp, mode,
                                 str(layers), str(d), str(steps), device],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)

    procs = []
    end = time.monotonic() + timeout
    try:
        for i in range(n):  # one at a time, each until it is ready: its load time is its own
            procs.append(start(i))
            while not os.path.exists(os.path.join(tmp, f"{mode}-{n}-ready.{i}")):
                if procs[i].poll() is not None or time.monotonic() > end:
                    procs[i].kill()  # (past the time: its stderr is read after it ends)
                    raise RuntimeError(f"shared bench: process {i} ({mode}, N={n}) did not get ready:\n"
                                       f"{procs[i].communicate()[1][-3000:]}")
                time.sleep(0.01)
    except BaseException:
        for p in procs:
            p.kill()
        raise
    outs = [os.path.join(tmp, f"{mode}-{n}-{i}.json") for i in range(n)]
    return finish_processes(procs, outs, max(1.0, end - time.monotonic()), f"shared bench ({mode}, N={n})")


def run(ctx: Context) -> SuiteResult:
    import torch
    from safetensors.torch import save_file

    if not (sys.platform.startswith("linux") and hasattr(os, "memfd_create")):
        from layerwise.bench.common import Skip

        raise Skip("share_host needs Linux (memfd_create)")
    layers, d = ctx.pick(SHAPE)
    steps, timeout = ctx.pick(STEPS), ctx.pick(TIMEOUT_S)
    device = str(ctx.device)
    result = SuiteResult(NAME)
    with held_interrupts():
        made = tempfile.TemporaryDirectory()
    runs = {}
    with made as tmp:
        torch.manual_seed(0)
        save_file({k: v.contiguous() for k, v in mlp_stack(layers, d).state_dict().items()},
                  os.path.join(tmp, "model.safetensors"))
        for n in COUNTS:
            for mode in ("shared", "separate") if n > 1 else ("shared",):
                runs[(mode, n)] = _launch(n, mode, tmp, layers, d, steps, device, timeout)
    streamed = runs[("shared", 1)][0]["streamed_bytes"]
    grow = {k: sum(p["after"] - p["before"] - p["device_side"] for p in procs) for k, procs in runs.items()}
    raw = {k: sum(p["after"] - p["before"] for p in procs) for k, procs in runs.items()}
    step = {k: Stat.of([t for p in procs for t in p["times"]]) for k, procs in runs.items()}
    one = grow[("shared", 1)]
    tag = f"{layers} layers, {streamed / MiB:.0f} MiB streamed"
    result.data = {"layers": layers, "hidden": d, "streamed_bytes": streamed,
                   "runs": {f"{m}-{n}": procs for (m, n), procs in runs.items()}}
    for n in COUNTS[1:]:
        shared, separate = grow[("shared", n)], grow[("separate", n)]
        ratios = {"/1 process": shared / one, "/separate": shared / separate}
        targets = [Target.at_most(shared / one, 1.15, "1 process")] if n == 4 else []
        note = ""
        if ctx.device.type == "cpu":
            note = (f"less each process's ring and resident layers (the CPU device's memory, its own in every "
                    f"process; on a GPU they are not host memory); with them: {raw[('shared', n)] / MiB:.1f} MiB "
                    f"shared, {raw[('separate', n)] / MiB:.1f} MiB separate, {raw[('shared', 1)] / MiB:.1f} MiB "
                    "for 1 process")
        result.rows.append(Row(NAME, f"host memory of {n} processes (sum of PSS growth), share_host, {tag}", "MiB",
                               shared / MiB, {"1 process": one / MiB, f"{n} separate arenas": separate / MiB},
                               ratios, targets, note=note, short=f"host MiB, {n} processes shared"))
    for n in COUNTS[1:]:
        procs = runs[("shared", n)]
        attach = sorted(p["ready_s"] for p in procs[1:])
        packer = procs[0]["ready_s"]
        med = attach[len(attach) // 2]
        roles = sorted({p["role"] for p in procs[1:]})
        result.rows.append(Row(NAME, f"load time of processes 2..{n} (median; each started once the one before "
                                     f"was ready), share_host, {tag}", "s", med,
                               {"first process (packs)": packer}, {"/packer": med / packer},
                               [Target.at_most(med / packer, 0.1, "packer")] if n == 4 else [],
                               note=f"roles of processes 2..{n}: {', '.join(roles)}",
                               short=f"ready s, processes 2..{n}"))
    for n in COUNTS[1:]:
        alone = step[("shared", 1)].median
        sh, sep = step[("shared", n)], step[("separate", n)]
        result.rows.append(Row(NAME, f"step time with {n} processes streaming at once, share_host, {tag}", "s", sh,
                               {"1 process alone": step[("shared", 1)], f"{n} separate arenas": sep},
                               {"/alone": sh.median / alone, "/separate": sh.median / sep.median},
                               note="the processes share this machine's cores and memory bandwidth: the separate "
                                    "run is the control" if ctx.device.type == "cpu" else "",
                               short=f"step s, {n} processes shared"))
    return result


if __name__ == "__main__":
    a = sys.argv[1:]
    _worker(int(a[0]), int(a[1]), a[2], a[3], int(a[4]), int(a[5]), int(a[6]), a[7])
