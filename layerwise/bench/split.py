"""split: split fetch over torch.distributed (layerwise/stages/split/).

N processes on this machine (gloo ranks on the CPU backend; with --device cuda
and at least two GPUs, NCCL ranks, one GPU each, up to 8) stream the same
stack of MLP blocks in lockstep, each with its own inputs, two ways, one after
the other in the same run:

  split      split_fetch=the group: each rank keeps and copies 1/N of every
             layer, an all-gather completes the layer in every rank's slot;
  all        every rank keeps and copies every layer (what N independent
             streamed replicas do).

Rows: step time (median over the steps of rank 0, every rank in lockstep) and
host bytes per rank (arena + shares) for both, the bytes each rank copied per
step, and the bandwidth of an all-gather of one layer on its own. On a CPU the "copy" is a host
memcpy and the all-gather goes through loopback TCP, so the step-time row says
little about GPUs: the GPU rows are "not measured" here, with the expected
scaling written down as a model:

    t_layer(split) = (B / N) / BW_pcie + B (N - 1) / N / BW_allgather
    t_layer(all)   = B / BW_pcie

(B: bytes per layer; BW_allgather: the NCCL all-gather bandwidth over NVLink,
which this suite measures on a machine with at least two GPUs. The NCCL launch
is written but has not run yet: no GPU was lent so far.)

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

from layerwise.bench.common import Context, GiB, MiB, Row, Skip, Stat, SuiteResult, finish_processes, mlp_stack
from layerwise.stages.disk.reader import held_interrupts

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


def _rank_main(rank: int, world: int, port: int, modes: str, layers: int, d: int, steps: int, out: str,
               kind: str = "cpu") -> None:
    """One rank: configure, warm up, time `steps` steps, write its figures to `out`.
    kind "cpu": gloo ranks on the CPU backend; "cuda": NCCL ranks, one GPU each."""
    import datetime

    import torch
    import torch.distributed as dist

    import layerwise
    from layerwise.stages.split.collectives import gather as _gather

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = kind == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    torch.set_num_threads(1)  # N ranks share this machine's cores

    def sync():
        if cuda:
            torch.cuda.synchronize(dev)

    res = {}
    if "together" in modes.split(","):
        res["together"] = _together(rank, dev, layers, d, steps, sync)
        modes = ",".join(m for m in modes.split(",") if m != "together")
    for mode in modes.split(","):  # one after the other in the same processes (start-up paid once)
        torch.manual_seed(0)
        model = mlp_stack(layers, d)
        managers = layerwise.configure_layerwise_offload(
            model, "blocks", device=dev, prefetch_depth=1,
            split_fetch=dist.group.WORLD if mode == "split" else None)
        m = managers[0]
        torch.manual_seed(1 + rank)
        x = torch.randn(4, d, device=dev)

        def step():
            with torch.inference_mode():
                y = x
                for b in model.blocks:
                    y = b(y)
            return y

        step()
        sync()
        dist.barrier()
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            sync()
            times.append(time.perf_counter() - t0)
        dist.barrier()
        s = m.stats()
        sf = s.get("split_fetch") or {}
        res[mode] = {"times": times, "host_bytes": s["arena_bytes"],  # the arena and (split) the shares
                     "streamed_bytes": m.plan.managed_bytes,
                     "bytes_per_step": s["last_step"]["bytes_copied"] if s["last_step"] else None,
                     "gathered": sf.get("bytes_gathered", 0), "gather_s": sf.get("gather_s") or 0.0,
                     "gathers": sf.get("gathers", 0)}
        layerwise.remove_layerwise_offload(model)
    # The all-gather on its own, one layer's bytes, timed on the host around a synchronised loop.
    nbytes = 2 * 4 * d * d * 4
    share = -(-nbytes // world)
    buf = torch.empty(share * world, dtype=torch.uint8, device=dev)
    for k in range(steps + 1):
        sync()
        t0 = time.perf_counter()
        _gather(buf, buf[rank * share:(rank + 1) * share], None, async_op=False)
        sync()
        if k:  # the first one warms up
            res.setdefault("allgather_s", []).append(time.perf_counter() - t0)
    res["allgather_bytes"] = share * (world - 1)  # received per rank
    with open(out, "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


CALLS = 4  # run_together's calls in the "together" mode


def _together(rank: int, dev, layers: int, d: int, steps: int, sync) -> dict:
    """CALLS calls of `steps` forwards each with split fetch, one after another and then
    through run_together (turns: runtime/turns.py), interleaved round by round: the
    wall time of each, and the bytes over this rank's host link."""
    import torch
    import torch.distributed as dist

    import layerwise

    torch.manual_seed(0)
    model = mlp_stack(layers, d)
    m = layerwise.configure_layerwise_offload(model, "blocks", device=dev, prefetch_depth=1,
                                              split_fetch=dist.group.WORLD)[0]
    torch.manual_seed(1 + rank)
    xs = [torch.randn(2 + k, d, device=dev) for k in range(CALLS)]

    def call(x):
        def run(mod):
            with torch.inference_mode():
                for _ in range(steps):
                    y = mod(x)
            sync()
            return y
        return run

    def serial():
        return [call(x)(model) for x in xs]

    def together():
        return layerwise.run_together(model, [call(x) for x in xs])

    out = {"serial_s": [], "together_s": [], "serial_bytes": 0, "together_bytes": 0}
    together(), serial()  # warm-up
    for _ in range(3):
        for name, fn in (("serial", serial), ("together", together)):
            dist.barrier()
            b0, t0 = m.stats()["bytes_copied"], time.perf_counter()
            fn()
            out[f"{name}_s"].append(time.perf_counter() - t0)
            out[f"{name}_bytes"] = m.stats()["bytes_copied"] - b0
    out["turns"] = m.stats()["calls"]["turns"]
    layerwise.remove_layerwise_offload(model)
    return out


