"""The compute-bound cost of concurrent calls, with and without shared fetches.

    python scripts/cohort_compute_bound_ab.py [ROUNDS]

The cohort suite's tiny Flux (`--quick` size) at its compute-bound point (the
simulated bus set so that one pass's bytes take 0.25x its compute), four calls
of mixed shapes, three ways interleaved round by round: one after another
(serial), `run_together` with `share_calls=True` (on) and with
`share_calls=False` (off: the calls still run at once on threads, each fetching
its own layers). Where `off` is as far below serial as `on`, the cost is the
threads' (layers handed from thread to thread under the model's lock, the GIL,
the cores they share), not the shared fetches. Prints each round's walls in ms
and the medians.
"""
import statistics
import sys
import time

import torch

import layerwise
from layerwise.bench import bus
from layerwise.bench import cohort as suite
from layerwise.bench.common import clone_module


def main(rounds: int) -> None:
    torch.set_num_threads(1)  # (the bench CLI's setting on this 2-core machine)
    work = suite.Flux(suite.SIZES["quick"])
    calls = [work.call(k) for k in range(4)]
    per_forward = []
    for k in range(3):
        t = time.perf_counter()
        calls[k](work.model)
        per_forward.append((time.perf_counter() - t) / work.forwards)
    probe = clone_module(work.model)
    layerwise.configure_layerwise_offload(probe, work.groups, device="cpu")
    pass_bytes = sum(len(g.ring.streamed) * g.plan.layers[0].nbytes for g in layerwise.managers_of(probe))
    layerwise.remove_layerwise_offload(probe)
    gbps = pass_bytes / (suite.POINTS["compute-bound"] * statistics.mean(per_forward)) / 1e9
    with bus.simulated_bus(gbps):
        models = {}
        for share in (True, False):
            m = clone_module(work.model)
            layerwise.configure_layerwise_offload(m, work.groups, device="cpu", share_calls=share)
            calls[0](m)  # (warm)
            models[share] = m
        walls = {"serial": [], "on": [], "off": []}
        for _ in range(rounds):
            t = time.perf_counter()
            for c in calls:
                c(models[True])
            walls["serial"].append(time.perf_counter() - t)
            for name, share in (("on", True), ("off", False)):
                t = time.perf_counter()
                layerwise.run_together(models[share], calls)
                walls[name].append(time.perf_counter() - t)
            print({k: round(v[-1] * 1e3, 1) for k, v in walls.items()})
    med = {k: statistics.median(v) for k, v in walls.items()}
    print("medians (ms):", {k: round(v * 1e3, 1) for k, v in med.items()},
          f"serial/on {med['serial'] / med['on']:.3f}, serial/off {med['serial'] / med['off']:.3f}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 7)
