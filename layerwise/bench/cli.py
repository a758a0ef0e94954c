"""Command line of ``python -m layerwise.bench``: pick the device and the sizes,
run the suites one after another (a suite that raises is reported and the
others still run). Each suite announces itself on stderr with its expected
duration and prints its table on stdout as it finishes; the JSON, Markdown
and plot are rewritten after every suite (an interrupted run keeps the suites
that finished); a summary and the legend close the run."""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

import torch

from layerwise.bench import (
    bus,
    cohort,
    compress,
    disk,
    h2d,
    hooks,
    moe,
    pipeline,
    quant,
    report,
    scatter,
    shared,
    split,
    startup,
    stream,
    tune,
)
from layerwise.bench import compile as compile_suite
from layerwise.bench.common import Context, Skip, SuiteResult
from layerwise.runtime.gpu_checks import cuda_unusable

# The default order puts a figure on the screen within seconds (h2d), then the
# headline sweep (stream), then the other suites shortest first.
SUITES = {m.NAME: m.run for m in (h2d, scatter, stream, hooks, tune, startup, bus, moe, quant, disk, compile_suite,
                                   pipeline, compress, split, shared, cohort)}
# Run only when named: it needs diffusers and transformers, and starts a fresh
# interpreter per method (python -m layerwise.bench pipeline).
# compress (python -m layerwise.bench compress) too, until the manager streams
# compressed layers and the stream sweep can compare both.
# split (python -m layerwise.bench split) and shared (python -m layerwise.bench shared) start
# N processes per method.
# cohort (python -m layerwise.bench cohort) times K = 1..8 calls one after another and together, at
# two bus speeds, for two models: minutes with --quick on 2 cores.
ON_REQUEST = {pipeline.NAME, compress.NAME, split.NAME, shared.NAME, cohort.NAME}

# Seconds a suite takes with --quick on the CPU, quoted by its progress line (2 cores of
# an AMD EPYC VM, torch 2.13 CPU, load average about 3: 3 min in all; compile: with inductor's
# caches warm, about 50 s cold); no figure is quoted for other sizes and devices (scatter: CUDA only).
QUICK_CPU_S = {h2d.NAME: 2, scatter.NAME: 0, stream.NAME: 15, hooks.NAME: 4, tune.NAME: 5, startup.NAME: 8,
               bus.NAME: 18, moe.NAME: 24, quant.NAME: 25, disk.NAME: 26, compile_suite.NAME: 30}


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


def _expected(name: str, ctx: Context) -> str:
    if ctx.scale == "quick" and not ctx.is_cuda and QUICK_CPU_S.get(name):
        return f"; about {QUICK_CPU_S[name]} s on 2 cores"
    return ""


def _run_suite(name: str, ctx: Context, k: int, n: int) -> SuiteResult:
    title = report.SUITE_TITLES.get(name, "")
    print(f"[{name}] suite {k} of {n}" + (f": {title}" if title else "") + _expected(name, ctx) + " ...",
          file=sys.stderr, flush=True)
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

    names = args.suites or [name for name in SUITES if name not in ON_REQUEST]
    interrupted = ""
    try:
        for k, name in enumerate(names, 1):
            try:
                res = _run_suite(name, ctx, k, len(names))
            except KeyboardInterrupt:
                interrupted = name
                break
            results.append(res)
            report.render_suite(res, wide=args.wide)
            write_files(final=False)
    finally:
        torch.set_num_threads(threads)
    report.render_summary(results, wide=args.wide, interrupted=interrupted)
    failed += [r.name for r in results if r.status == "error"]
    write_files(final=True)
    if interrupted:
        print(f"interrupted during {interrupted}: the output holds the {len(results)} suite(s) before it",
              file=sys.stderr)
        return 130
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0
