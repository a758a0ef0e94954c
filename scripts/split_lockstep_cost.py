"""What split fetch's lockstep check costs: 2 gloo ranks on
this machine, the median of 40 forwards of the test model (tests/helpers/split_worker.py:
9 streamed layers) at two sizes, and a bare 64-byte all-gather (one tag exchange).

    python scripts/split_lockstep_cost.py            # this tree
    PYTHONPATH=<other tree> python scripts/split_lockstep_cost.py   # to compare

Prints one line from rank 0.
"""
import datetime
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path


def rank_main(rank, world, port):
    import torch
    import torch.distributed as dist

    import layerwise

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from helpers.split_worker import Net

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    t = torch.zeros(8, dtype=torch.int64)
    out = torch.empty(8 * world, dtype=torch.int64)
    ts = []
    for k in range(550):
        t0 = time.perf_counter()
        dist.all_gather_into_tensor(out, t)
        if k >= 50:
            ts.append(time.perf_counter() - t0)
    rows = [f"bare 64 B gloo all-gather median {statistics.median(ts) * 1e6:.0f} us"]
    for d in (48, 512):
        torch.manual_seed(0)
        model = Net(d=d)
        managers = layerwise.configure_layerwise_offload(model, ["blocks", "extra"], device="cpu",
                                                         split_fetch=dist.group.WORLD)
        layer = sum(lp.nbytes for m in managers for lp in m.plan.layers) / sum(m.num_layers for m in managers)
        x = torch.randn(3, d)
        steps = []
        with torch.no_grad():
            for _ in range(5):
                model(x)
            dist.barrier()
            for _ in range(40):
                t0 = time.perf_counter()
                model(x)
                steps.append(time.perf_counter() - t0)
        rows.append(f"9 layers of {layer / 1024:.0f} KiB: step median {statistics.median(steps) * 1e3:.2f} ms")
        layerwise.remove_layerwise_offload(model)
    if rank == 0:
        print(f"{layerwise.__file__}: " + "; ".join(rows), flush=True)
    os._exit(0)


def main():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, "-W", "ignore", __file__, str(r), "2", str(port)]) for r in range(2)]
    sys.exit(max(p.wait(timeout=300) for p in procs))


if __name__ == "__main__":
    if len(sys.argv) == 4:
        rank_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
    else:
        main()
