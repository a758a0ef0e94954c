"""Offloaded vs resident step time on the CPU backend, with torch's default
intra-op thread count and with one thread fewer (the copy worker then has a
core of its own). Runs are interleaved (resident, offloaded, resident, ...)
so that a loaded machine slows both alike; prints the median of each and the
ratio. docs/supported.md, "The CPU backend and torch's threads" quotes it.

    python scripts/cpu_threads.py [--quick]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

import layerwise


class Blocks(nn.Module):
    def __init__(self, d: int, n: int):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
                                    for _ in range(n))

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return x


def step_s(model, x, reps: int) -> list[float]:
    out = []
    with torch.inference_mode():
        model(x)  # warm-up
        for _ in range(reps):
            t0 = time.perf_counter()
            model(x)
            out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    d, n, batch, rounds, reps = (512, 8, 64, 3, 5) if args.quick else (1024, 12, 128, 5, 10)
    default = torch.get_num_threads()
    torch.manual_seed(0)
    resident = Blocks(d, n).eval()
    offloaded = Blocks(d, n).eval()
    offloaded.load_state_dict(resident.state_dict())
    layerwise.configure_layerwise_offload(offloaded, "blocks", device="cpu", pin_memory=False)
    x = torch.randn(batch, d)
    for threads in sorted({default, max(1, default - 1)}, reverse=True):
        torch.set_num_threads(threads)
        res, off = [], []
        for _ in range(rounds):
            res += step_s(resident, x, reps)
            off += step_s(offloaded, x, reps)
        r, o = statistics.median(res), statistics.median(off)
        print(f"torch threads {threads} (default {default}): resident {r * 1e3:.1f} ms, offloaded {o * 1e3:.1f} ms "
              f"per step (medians of {len(res)}): offloaded / resident = {o / r:.2f}x")
    torch.set_num_threads(default)


if __name__ == "__main__":
    main()
