"""scatter (CUDA only): the Triton kernel that writes one received segment into
the parameter tensors it feeds, in one launch.

  contiguous   a 100 MiB bf16 segment into 100 contiguous destinations, GiB/s,
               against one device-to-device ``copy_`` of the same bytes
               (target >= 0.8x);
  small layer  a layer of 200 small tensors (norms, biases, small matrices), time
               per layer, against a Python loop of 200 ``copy_`` calls
               (target >= 5x faster);
  transposed   destinations that are transposed views (strides (1, rows)), GiB/s,
               against ``dst.copy_(src.view(shape))`` per tensor (no target).

The kernel module is imported inside the suite; when it is missing or Triton
cannot load, the suite is reported as skipped with the import error. Every
layout is checked against ``copy_`` once before it is timed.
"""
from __future__ import annotations

import torch

from layerwise.bench.common import Context, GiB, MiB, Row, Skip, SuiteResult, Target, compare, device_timer, ratio

NAME = "scatter"
DTYPE = torch.bfloat16
REPEATS = {"full": 20, "quick": 10, "tiny": 3}


def _load_kernels():
    try:
        from layerwise.triton_kernels import scatter as kernels
    except Exception as e:  # noqa: BLE001 - ImportError, or Triton failing to load
        raise Skip(f"layerwise.triton_kernels.scatter does not import: {type(e).__name__}: {e}") from None
    return kernels


def _layout(shapes, device, transposed=False):
    """A bf16 segment holding every tensor of `shapes` back to back (offsets
    rounded to 128 elements = 256 bytes), and empty destinations of those shapes
    (transposed views of a (cols, rows) tensor when `transposed`)."""
    offsets, pos = [], 0
    for shape in shapes:
        offsets.append(pos)
        n = 1
        for s in shape:
            n *= s
        pos += -(-n // 128) * 128
    segment = torch.randn(pos, device=device).to(DTYPE)
    if transposed:
        dsts = [torch.empty(s[::-1], dtype=DTYPE, device=device).t() for s in shapes]
    else:
        dsts = [torch.empty(s, dtype=DTYPE, device=device) for s in shapes]
    srcs = [segment[o : o + d.numel()].view(d.shape) for o, d in zip(offsets, dsts)]
    return segment, offsets, dsts, srcs


def _copy_loop(dsts, srcs):
    def f():
        for d, s in zip(dsts, srcs):
            d.copy_(s)
    return f


def _check(kernels, segment, offsets, dsts, srcs, table, what):
    for d in dsts:
        d.zero_()
    kernels.scatter_segment(segment, None, None, table=table)
    torch.cuda.synchronize()
    bad = [i for i, (d, s) in enumerate(zip(dsts, srcs)) if not torch.equal(d, s)]
    if bad:
        raise AssertionError(f"scatter ({what}): destinations {bad[:5]} differ from the segment")


def run(ctx: Context) -> SuiteResult:
    if not ctx.is_cuda:
        raise Skip("the Triton scatter kernel runs on CUDA devices only (this run: cpu)")
    kernels = _load_kernels()
    repeats = ctx.pick(REPEATS)
    result = SuiteResult(NAME)
    seg_mb = 4 if ctx.scale == "tiny" else 100
    cases = {
        # name: (shapes, transposed, inner calls per sample)
        "contiguous": ([(MiB // 2,)] * seg_mb, False, 20),  # 1 MiB of bf16 each
        "small layer": ([(1024,) if i % 4 == 0 else (128, 64 + 16 * (i % 8)) for i in range(200)], False, 10),
        "transposed": ([(2048, 4096 if ctx.scale != "tiny" else 256)] * (seg_mb // 16 or 1), True, 20),
    }
    with ctx.progress(len(cases) * (repeats + 2), NAME) as bar:
        for what, (shapes, transposed, inner) in cases.items():
            segment, offsets, dsts, srcs = _layout(shapes, ctx.device, transposed)
            table = kernels.build_scatter_table(segment, offsets, dsts)
            _check(kernels, segment, offsets, dsts, srcs, table, what)
            samplers = {
                "triton scatter": device_timer(ctx, lambda: kernels.scatter_segment(segment, None, None, table=table),
                                               inner=inner),
                "copy_ loop": device_timer(ctx, _copy_loop(dsts, srcs), inner=inner),
            }
            if what == "contiguous":
                flat, whole = torch.empty_like(segment), segment
                samplers["d2d copy_"] = device_timer(ctx, lambda: flat.copy_(whole), inner=inner)
            times = compare(samplers, repeats=repeats, warmup=2, bar=bar)
            nbytes = sum(d.numel() for d in dsts) * DTYPE.itemsize
            result.data[what] = {"tensors": len(dsts), "bytes": nbytes, "seconds": times}
            if what == "small layer":
                us = {k: s.map(lambda t: t * 1e6) for k, s in times.items()}
                speedup = ratio(us["copy_ loop"], us["triton scatter"])
                result.rows.append(Row(NAME, f"layer of {len(dsts)} small tensors", "us/layer",
                                       us["triton scatter"], {"copy_ loop": us["copy_ loop"]},
                                       {"speedup": speedup},
                                       [Target(">= 5x faster than copy_ loop", bool(speedup >= 5))]))
                continue
            bw = {k: s.map(lambda t, n=nbytes: n / t / GiB) for k, s in times.items()}
            ref = "d2d copy_" if what == "contiguous" else "copy_ loop"
            r = ratio(bw["triton scatter"], bw[ref])
            targets = [Target.at_least(r, 0.8, ref)] if what == "contiguous" else []
            result.rows.append(Row(NAME, f"{nbytes // MiB} MiB into {len(dsts)} {what} tensors", "GiB/s",
                                   bw["triton scatter"], {k: v for k, v in bw.items() if k != "triton scatter"},
                                   {f"/{ref}": r}, targets))
    return result
