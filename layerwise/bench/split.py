"""split: split fetch over torch.distributed (layerwise/stages/gather.py).

N processes on this machine (gloo ranks on the CPU backend) stream the same
stack of MLP blocks in lockstep, each with its own inputs, two ways, one after
the other in the same run:

  split      split_fetch=the group: each rank keeps and copies 1/N of every
             layer, an all-gather completes the layer in every rank's slot;
  all        every rank keeps and copies every layer (what N independent
             streamed replicas do).

Rows: step time (median over the steps of rank 0, every rank in lockstep) and
host bytes per rank (arena + shares) for both, the bytes each rank copied per
step, and the measured gloo all-gather bandwidth. On a CPU the "copy" is a host
memcpy and the all-gather goes through loopback TCP, so the step-time row says
little about GPUs: the GPU rows are "not measured" here, with the expected
scaling written down as a model:

    t_layer(split) = (B / N) / BW_pcie + B (N - 1) / N / BW_allgather
    t_layer(all)   = B / BW_pcie

(B: bytes per layer; BW_allgather: the NCCL all-gather bus bandwidth over
NVLink, to be measured with this suite on a machine with at least two GPUs.)

    python -m layerwise.bench split [--quick]
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time

from .common import MB, Context, Row, Skip, Stat, SuiteResult

NAME = "split"
WORLD = {"full": 4, "quick": 2, "tiny": 2}
# layers, hidden size (an MLP block of 2 * 4 * d * d fp32 weights: d=1024 -> 32 MiB)
SHAPE = {"full": (16, 1024), "quick": (8, 512), "tiny": (4, 128)}
STEPS = {"full": 10, "quick": 8, "tiny": 3}
TIMEOUT_S = {"full": 600, "quick": 300, "tiny": 120}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, modes: str, layers: int, d: int, steps: int, out: str) -> None:
    """One rank: configure, warm up, time `steps` steps, write its figures to `out`."""
    import datetime

    import torch
    import torch.distributed as dist
    from torch import nn

    import layerwise

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    torch.set_num_threads(1)  # N ranks share this machine's cores

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.Linear(d, 4 * d, bias=False)
            self.down = nn.Linear(4 * d, d, bias=False)

        def forward(self, x):
            return x + self.down(torch.relu(self.up(x)))

    res = {}
    for mode in modes.split(","):  # one after the other in the same processes (start-up paid once)
        torch.manual_seed(0)
        model = nn.Module()
        model.blocks = nn.ModuleList([Block() for _ in range(layers)])
        managers = layerwise.configure_layerwise_offload(
            model, "blocks", device="cpu", prefetch_depth=1,
            split_fetch=dist.group.WORLD if mode == "split" else None)
        m = managers[0]
        torch.manual_seed(1 + rank)
        x = torch.randn(4, d)

        def step():
            with torch.inference_mode():
                y = x
                for b in model.blocks:
                    y = b(y)
            return y

        step()
        dist.barrier()
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        dist.barrier()
        s = m.stats()
        sf = s.get("split_fetch") or {}
        res[mode] = {"times": times, "host_bytes": s["arena_bytes"] + sf.get("host_bytes", 0),
                     "streamed_bytes": m.plan.managed_bytes,
                     "bytes_per_step": s["last_step"]["bytes_copied"] if s["last_step"] else None,
                     "gathered": sf.get("bytes_gathered", 0), "gather_s": sf.get("gather_s") or 0.0,
                     "gathers": sf.get("gathers", 0)}
        layerwise.remove_layerwise_offload(model)
    with open(out, "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


def _launch(world: int, modes: str, layers: int, d: int, steps: int, timeout: float, tmp: str) -> list[dict]:
    port = _free_port()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    outs = [os.path.join(tmp, f"rank-{r}.json") for r in range(world)]
    procs = [subprocess.Popen([sys.executable, "-m", "layerwise.bench.split", str(r), str(world), str(port), modes,
                               str(layers), str(d), str(steps), outs[r]],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for r in range(world)]
    try:
        errs = [p.communicate(timeout=timeout)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    bad = [(r, p.returncode, e) for r, (p, e) in enumerate(zip(procs, errs)) if p.returncode != 0]
    if bad:
        r, rc, err = bad[0]
        raise RuntimeError(f"split bench: rank {r} ({modes}) exited with {rc}:\n{err[-3000:]}")
    res = []
    for path in outs:
        with open(path) as f:
            res.append(json.load(f))
    return res


def run(ctx: Context) -> SuiteResult:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_gloo_available()):
        raise Skip("torch was built without torch.distributed / gloo")
    world = ctx.pick(WORLD)
    layers, d = ctx.pick(SHAPE)
    steps = ctx.pick(STEPS)
    timeout = ctx.pick(TIMEOUT_S)
    result = SuiteResult(NAME)
    with tempfile.TemporaryDirectory() as tmp:
        ranks = _launch(world, "all,split", layers, d, steps, timeout, tmp)
    runs = {mode: [r[mode] for r in ranks] for mode in ("all", "split")}
    step = {mode: Stat.of(r[0]["times"]) for mode, r in runs.items()}
    host = {mode: max(x["host_bytes"] for x in r) for mode, r in runs.items()}
    per_step = {mode: runs[mode][0]["bytes_per_step"] for mode in runs}
    streamed = runs["all"][0]["streamed_bytes"]
    sp = runs["split"][0]
    ag_gbs = sp["gathered"] / sp["gather_s"] / 1e9 if sp["gather_s"] else None
    tag = f"{world} ranks, {layers} layers x {streamed / layers / MB:.1f} MiB"
    result.data = {"world": world, "layers": layers, "hidden": d, "streamed_bytes": streamed,
                   "runs": runs, "allgather_gbs_cpu": ag_gbs}
    result.rows.append(Row(NAME, f"step time, split fetch, {tag} (gloo, CPU)", "s", step["split"],
                           {"every rank fetches all": step["all"]},
                           {"/all": step["split"].median / step["all"].median},
                           note="host memcpy + loopback TCP all-gather on a shared CPU: not a GPU figure",
                           short=f"step, split fetch ({world} ranks, CPU)"))
    result.rows.append(Row(NAME, f"host bytes per rank, split fetch, {tag}", "MiB", host["split"] / MB,
                           {"every rank fetches all": host["all"] / MB},
                           {"/all": host["split"] / host["all"], f"x{world} ranks /all": host["split"] * world / host["all"]},
                           short=f"host MiB per rank, split ({world} ranks)"))
    if per_step["split"] is not None and per_step["all"]:
        result.rows.append(Row(NAME, f"bytes over the host link per rank per step, split fetch, {tag}", "MiB",
                               per_step["split"] / MB, {"every rank fetches all": per_step["all"] / MB},
                               {"/all": per_step["split"] / per_step["all"]},
                               short=f"host-link MiB/step/rank, split ({world} ranks)"))
    if ag_gbs is not None:
        result.rows.append(Row(NAME, f"all-gather bandwidth (received bytes / gather time), gloo, {world} ranks",
                               "GB/s", ag_gbs, note="loopback TCP on this machine; NCCL over NVLink is another "
                               "world", short=f"gloo all-gather GB/s ({world} ranks)"))
    why = ("needs at least two GPUs (this run: CPU). Model: per layer of B bytes, split fetch takes "
           "(B/N)/BW_pcie + B(N-1)/N/BW_allgather against B/BW_pcie; e.g. N=8, BW_pcie=50 GB/s and an NCCL "
           "all-gather at 300 GB/s bus bandwidth (NVLink, assumed, not measured): B/185 GB/s, 3.7x the host link "
           "of one GPU; host memory per node 1x the model instead of Nx")
    result.rows.append(Row(NAME, "GPU step time, split fetch vs every rank fetching all: not measured", "", None,
                           note=why, short="GPU split fetch: not measured"))
    return result


if __name__ == "__main__":
    a = sys.argv[1:]
    _rank_main(int(a[0]), int(a[1]), int(a[2]), a[3], int(a[4]), int(a[5]), int(a[6]), a[7])
