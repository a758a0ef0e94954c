"""Step time of N processes streaming one checkpoint with share_host against N
separate arenas, the two ways interleaved round by round (the shared bench
suite runs them one after the other, so a change of the machine's load between
them shows as a difference): python scripts/shared_step_ab.py [ROUNDS] [N]."""
import os
import statistics
import sys
import tempfile

import torch
from safetensors.torch import save_file

from layerwise.bench.common import mlp_stack
from layerwise.bench.shared import SHAPE, _launch


def main(rounds: int = 3, n: int = 2) -> None:
    layers, d = SHAPE["quick"]
    tmp = tempfile.mkdtemp()
    torch.manual_seed(0)
    ckpt = os.path.join(tmp, "model.safetensors")
    save_file({k: v.contiguous() for k, v in mlp_stack(layers, d).state_dict().items()}, ckpt)
    for r in range(rounds):
        for mode in ("separate", "shared"):
            run = tempfile.mkdtemp(dir=tmp)
            os.link(ckpt, os.path.join(run, "model.safetensors"))
            procs = _launch(n, mode, run, layers, d, 20, "cpu", 300)
            print(f"round {r} {mode:8s} median step per process (s):",
                  [round(statistics.median(p["times"]), 4) for p in procs], flush=True)


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
