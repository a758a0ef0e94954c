import os

import pytest
import torch

# Triton reads TRITON_INTERPRET when a kernel is decorated: set it before any
# kernel module is imported, so the scatter kernel runs on CPU tensors in CI.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import layerwise  # noqa: E402

# One compute thread: the copy engine's workers need the other core, and an
# OpenMP pool spinning against them on a 2-core machine slows steps 100-fold.
torch.set_num_threads(1)


def cuda_usable() -> bool:
    return torch.cuda.is_available() and layerwise.build_info()["with_cuda"]


@pytest.fixture(params=["cpu", "cuda"])
def device(request):
    if request.param == "cuda" and not cuda_usable():
        pytest.skip("no CUDA device (or a CPU-only build): the CUDA variant runs in scripts/gpu_check.sh")
    return request.param
