"""The first minute on a GPU (scripts/gpu_check.sh, stage "smoke"): the figures
that matter most, in one JSON, rewritten as each section ends so that a run cut
at its limit keeps what it measured.

    python scripts/gpu_smoke.py OUT.json            # on a GPU: about 30-60 s
    python scripts/gpu_smoke.py OUT.json --cpu      # the same code on the CPU backend, small sizes
    python scripts/gpu_smoke.py --key-figures OUT.json [BENCH.json]   # the lines summary.txt gets

Sections (each records its error instead of stopping the others):
  build    layerwise.build_info(), python / torch / triton versions, TRITON_INTERPRET
  device   name, compute capability, memory, SMs
  h2d      CopyEngine.copy_async out of a pinned HostArena against torch's pinned
           copy_(non_blocking=True), 64 MiB and 1 GiB, medians of CUDA-event timings;
           target >= 0.95x (docs/design.md, "Performance targets")
  stream   one model streamed with the GPU behind the host (a GPU sleep before every
           block, two copy streams), raw and compress="lossless": bitwise against the
           resident model, the step, the meter's bytes and copy time, fetches timed
           without a start (must be 0)
  decode   one Triton decode of a 64 MiB bf16 weight-like segment into device memory:
           bitwise, GiB/s of decoded bytes against a device-to-device copy_; target
           >= 931 GiB/s (1000 GB/s)

--cpu runs every section on the CPU backend at small sizes (torch's copy_ for the
baseline, the C++ decoder for the decode): what CI checks of this script
(tests/bench/test_gpu_check_script.py); its figures say nothing about a GPU.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import sys
import time
import traceback

# (torch is imported where a section runs: --key-figures reads JSON only, in a blink)

H2D_TARGET = 0.95  # x torch's pinned copy_, copies of 64 MiB and more
DECODE_TARGET_GBS = 1000e9 / 2**30  # docs/design.md's 1000 GB/s of decoded bytes, in GiB/s (931)
SIZES = {  # (h2d copy sizes in MiB, stream: width, blocks; decode segment MiB)
    "cuda": ([64, 1024], (4096, 8), 64),
    "cpu": ([4, 16], (256, 6), 1),
}


def write(doc: dict, path: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, default=str)
        f.write("\n")
    os.replace(tmp, path)  # (a run killed while writing leaves the previous whole file)


def build_section(device) -> dict:
    import torch

    import layerwise

    out = {"layerwise": layerwise.build_info(), "python": platform.python_version(), "torch": torch.__version__,
           "torch_cuda": torch.version.cuda, "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET")}
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError as e:
        out["triton"] = f"not importable: {e}"
    return out


def device_section(device) -> dict:
    import torch

    if device.type != "cuda":
        return {"type": "cpu", "name": platform.processor() or platform.machine(), "cores": os.cpu_count()}
    p = torch.cuda.get_device_properties(device)
    return {"type": "cuda", "name": p.name, "capability": f"{p.major}.{p.minor}", "memory_bytes": p.total_memory,
            "multiprocessors": p.multi_processor_count, "count": torch.cuda.device_count()}


def h2d_section(device) -> dict:
    import torch

    import layerwise
    from layerwise.bench.common import Context, GiB, MiB, compare, device_timer, stream_handle

    ctx = Context(device, "quick", show_progress=False)
    cuda = device.type == "cuda"
    engine = layerwise.CopyEngine(str(device))
    out = {"baseline": "torch pinned copy_(non_blocking=True)" if cuda else "torch copy_", "sizes": []}
    for mb in SIZES[device.type][0]:
        n = mb * MiB
        arena = layerwise.HostArena(n, pinned=True, cuda=cuda)
        src = arena.allocate(n).fill_(1)
        dst = torch.empty(n, dtype=torch.uint8, device=device)
        base = torch.ones(n, dtype=torch.uint8)
        if cuda:
            base = base.pin_memory()
            stream = stream_handle(device)

            def ours(dst=dst, src=src):
                engine.wait(engine.copy_async(dst, src), stream)

            def theirs(dst=dst, base=base):
                dst.copy_(base, non_blocking=True)
        else:
            def ours(dst=dst, src=src):
                engine.copy_async(dst, src).synchronize()

            def theirs(dst=dst, base=base):
                dst.copy_(base)
        inner = max(1, 256 * MiB // n) if cuda else 1
        times = compare({"arena": device_timer(ctx, ours, inner=inner),
                         "torch": device_timer(ctx, theirs, inner=inner)},
                        repeats=5 if n >= 512 * MiB else 10, warmup=1)
        gbs = {k: n / s.median / GiB for k, s in times.items()}
        r = gbs["arena"] / gbs["torch"]
        out["sizes"].append({"mb": mb, "arena_gbs": gbs["arena"], "torch_gbs": gbs["torch"], "ratio": r,
                             "target": f">= {H2D_TARGET}x", "met": bool(r >= H2D_TARGET) if cuda else None,
                             "arena_pin_kind": arena.pin_kind, "arena_pin_error": arena.pin_error})
        del arena, src, dst, base, ours, theirs  # (1 GiB pinned: freed before the next size)
    engine.synchronize()
    return out


def make_net(d: int, n: int):
    """n residual blocks of one bf16 Linear(d, d): what the stream section streams."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(d, d, dtype=torch.bfloat16)

        def forward(self, x):
            return x + torch.relu(self.fc(x))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(n))

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x

    return Net()


