"""Ranks in subprocesses (tests/stages/test_split_fetch.py, test_chain_recovery.py,
tests/runtime/test_cuda_path.py): `run_ranks` starts WORLD copies of a worker of
this folder (split_worker.py by default) on a free local port and fails, with
each failed rank's stderr, unless every rank exits 0 after printing "rank R ok".
`run_sharers` (tests/runtime/test_rendezvous.py) does the same for processes that
meet through the rendezvous (no port), reading their output line by line so that
it can SIGKILL one of them at a given line."""
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

HELPERS = Path(__file__).resolve().parent
ROOT = HELPERS.parents[1]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_env():
    return {**os.environ,
            "PYTHONPATH": f"{ROOT}{os.pathsep}{HELPERS.parent}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def run_ranks(world, tmp_path, *scenario, worker="split_worker.py"):
    worker = HELPERS / worker
    port = free_port()
    env = _worker_env()
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


def run_sharers(n, tmp_path, *scenario, kill=None, worker="share_worker.py", timeout=120):
    """Start n workers (`worker INDEX N TMPDIR *scenario`), SIGKILL worker i when a line
    of its stdout equals `line` (kill=(i, line)), and return each worker's stdout
    lines. Fails, with each failed worker's stdout and stderr, unless every worker
    that was not killed exits 0 after printing "rank R ok"."""
    procs = [subprocess.Popen([sys.executable, str(HELPERS / worker), str(r), str(n), str(tmp_path), *scenario],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                              env=_worker_env())
             for r in range(n)]
    lines = [[] for _ in procs]
    errs = [[] for _ in procs]
    killed = set()

    def read_out(r):
        for text in procs[r].stdout:
            lines[r].append(text.rstrip("\n"))
            if kill is not None and kill[0] == r and text.rstrip("\n") == kill[1] and r not in killed:
                killed.add(r)
                procs[r].send_signal(signal.SIGKILL)

    def read_err(r):
        errs[r].append(procs[r].stderr.read())

    readers = [threading.Thread(target=f, args=(r,), daemon=True) for r in range(n) for f in (read_out, read_err)]
    for t in readers:
        t.start()
    end = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(0.0, end - time.monotonic()))
        for t in readers:  # a worker's forked child may hold its pipes a little longer
            t.join(timeout=max(0.0, end - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    failed = [f"worker {r} (exit {p.returncode}):\n" + "\n".join(lines[r])[-3000:] + "\n--- stderr:\n"
              + "".join(errs[r])[-3000:]
              for r, p in enumerate(procs)
              if r not in killed and (p.returncode != 0 or f"rank {r} ok" not in lines[r])]
    assert not failed, "\n".join(failed)
    if kill is not None:
        assert kill[0] in killed, f"worker {kill[0]} never printed {kill[1]!r}: {lines[kill[0]]}"
    return lines
