"""Fixtures of the codec's tests."""
import pytest
import torch


# (the codec's own, beside tests/conftest.py's: its CUDA variant skips only where no GPU is visible)
@pytest.fixture(params=["cpu", "cuda"])
def device(request):
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("CUDA is not available")
    return request.param