def behind_the_host(model, ms: float) -> list:
    """A GPU sleep of about `ms` before every block's kernels (pre-hooks registered
    after configure: after layerwise's wait for the block's copy): the host runs
    ahead of the GPU, and every fetch and slot reuse is ordered by events alone."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(1_000_000)
    end.record()
    end.synchronize()
    cycles = int(1_000_000 * ms / start.elapsed_time(end))
    return [b.register_forward_pre_hook(lambda *a: torch.cuda._sleep(cycles)) for b in model.blocks]


def stream_section(device) -> dict:
    import torch

    import layerwise

    d, n = SIZES[device.type][1]
    torch.manual_seed(0)
    base = make_net(d, n).eval()
    ref = copy.deepcopy(base).to(device)
    x = torch.randn(8, d, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).to(device)
    with torch.no_grad():
        want = ref(x)
    out = {"model": f"{n} blocks of Linear({d}, {d}) bf16, {sum(p.numel() * 2 for p in base.parameters()) >> 20} MiB",
           "options": "prefetch_depth=1, num_copy_streams=2" + (", a 1 ms GPU sleep before every block"
                                                                if device.type == "cuda" else "")}
    for compress in (None, "lossless"):
        model = copy.deepcopy(base)
        (m,) = layerwise.configure_layerwise_offload(model, "blocks", device=device, prefetch_depth=1,
                                                     num_copy_streams=2, compress=compress)
        if device.type == "cuda":
            behind_the_host(model, 1.0)
        m.meter.listen(True)  # every step timed (on CUDA one in 8 otherwise)
        equal, walls = True, []
        with torch.no_grad():
            for _ in range(4):
                t0 = time.perf_counter()
                y = model(x)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                walls.append(time.perf_counter() - t0)
                equal = equal and torch.equal(y, want)
        st = m.stats(sync=True)
        m.meter.listen(False)
        last = st["last_step"] or {}
        copy_s = last.get("copy_s")
        # copy_s: each fetch from its first copy's start to its end (compressed: the decode's end,
        # after the decode's wait for its slot): bytes over the bus per second of fetching
        row = {"bitwise": equal, "step_s": sorted(walls[1:])[len(walls[1:]) // 2],
               "bytes_copied": last.get("bytes_copied"), "copy_s": copy_s,
               "fetch_gbs": last["bytes_copied"] / copy_s / 1e9 if copy_s else None,
               "fetches_without_start": m.meter.unstarted}
        if compress:
            c = st["compress"]
            row.update(ratio=c["ratio"], layers_raw=len(c["layers_raw"]),
                       decode_ms=1e3 * c["decode_s"] / c["decodes_timed"] if c["decodes_timed"] else None)
        out[compress or "raw"] = row
        layerwise.remove_layerwise_offload(model)
        del model, m
    return out


def decode_section(device) -> dict:
    import torch

    from layerwise import codec
    from layerwise.bench.common import Context, GiB, MiB, compare, device_timer
    from layerwise.bench.compress import weight_like

    mb = SIZES[device.type][2]
    x = weight_like(mb * MiB, torch.bfloat16)
    t0 = time.perf_counter()
    enc = codec.encode(x, dtype=torch.bfloat16)
    encode_s = time.perf_counter() - t0
    raw = x.view(torch.uint8).view(-1)
    out = {"segment": f"{raw.numel() / MiB:.0f} MiB bf16 weight-like", "ratio": enc.numel() / raw.numel(),
           "encode_gbs_cpu": raw.numel() / encode_s / GiB}
    ctx = Context(device, "quick", show_progress=False)
    if device.type == "cuda":
        from layerwise.runtime.gpu_checks import check_decode_path
        from layerwise.triton_kernels import decode as kernels

        check_decode_path(device)
        header = kernels.parse_header(enc, enc.numel())
        enc_d, want = enc.to(device), raw.to(device)
        slot, flat = torch.empty_like(want), torch.empty_like(want)
        t0 = time.perf_counter()
        kernels.decode_segment(enc_d, slot, header=header)  # (compiles the kernel)
        torch.cuda.synchronize(device)
        out["first_call_s"] = time.perf_counter() - t0
        decode = lambda: kernels.decode_segment(enc_d, slot, header=header)  # noqa: E731
        d2d = lambda: flat.copy_(want)  # noqa: E731
        out["backend"] = "triton"
    else:
        want = raw
        slot, flat = torch.empty_like(want), torch.empty_like(want)
        decode = lambda: codec.decode_segment(enc, slot, backend="native")  # noqa: E731
        d2d = lambda: flat.copy_(want)  # noqa: E731
        out["backend"] = "native (C++)"
    decode()
    ctx.synchronize()
    out["bitwise"] = bool(torch.equal(slot, want))
    times = compare({"decode": device_timer(ctx, decode, inner=5), "d2d": device_timer(ctx, d2d, inner=5)},
                    repeats=10, warmup=2)
    gbs = {k: raw.numel() / s.median / GiB for k, s in times.items()}
    out.update(decode_gbs=gbs["decode"], d2d_copy_gbs=gbs["d2d"], target=f">= {DECODE_TARGET_GBS:.0f} GiB/s",
               met=bool(gbs["decode"] >= DECODE_TARGET_GBS) if device.type == "cuda" else None)
    return out


SECTIONS = {"build": build_section, "device": device_section, "h2d": h2d_section, "stream": stream_section,
            "decode": decode_section}


def run(path: str, cpu: bool) -> int:
    import torch

    if not cpu and not torch.cuda.is_available():
        print("gpu_smoke: torch sees no CUDA device (pass --cpu for the CPU backend's run)", file=sys.stderr)
        return 2
    device = torch.device("cpu") if cpu else torch.device("cuda", torch.cuda.current_device())
    doc = {"when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "mode": "cpu" if cpu else "cuda", "seconds": {}}
    failed = []
    for name, fn in SECTIONS.items():
        t0 = time.perf_counter()
        try:
            doc[name] = fn(device)
        except Exception as e:  # noqa: BLE001 - recorded, and the next section runs
            traceback.print_exc()
            doc[name] = {"error": f"{type(e).__name__}: {e}"}
            failed.append(name)
        doc["seconds"][name] = round(time.perf_counter() - t0, 2)
        write(doc, path)
        print(f"gpu_smoke: {name} ({doc['seconds'][name]:.1f} s){' FAILED' if name in failed else ''}", flush=True)
    print("\n".join(key_figures(doc)))
    return 1 if failed else 0


# ------------------------------------------------------------ key figures
def _f(x, fmt="{:.1f}") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def _met(m) -> str:
    return {True: "met", False: "MISSED", None: "no target here"}[m]


def key_figures(doc: dict) -> list[str]:
    """The figures of a smoke (or bench) JSON, one line each (summary.txt); a part
    that cannot be read says so instead of hiding the others."""
    if "suites" in doc:
        return bench_figures(doc)
    lines = []
    for name in SECTIONS:
        sec = doc.get(name)
        if sec is None:
            lines.append(f"{name}: not reached")
        elif "error" in sec:
            lines.append(f"{name}: FAILED {sec['error'][:150]}")
        else:
            try:
                lines += FIGURES[name](doc, sec)
            except (KeyError, TypeError, ValueError) as e:
                lines.append(f"{name}: figures not read ({type(e).__name__}: {e})")
    return lines


def _build_figures(doc, b) -> list[str]:
    lw = b["layerwise"]
    return [f"build: with_cuda={lw.get('with_cuda')} cuda {lw.get('cuda_version')} torch {b.get('torch')} "
            f"triton {b.get('triton')} python {b.get('python')}"]


def _device_figures(doc, dev) -> list[str]:
    if dev.get("type") == "cuda":
        return [f"device: {dev['name']} (capability {dev['capability']}, {_f(dev['memory_bytes'] / 2**30)} GiB, "
                f"{dev['multiprocessors']} SMs)"]
    return [f"device: CPU backend on {dev['name']}, {dev.get('cores')} cores (no GPU figures)"]


def _h2d_figures(doc, h) -> list[str]:
    return [f"h2d {s['mb']} MiB: arena {_f(s['arena_gbs'])} GiB/s, {h['baseline']} {_f(s['torch_gbs'])} GiB/s: "
            f"{_f(s['ratio'], '{:.3f}')}x ({s['target']}: {_met(s['met'])})" for s in h["sizes"]]


def _stream_figures(doc, st) -> list[str]:
    lines = []
    for k in ("raw", "lossless"):
        r = st.get(k)
        if not r:
            continue
        extra = (f", ratio {_f(r.get('ratio'), '{:.3f}')}, decode {_f(r.get('decode_ms'), '{:.2f}')} ms"
                 if k == "lossless" else "")
        lines.append(f"stream {k}: bitwise {'yes' if r['bitwise'] else 'NO'}, step {_f(r['step_s'] * 1e3, '{:.2f}')} "
                     f"ms, fetch {_f(r['fetch_gbs'], '{:.2f}')} GiB/s, fetches without a start "
                     f"{r['fetches_without_start']}{extra}")
    return lines


def _decode_figures(doc, dec) -> list[str]:
    return [f"decode {dec['segment']} ({dec['backend']}): {_f(dec['decode_gbs'])} GiB/s, bitwise "
            f"{'yes' if dec['bitwise'] else 'NO'}, d2d copy_ {_f(dec['d2d_copy_gbs'])} GiB/s, ratio "
            f"{_f(dec['ratio'], '{:.3f}')} ({dec['target']}: {_met(dec['met'])})"]


FIGURES = {"build": _build_figures, "device": _device_figures, "h2d": _h2d_figures, "stream": _stream_figures,
           "decode": _decode_figures}


def bench_figures(doc: dict) -> list[str]:
    """A bench JSON's rows that carry targets, and each suite's status (summary.txt)."""
    lines = []
    for name, suite in doc.get("suites", {}).items():
        if suite.get("status") != "ok":
            lines.append(f"bench {name}: {suite.get('status')} {str(suite.get('reason'))[:150]}")
            continue
        for row in suite.get("rows", []):
            if not row.get("targets"):
                continue
            ours = row.get("ours")
            value = ours.get("median") if isinstance(ours, dict) else ours
            labels = "; ".join(f"{t['label']}: {'met' if t['met'] else 'MISSED'}" for t in row["targets"])
            lines.append(f"bench {name}: {row.get('short') or row['measure']}: {_f(value, '{:.4g}')} {row['unit']} "
                         f"({labels})")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", nargs="?", help="the JSON to write")
    p.add_argument("--cpu", action="store_true", help="the CPU backend, small sizes (CI)")
    p.add_argument("--key-figures", nargs="+", metavar="JSON", help="print the key figures of these JSON files")
    args = p.parse_args(argv)
    if args.key_figures:
        for path in args.key_figures:
            try:
                with open(path) as f:
                    doc = json.load(f)
            except (OSError, ValueError) as e:
                print(f"{os.path.basename(path)}: not read ({e})")
                continue
            print("\n".join(key_figures(doc)))
        return 0
    if not args.out:
        p.error("give the JSON to write (or --key-figures FILE ...)")
    return run(args.out, args.cpu)


if __name__ == "__main__":
    sys.exit(main())
