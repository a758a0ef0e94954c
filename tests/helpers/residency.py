"""The residency tests' model and checks (tests/runtime/test_residency.py,
test_residency_transaction.py): the two-group model at a size where every
placement of set_residency differs, its inputs and outputs, and leaf equality
that compares a quantized wrapper by its inner tensors."""
import torch
from torch import nn

from helpers.models import TwoGroupModel

GROUPS = ["transformer_blocks", "single_transformer_blocks"]


def make(seed=0, n_a=6, n_b=4, d=32):
    torch.manual_seed(seed)
    return TwoGroupModel(d=d, n_a=n_a, n_b=n_b).eval()


def quantized(seed=0):
    """`make(seed)` with torchao Int8WeightOnly on every Linear of both groups."""
    import pytest

    quant = pytest.importorskip("torchao.quantization")
    m = make(seed)
    for blocks in (m.transformer_blocks, m.single_transformer_blocks):
        quant.quantize_(blocks, quant.Int8WeightOnlyConfig(), filter_fn=lambda mod, fqn: isinstance(mod, nn.Linear))
    return m


def inputs(n=2, d=32):
    g = torch.Generator().manual_seed(7)
    return [torch.randn(3, d, generator=g) for _ in range(n)]


def outputs(model, xs):
    with torch.no_grad():
        return [model(x) for x in xs]


def same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def leaves_equal(got, want) -> bool:
    """Equal tensors; a quantized wrapper (torchao) by its inner tensors."""
    if hasattr(want, "__tensor_flatten__") and type(want) is not torch.Tensor:
        names, _ = want.__tensor_flatten__()
        return all(torch.equal(getattr(got, n), getattr(want, n)) for n in names)
    return torch.equal(got, want)
