"""compress: lossless compression of 16-bit weights for the host -> device
transfer (format and API: layerwise/codec.py).

Inputs: weight-like tensors, rows of normal values with log-normal per-row
scales (sigma 0.5 around 0.02) and 1 in 10^4 values 50x larger, in bf16 and
fp16 (``weight_like``).

  ratio               encoded bytes / raw bytes, bf16 and fp16 (targets:
                      bf16 <= 0.80x, fp16 <= 0.95x); baseline: the entropy
                      bound of the same split (exponent entropy + raw bits),
                      what an ideal entropy coder of the exponents would reach;
  C++ encode, decode  GB/s of raw bytes, every hardware thread (decode also on
                      one thread, as the CPU copy worker will), against a torch
                      ``copy_`` of the same bytes on the host (no target);
  Triton decode       (CUDA) GB/s of decoded bytes written into the slot, against
                      a device-to-device ``copy_`` of the same bytes (target
                      >= 1000 GB/s, DESIGN.md);
  stream              (CUDA) a transfer-bound stream of layers without compute:
                      per layer an H2D copy of the encoded bytes (pinned arena,
                      copy stream) and the decode kernel into a slot (decode
                      stream), two staging buffers and two slots in flight,
                      against H2D copies of the raw bytes (the raw floor; target
                      <= 0.80x, DESIGN.md). Modelled here without the manager:
                      the manager's own stream sweep needs its wiring (next step).
  manager stream      (any device) the same model streamed by the manager with
                      compress="lossless" and with compress=None, blocks with
                      almost no compute: bytes that crossed the bus per step
                      (target <= 0.80x for bf16, DESIGN.md) and the step time of
                      each. On the CPU backend there is no bus to save: the
                      decode (one thread, on the copy worker) only adds time.

On a CPU the two CUDA rows say "not measured". Every decoder's output is
checked bitwise against the input before it is timed.
"""
from __future__ import annotations

import math
import os

import torch

from .common import GB, MB, Context, Row, Skip, Stat, SuiteResult, Target, compare, device_timer, ratio

NAME = "compress"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
RATIO_TARGETS = {"bf16": 0.80, "fp16": 0.95}
TRITON_TARGET_GBS = 1000.0
STREAM_TARGET = 0.80
# bytes of one weight-like tensor (per dtype); stream: layers x bytes per layer
SIZE_MB = {"full": 256, "quick": 64, "tiny": 2}
STREAM = {"full": (16, 256), "quick": (8, 64), "tiny": (4, 2)}
REPEATS = {"full": 10, "quick": 5, "tiny": 2}
MANAGER = {"full": (8, 64), "quick": (8, 8), "tiny": (4, 1)}  # layers x MB per layer


