"""layerwise benchmark: ``python -m layerwise.bench [SUITE ...] [--device cuda|cpu]
[--quick] [--json PATH] [--plot PATH]``.

Suites (none named = all of them; see each module's docstring):
  h2d      bandwidth of copies out of the host arena vs torch pinned / pageable copy_
  scatter  (CUDA) the Triton segment scatter vs device-to-device copy_ and copy_ loops
  stream   step time of a streamed DiT-like stack vs resident, naive offload and
           diffusers group offloading, across compute/transfer ratios
  startup  bytes moved by model.to, device / host peaks and time of configuring a
           multi-group model, for every group order, vs the naive per-group order
  hooks    CPU time of the offload hooks per layer, 8 vs 200 parameters

The device defaults to CUDA when torch sees one and layerwise was built with CUDA,
else the CPU; suites that cannot run there are reported as skipped, with the
reason. ``--quick`` sizes the run for about two minutes on 2 CPU cores (``make
bench`` on a CPU); without it, problems are sized for a large GPU. Each suite
prints its table as it finishes, a summary closes the run; sizes are in MiB,
bandwidths in GiB/s. The exit status is non-zero when a suite raised (130 when
interrupted: the files hold the suites that finished); a missed target is not a
failure, the table marks it.
"""
from layerwise.bench.cli import SUITES, main

__all__ = ["SUITES", "main"]
