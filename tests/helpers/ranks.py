"""Ranks in subprocesses (tests/stages/test_split_fetch.py, test_chain_recovery.py,
tests/runtime/test_cuda_path.py): `run_ranks` starts WORLD copies of a worker of
this folder (split_worker.py by default) on a free local port and fails, with
each failed rank's stderr, unless every rank exits 0 after printing "rank R ok"."""
import os
import socket
import subprocess
import sys
from pathlib import Path

HELPERS = Path(__file__).resolve().parent
ROOT = HELPERS.parents[1]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(world, tmp_path, *scenario, worker="split_worker.py"):
    worker = HELPERS / worker
    port = free_port()
    env = {**os.environ,
           "PYTHONPATH": f"{ROOT}{os.pathsep}{HELPERS.parent}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    procs = [subprocess.Popen([sys.executable, str(worker), str(r), str(world), str(port), str(tmp_path), *scenario],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
             for r in range(world)]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    failed = [f"rank {r} (exit {p.returncode}):\n{err[-3000:]}" for r, (p, (out, err)) in enumerate(zip(procs, outs))
              if p.returncode != 0 or f"rank {r} ok" not in out]
    assert not failed, "\n".join(failed)