def _launch(world: int, modes: str, layers: int, d: int, steps: int, timeout: float, tmp: str,
            kind: str = "cpu") -> list[dict]:
    port = _free_port()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    outs = [os.path.join(tmp, f"rank-{r}.json") for r in range(world)]
    procs = [subprocess.Popen([sys.executable, "-m", "layerwise.bench.split", str(r), str(world), str(port), modes,
                               str(layers), str(d), str(steps), outs[r], kind],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for r in range(world)]
    return finish_processes(procs, outs, timeout, f"split bench ({modes})")


def _model_note(world: int, ag_gibs: float | None, measured: bool) -> str:
    n = 8 if world < 2 else world
    pcie = 50e9 / GiB  # one GPU's host link: 50 GB/s (assumed)
    bw_ag = ag_gibs if measured and ag_gibs else 300e9 / GiB  # NVLink class: 300 GB/s (assumed)
    eff = 1.0 / ((1.0 / n) / pcie + ((n - 1) / n) / bw_ag)
    src = "measured here" if measured and ag_gibs else "assumed (NVLink class), not measured"
    return (f"model: per layer of B bytes, split fetch takes (B/N)/BW_pcie + B(N-1)/N/BW_allgather against "
            f"B/BW_pcie; with N={n}, BW_pcie={pcie:.1f} GiB/s (assumed) and an all-gather at {bw_ag:.0f} GiB/s "
            f"({src}): B/{eff:.0f} GiB/s, {eff / pcie:.1f}x the host link of one GPU when the transfer is the "
            "bottleneck; host memory per node 1x the model instead of Nx")


def run(ctx: Context) -> SuiteResult:
    import torch
    import torch.distributed as dist

    from layerwise import build_info

    if not (dist.is_available() and dist.is_gloo_available()):
        raise Skip("torch was built without torch.distributed / gloo")
    gpus = torch.cuda.device_count() if ctx.is_cuda and build_info()["with_cuda"] else 0
    kind = "cuda" if gpus >= 2 and dist.is_nccl_available() else "cpu"
    world = min(gpus, 8) if kind == "cuda" else ctx.pick(WORLD)
    layers, d = ctx.pick(SHAPE)
    steps = ctx.pick(STEPS)
    timeout = ctx.pick(TIMEOUT_S)
    result = SuiteResult(NAME)
    with held_interrupts():  # made with the finalizer that removes it (at exit at the latest) as one step
        made = tempfile.TemporaryDirectory()
    with made as tmp:
        ranks = _launch(world, "all,split,together", layers, d, steps, timeout, tmp, kind)
    runs = {mode: [r[mode] for r in ranks] for mode in ("all", "split")}
    step = {mode: Stat.of(r[0]["times"]) for mode, r in runs.items()}
    host = {mode: max(x["host_bytes"] for x in r) for mode, r in runs.items()}
    per_step = {mode: runs[mode][0]["bytes_per_step"] for mode in runs}
    streamed = runs["all"][0]["streamed_bytes"]
    ag = Stat.of(ranks[0]["allgather_s"])
    ag_gibs = ranks[0]["allgather_bytes"] / ag.median / GiB
    backend = "NCCL, GPU" if kind == "cuda" else "gloo, CPU"
    tag = f"{world} ranks, {layers} layers x {streamed / layers / MiB:.1f} MiB"
    result.data = {"kind": kind, "world": world, "layers": layers, "hidden": d, "streamed_bytes": streamed,
                   "runs": runs, "allgather_gibps": ag_gibs}
    note = ("host memcpy + loopback TCP all-gather on a shared CPU: not a GPU figure" if kind == "cpu"
            else _model_note(world, ag_gibs, measured=True))
    result.rows.append(Row(NAME, f"step time, split fetch, {tag} ({backend})", "s", step["split"],
                           {"every rank fetches all": step["all"]},
                           {"/all": step["split"].median / step["all"].median}, note=note,
                           short=f"step, split fetch ({world} ranks, {backend})"))
    result.rows.append(Row(NAME, f"host bytes per rank, split fetch, {tag}", "MiB", host["split"] / MiB,
                           {"every rank fetches all": host["all"] / MiB},
                           {"/all": host["split"] / host["all"],
                            f"x{world} ranks /all": host["split"] * world / host["all"]},
                           short=f"host MiB per rank, split ({world} ranks)"))
    if per_step["split"] is not None and per_step["all"]:
        result.rows.append(Row(NAME, f"bytes over the host link per rank per step, split fetch, {tag}", "MiB",
                               per_step["split"] / MiB, {"every rank fetches all": per_step["all"] / MiB},
                               {"/all": per_step["split"] / per_step["all"]},
                               short=f"host-link MiB/step/rank, split ({world} ranks)"))
    result.rows.append(Row(NAME, f"all-gather of one layer ({ranks[0]['allgather_bytes'] / MiB:.1f} MiB received per "
                                 f"rank / time), {backend}, {world} ranks", "GiB/s", ag_gibs,
                           note="loopback TCP on this machine; NCCL over NVLink is another world"
                           if kind == "cpu" else "", short=f"all-gather GiB/s ({world} ranks, {backend})"))
    tg = ranks[0]["together"]
    serial, together = Stat.of(tg["serial_s"]), Stat.of(tg["together_s"])
    result.data["together"] = [r["together"] for r in ranks]
    result.rows.append(Row(NAME, f"{CALLS} calls of {steps} forwards through run_together on split fetch "
                                 f"(turns agreed by the ranks), {tag} ({backend})", "s", together,
                           {"the same calls one after another": serial},
                           {"throughput x serial": serial.median / together.median,
                            "bytes per call /serial": tg["together_bytes"] / max(1, tg["serial_bytes"])},
                           note="rounds interleaved; bytes over this rank's host link",
                           short=f"run_together x{CALLS} on split fetch ({world} ranks)"))
    if kind == "cpu":
        why = (f"needs at least two GPUs (this run: {'1 GPU' if gpus == 1 else 'CPU'}). "
               + _model_note(8, None, measured=False))
        result.rows.append(Row(NAME, "GPU step time, split fetch vs every rank fetching all: not measured", "",
                               None, note=why, short="GPU split fetch: not measured"))
    return result


if __name__ == "__main__":
    a = sys.argv[1:]
    _rank_main(int(a[0]), int(a[1]), int(a[2]), a[3], int(a[4]), int(a[5]), int(a[6]), a[7], a[8])
    # A rank's figures are on disk: end without the interpreter's teardown. A gloo worker
    # thread that drops a finished work (it holds Python tensors) while the interpreter
    # finalises needs the GIL and aborts the process ("terminate called without an active
    # exception"); the default group's threads can outlive destroy_process_group().
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