def weight_like(nbytes: int, dtype: torch.dtype, seed: int = 0, cols: int = 4096) -> torch.Tensor:
    """A host tensor of about `nbytes` bytes that looks like a layer's weights."""
    g = torch.Generator().manual_seed(seed)
    n = max(cols, nbytes // dtype.itemsize // cols * cols)
    scale = torch.exp(torch.randn(n // cols, 1, generator=g) * 0.5) * 0.02
    w = torch.randn(n // cols, cols, generator=g).mul_(scale).view(-1)
    w[torch.randint(0, n, (max(1, n // 10_000),), generator=g)] *= 50
    return w.to(dtype)


def entropy_bound(x: torch.Tensor) -> float:
    """Bytes per raw byte of an ideal entropy coder of the exponents (raw bits kept)."""
    v = x.view(torch.int16).to(torch.int32) & 0xFFFF
    sym, raw_bits = ((v >> 7) & 0xFF, 8) if x.dtype == torch.bfloat16 else ((v >> 10) & 0x1F, 11)
    p = torch.bincount(sym.view(-1), minlength=256).double() / v.numel()
    p = p[p > 0]
    return float(raw_bits - (p * p.log2()).sum()) / 16


def _gbs(stat: Stat, nbytes: int) -> Stat:
    return stat.map(lambda t: nbytes / t / GB)


def _check(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    if not torch.equal(got.reshape(-1).view(torch.uint8).cpu(), want.reshape(-1).view(torch.uint8).cpu()):
        raise AssertionError(f"compress: {what} is not bitwise equal to the input")


def _cpu_rows(ctx: Context, result: SuiteResult, tensors: dict, encoded: dict, repeats: int, bar) -> None:
    from .. import codec

    threads = os.cpu_count() or 1
    for tag, x in tensors.items():
        enc = encoded[tag]
        raw = x.view(-1).view(torch.uint8)
        out = torch.empty_like(raw)
        codec.decode(enc, out)
        _check(out, raw, f"C++ decode ({tag})")
        copy_dst = torch.empty_like(raw)
        samplers = {
            "encode": device_timer(ctx, lambda x=x: codec.encode(x)),
            "decode": device_timer(ctx, lambda e=enc, o=out: codec.decode(e, o)),
            "copy_": device_timer(ctx, lambda d=copy_dst, s=raw: d.copy_(s)),
        }
        if threads > 1:  # what the CPU copy worker will do: decode_into on its own thread
            samplers["decode 1"] = device_timer(ctx, lambda e=enc, o=out: codec.decode(e, o, threads=1))
        times = compare(samplers, repeats=repeats, warmup=1, bar=bar)
        nbytes = raw.numel()
        bw = {k: _gbs(s, nbytes) for k, s in times.items()}
        result.data[f"cpu {tag}"] = {"bytes": nbytes, "threads": threads, "seconds": times}
        for what, n_threads in (("encode", threads), ("decode", threads), ("decode 1", 1)):
            if what not in bw:
                continue
            op = what.split()[0]
            result.rows.append(Row(
                NAME, f"C++ {op}, {tag}, {nbytes // MB} MB weight-like, {n_threads} thread(s) (host)", "GB/s",
                bw[what], {"host copy_": bw["copy_"]}, {"/copy_": ratio(bw[what], bw["copy_"])},
                short=f"C++ {op}, {tag}, {n_threads} thread{'s' if n_threads > 1 else ''}"))


def _triton_rows(ctx: Context, result: SuiteResult, tensors: dict, encoded: dict, repeats: int, bar) -> None:
    from ..triton_kernels import decode as kernels

    for tag, x in tensors.items():
        enc_host = encoded[tag]
        header = kernels.parse_header(enc_host, enc_host.numel())
        enc = enc_host.to(ctx.device)
        want = x.to(ctx.device).view(-1)
        slot = torch.empty_like(want)
        kernels.decode_segment(enc, slot, header=header)
        ctx.synchronize()
        _check(slot, want, f"Triton decode ({tag})")
        flat = torch.empty_like(want)
        inner = 20
        times = compare({
            "triton decode": device_timer(ctx, lambda e=enc, s=slot: kernels.decode_segment(e, s, header=header),
                                          inner=inner),
            "d2d copy_": device_timer(ctx, lambda d=flat, s=want: d.copy_(s), inner=inner),
        }, repeats=repeats, warmup=2, bar=bar)
        nbytes = want.numel() * want.element_size()
        bw = {k: _gbs(s, nbytes) for k, s in times.items()}
        result.data[f"triton {tag}"] = {"bytes": nbytes, "seconds": times, "header": header._asdict()}
        result.rows.append(Row(
            NAME, f"Triton decode into the slot, {tag}, {nbytes // MB} MB", "GB/s", bw["triton decode"],
            {"d2d copy_": bw["d2d copy_"]}, {"/d2d copy_": ratio(bw["triton decode"], bw["d2d copy_"])},
            [Target(f">= {TRITON_TARGET_GBS:g} GB/s", bool(bw["triton decode"].median >= TRITON_TARGET_GBS))],
            short=f"Triton decode, {tag}"))


def _stream_rows(ctx: Context, result: SuiteResult, repeats: int, bar) -> None:
    """Transfer-bound stream of bf16 layers: encoded H2D + decode vs raw H2D."""
    import layerwise

    from .. import codec
    from ..triton_kernels import decode as kernels

    layers, layer_mb = ctx.pick(STREAM)
    xs = [weight_like(layer_mb * MB, torch.bfloat16, seed=100 + i) for i in range(layers)]
    encs = [codec.encode(x) for x in xs]
    headers = [kernels.parse_header(e, e.numel()) for e in encs]
    raw_bytes = sum(x.numel() * 2 for x in xs)
    enc_bytes = sum(e.numel() for e in encs)
    arena = layerwise.HostArena(raw_bytes + enc_bytes + 512 * layers, pinned=True, cuda=True)
    raw_h = [arena.allocate(x.numel() * 2) for x in xs]
    enc_h = [arena.allocate(e.numel()) for e in encs]
    for r, x, h, e in zip(raw_h, xs, enc_h, encs):
        r.copy_(x.view(-1).view(torch.uint8))
        h.copy_(e)
    del xs
    dev = ctx.device
    nmax = max(r.numel() for r in raw_h)
    slots = [torch.empty(nmax, dtype=torch.uint8, device=dev) for _ in range(2)]
    staging = [torch.empty(max(e.numel() for e in enc_h), dtype=torch.uint8, device=dev) for _ in range(2)]
    copy_stream, decode_stream = torch.cuda.Stream(dev), torch.cuda.Stream(dev)

    def raw_step():
        cur = torch.cuda.current_stream(dev)
        copy_stream.wait_stream(cur)
        with torch.cuda.stream(copy_stream):
            for i, r in enumerate(raw_h):
                slots[i % 2][: r.numel()].copy_(r, non_blocking=True)
        cur.wait_stream(copy_stream)

    def compressed_step():
        cur = torch.cuda.current_stream(dev)
        copy_stream.wait_stream(cur)
        decode_stream.wait_stream(cur)
        decoded = [None, None]
        for i, (e, h) in enumerate(zip(enc_h, headers)):
            buf = staging[i % 2][: e.numel()]
            with torch.cuda.stream(copy_stream):
                if decoded[i % 2] is not None:  # staging buffer i % 2 is free once layer i - 2 is decoded
                    copy_stream.wait_event(decoded[i % 2])
                buf.copy_(e, non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(copy_stream)
            with torch.cuda.stream(decode_stream):
                decode_stream.wait_event(copied)
                kernels.decode_segment(buf, slots[i % 2][: h.n_bytes], header=h)
                decoded[i % 2] = torch.cuda.Event()
                decoded[i % 2].record(decode_stream)
        cur.wait_stream(copy_stream)
        cur.wait_stream(decode_stream)

    compressed_step()
    ctx.synchronize()
    last = len(enc_h) - 1
    _check(slots[last % 2][: headers[last].n_bytes], raw_h[last], "streamed Triton decode")
    times = compare({"compressed": device_timer(ctx, compressed_step), "raw floor": device_timer(ctx, raw_step)},
                    repeats=repeats, warmup=2, bar=bar)
    ms = {k: s.map(lambda t: t * 1e3) for k, s in times.items()}
    r = ratio(ms["compressed"], ms["raw floor"])
    result.data["stream"] = {"layers": layers, "raw_bytes": raw_bytes, "encoded_bytes": enc_bytes,
                             "seconds": times, "arena_pinned": arena.pinned}
    result.rows.append(Row(
        NAME, f"transfer-bound stream, {layers} bf16 layers of {layer_mb} MB, encoded H2D + Triton decode",
        "ms", ms["compressed"], {"raw floor": ms["raw floor"]}, {"/raw floor": r},
        [Target.at_most(r, STREAM_TARGET, "raw floor")],
        note="" if arena.pinned else f"arena NOT pinned ({arena.pin_error})",
        short=f"stream, {layers} x {layer_mb} MB bf16, compressed"))


class _Weights(torch.nn.Module):
    """A block that is nearly all transfer: its output reads one weight."""

    def __init__(self, w: torch.Tensor):
        super().__init__()
        self.w = torch.nn.Parameter(w, requires_grad=False)

    def forward(self, x):
        return x + self.w[0, :1].float()


def _manager_rows(ctx: Context, result: SuiteResult, repeats: int, bar) -> None:
    """The manager's own stream, compress="lossless" against None: bytes per step and step time."""
    import layerwise

    layers, layer_mb = ctx.pick(MANAGER)
    models, managers = {}, {}
    for compress in (None, "lossless"):
        blocks = [_Weights(weight_like(layer_mb * MB, torch.bfloat16, seed=200 + i, cols=1024).view(-1, 1024))
                  for i in range(layers)]
        model = torch.nn.Module()
        model.blocks = torch.nn.ModuleList(blocks)
        managers[compress] = layerwise.configure_layerwise_offload(model, "blocks", device=ctx.device,
                                                                   prefetch_depth=1, compress=compress)[0]
        models[compress] = model
    x = torch.zeros(1, 1, device=ctx.device)

    def step(model):
        def run():
            y = x
            for b in model.blocks:
                y = b(y)
            return y
        return run

    outs = {k: step(m)() for k, m in models.items()}
    _check(outs["lossless"].view(torch.uint8), outs[None].view(torch.uint8), "manager stream, compressed")
    times = compare({"compressed": device_timer(ctx, step(models["lossless"])),
                     "uncompressed": device_timer(ctx, step(models[None]))}, repeats=repeats, warmup=2, bar=bar)
    per_step = {k: m.stats(sync=True)["last_step"]["bytes_copied"] for k, m in managers.items()}
    codec_stats = managers["lossless"].stats()["compress"]
    for m in models.values():
        layerwise.remove_layerwise_offload(m)
    moved = per_step["lossless"] / per_step[None]
    result.data["manager stream"] = {"layers": layers, "layer_mb": layer_mb, "bytes_per_step": per_step,
                                     "seconds": times, "codec": codec_stats}
    result.rows.append(Row(
        NAME, f"manager stream, {layers} bf16 layers of {layer_mb} MB, depth 1: bytes per step, "
              "compress='lossless' / None", "x", moved, {}, {}, [Target.at_most(moved, STREAM_TARGET, "uncompressed")],
        short=f"manager stream bytes/step, {layers} x {layer_mb} MB bf16"))
    ms = {k: s.map(lambda t: t * 1e3) for k, s in times.items()}
    r = ratio(ms["compressed"], ms["uncompressed"])
    result.rows.append(Row(
        NAME, f"manager stream, {layers} bf16 layers of {layer_mb} MB, depth 1: step time", "ms", ms["compressed"],
        {"uncompressed": ms["uncompressed"]}, {"/uncompressed": r}, [],
        note="" if ctx.is_cuda else "CPU backend: no bus to save; the decode runs on the copy worker (1 thread)",
        short=f"manager stream step, {layers} x {layer_mb} MB bf16, compressed"))


def run(ctx: Context) -> SuiteResult:
    try:
        from .. import codec
    except Exception as e:  # noqa: BLE001 - an extension built before the codec existed
        raise Skip(f"layerwise.codec does not import: {type(e).__name__}: {e}") from None
    result = SuiteResult(NAME)
    repeats = ctx.pick(REPEATS)
    nbytes = ctx.pick(SIZE_MB) * MB
    tensors = {tag: weight_like(nbytes, dt, seed=k) for k, (tag, dt) in enumerate(DTYPES.items())}
    encoded = {tag: codec.encode(x) for tag, x in tensors.items()}
    for tag, x in tensors.items():
        h = codec.read_header(encoded[tag])
        r = encoded[tag].numel() / (x.numel() * x.element_size())
        bound = entropy_bound(x)
        result.data[f"ratio {tag}"] = {"ratio": r, "entropy_bound": bound, "header": h}
        result.rows.append(Row(
            NAME, f"encoded / raw bytes, {tag} weight-like, {x.numel() * x.element_size() // MB} MB "
                  f"({h['mode']}, {h['width']}-bit codes)", "x", r, {"entropy bound": bound},
            {"/entropy bound": r / bound}, [Target.at_most(r, RATIO_TARGETS[tag], "raw bytes")],
            short=f"ratio, {tag} weight-like ({h['width']}-bit codes)"))
    with ctx.progress(4 * repeats * 2 + 10 + repeats + 2, NAME) as bar:
        _cpu_rows(ctx, result, tensors, encoded, repeats, bar)
        _manager_rows(ctx, result, repeats, bar)
        if ctx.is_cuda:
            _triton_rows(ctx, result, tensors, encoded, repeats, bar)
            _stream_rows(ctx, result, repeats, bar)
        else:
            why = f"needs a CUDA device (this run: {ctx.device})"
            result.rows.append(Row(NAME, "Triton decode GB/s: not measured", "", None, note=why,
                                   short="Triton decode: not measured"))
            result.rows.append(Row(NAME, "compressed transfer-bound stream vs raw floor: not measured", "", None,
                                   note=why + "",
                                   short="compressed stream: not measured"))
    if any(isinstance(r.ours, float) and math.isnan(r.ours) for r in result.rows):
        raise AssertionError("compress: a figure came out NaN")
    return result
