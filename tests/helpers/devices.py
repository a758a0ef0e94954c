"""Which devices a test can use (tests/conftest.py's `device` fixture, and the
tests that need a GPU)."""
import torch

import layerwise


def cuda_usable() -> bool:
    """A GPU is visible and the extension was built with CUDA."""
    return torch.cuda.is_available() and layerwise.build_info()["with_cuda"]
