"""Tensor parallelism: each of 2 gloo ranks packs and streams only its local shards."""
import subprocess
import sys

import pytest
import torch.distributed as dist

from helpers.ranks import HELPERS, free_port


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="torch built without gloo")
def test_tensor_parallel_mlp_stack_on_two_gloo_ranks():
    worker = HELPERS / "tp_worker.py"
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(worker), str(r), "2", str(port)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=240) for p in procs]
    for r, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {r} failed:\n{err[-4000:]}"
        assert f"rank {r} ok" in out
