"""Command line of ``python -m layerwise.bench``: pick the device and the sizes,
run the suites one after another (a suite that raises is reported and the
others still run), print the table, write the JSON and the plot."""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

import torch

from layerwise.bench import (
    bus,
    compress,
    disk,
    h2d,
    hooks,
    moe,
    pipeline,
    quant,
    report,
    scatter,
    split,
    startup,
    stream,
    tune,
)
from layerwise.bench.common import Context, Skip, SuiteResult
from layerwise.runtime.gpu_checks import cuda_unusable

SUITES = {m.NAME: m.run for m in (h2d, scatter, stream, bus, tune, startup, hooks, disk, quant, moe, pipeline,
                                   compress, split)}
# Run only when named: it needs diffusers and transformers, and starts a fresh
# interpreter per method (python -m layerwise.bench pipeline).
# compress (python -m layerwise.bench compress) too, until the manager streams
# compressed layers and the stream sweep can compare both.
# split (python -m layerwise.bench split) starts N processes per method.
ON_REQUEST = {pipeline.NAME, compress.NAME, split.NAME}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m layerwise.bench",
        description="Benchmark layerwise weight streaming against torch copies and other offload schemes.",
    )
    p.add_argument("suites", nargs="*", metavar="SUITE",
                   help=f"suites to run, any of: {', '.join(SUITES)} (default: all but "
                        f"{', '.join(sorted(ON_REQUEST))}, which run when named)")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="default: cuda when a GPU is visible and layerwise was built with CUDA, else cpu")
    p.add_argument("--quick", action="store_true",
                   help="small problem sizes (minutes on a laptop CPU); default: sized for a large GPU")
    p.add_argument("--json", metavar="PATH", help="write every figure and the environment to PATH")
    p.add_argument("--plot", metavar="PATH", help="write the stream sweep as a PNG to PATH")
    p.add_argument("--markdown", metavar="PATH", help="write the table as Markdown (with command, machine, date)")
    p.add_argument("--wide", action="store_true",
                   help="every column (suite, baselines' figures, targets, notes inline) in the table and the "
                        "Markdown; default: a table that fits 120 columns, notes and targets under it")
    p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # test sizes: seconds
    return p


def _cuda_usable() -> tuple[bool, str]:
    why = cuda_unusable()
    return why is None, why or ""


def _run_suite(name: str, ctx: Context) -> SuiteResult:
    print(f"[{name}] running ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    try:
        res = SUITES[name](ctx)
    except Skip as e:
        res = SuiteResult(name, "skipped", str(e))
    except Exception as e:  # noqa: BLE001 - report, then run the other suites
        traceback.print_exc()
        res = SuiteResult(name, "error", f"{type(e).__name__}: {e}", data={"traceback": traceback.format_exc()})
    res.wall_s = time.perf_counter() - t0
    ctx.free_memory()
    summary = {"ok": f"{len(res.rows)} rows", "skipped": f"skipped: {res.reason}", "error": f"FAILED: {res.reason}"}
    print(f"[{name}] {summary[res.status]} ({res.wall_s:.1f} s)", file=sys.stderr, flush=True)
    return res


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = _parser()
    args = parser.parse_args(argv)
    unknown = [s for s in args.suites if s not in SUITES]
    if unknown:
        parser.error(f"unknown suite(s) {', '.join(unknown)}; choose from {', '.join(SUITES)}")
    cuda_ok, why = _cuda_usable()
    if args.device == "cuda" and not cuda_ok:
        parser.error(f"--device cuda: {why}")
    if (args.device or ("cuda" if cuda_ok else "cpu")) == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    scale = "tiny" if args.tiny else "quick" if args.quick else "full"
    ctx = Context(device, scale)
    threads = torch.get_num_threads()
    if device.type == "cpu":
        # Leave a core to the copy engine's worker thread: with every core in
        # torch's pool, an OpenMP barrier waiting on a preempted thread turns a
        # sub-millisecond step into tens of milliseconds on a small machine.
        torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
    env = report.environment(device, argv, vars(args))
    env["torch_threads"] = torch.get_num_threads()
    env["scale"] = scale
    print(f"layerwise {env['layerwise']} bench on {device} ({env['device_name']}), {scale} sizes, "
          f"torch {env['torch']}, {env['torch_threads']} compute thread(s)", file=sys.stderr, flush=True)
    results = []
    failed = []

    def write_files(final: bool) -> None:
        # After every suite: a run stopped by a time limit keeps what it measured.
        if args.json:
            report.write_json(args.json, results, env)
        if args.markdown:
            report.write_markdown(args.markdown, results, env, wide=args.wide)
        sweep = next((r for r in results if r.name == stream.NAME and r.status == "ok"), None)
        if args.plot and sweep is not None and (final or results[-1] is sweep):
            try:
                report.write_plot(args.plot, sweep, f"layerwise stream sweep on {env['device_name']}")
            except Exception:  # noqa: BLE001 - e.g. matplotlib missing
                traceback.print_exc()
                if final:
                    failed.append("plot")
        if final:
            for path in (args.json, args.markdown, args.plot if sweep is not None else None):
                if path:
                    print(f"wrote {path}", file=sys.stderr)
            if args.plot and sweep is None:
                print("no plot: the stream suite did not run", file=sys.stderr)

    try:
        for name in args.suites or [name for name in SUITES if name not in ON_REQUEST]:
            results.append(_run_suite(name, ctx))
            write_files(final=False)
    finally:
        torch.set_num_threads(threads)
    report.render_table(results, wide=args.wide)
    failed += [r.name for r in results if r.status == "error"]
    write_files(final=True)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0
