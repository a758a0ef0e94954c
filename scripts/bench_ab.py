"""Before/after figures of one benchmark suite from two checkouts, interleaved on one machine.

    python scripts/bench_ab.py BEFORE_CHECKOUT AFTER_CHECKOUT [--suite hooks] [--rounds 5] [--quick]

Each checkout must have its extension built (`make build`, or `python setup.py build_ext
--inplace`). Runs `python -m layerwise.bench SUITE --device cpu --json ...` from each
checkout in turn, ROUNDS times (before, after, before, after, ...: drift in the machine's
load lands on both), and prints a Markdown table of each row's median of the run medians.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile


def one_run(checkout: str, suite: str, quick: bool, out: str) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(checkout))
    cmd = [sys.executable, "-m", "layerwise.bench", suite, "--device", "cpu", "--json", out]
    cmd += ["--quick"] if quick else []
    subprocess.run(cmd, cwd=checkout, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = json.load(open(out))["suites"][suite]["rows"]
    return {r["measure"] + f" ({r['unit']})": (r["ours"]["median"] if isinstance(r["ours"], dict) else r["ours"])
            for r in rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--suite", default="hooks")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    runs: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for tag, checkout in (("before", args.before), ("after", args.after)):
                runs[tag].append(one_run(checkout, args.suite, args.quick, os.path.join(tmp, f"{tag}{r}.json")))
                print(f"{tag} round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    print("| measure | before | after | after/before | before's runs | after's runs |")
    print("|---|---|---|---|---|---|")
    for k in runs["before"][0]:
        b = [x[k] for x in runs["before"]]
        a = [x[k] for x in runs["after"] if k in x]
        if not a:
            continue
        mb, ma = statistics.median(b), statistics.median(a)
        r = f"{ma / mb:.3f}" if mb else "n/a"  # (a count that was 0 before)
        print(f"| {k} | {mb:.4g} | {ma:.4g} | {r} | {min(b):.4g}-{max(b):.4g} | {min(a):.4g}-{max(a):.4g} |")


if __name__ == "__main__":
    main()
