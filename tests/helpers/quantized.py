"""A stack quantized by torchao or optimum-quanto, and bitwise checks of
quantized state (tests/formats/test_quantized.py, test_quantized_contract.py,
test_bitsandbytes.py, stages/test_moe.py, and the split-fetch ranks of
split_worker.py). `quantize` skips a test where the library is not installed."""
import pytest
import torch
from torch import nn

from layerwise.configure import managers_of

D = 256  # quanto's int4 groups are 128 wide: the in-features must be a multiple


class Block(nn.Module):
    def __init__(self, d=D):
        super().__init__()
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Stack(nn.Module):
    def __init__(self, n=4, d=D):
        super().__init__()
        self.blocks = nn.ModuleList([Block(d) for _ in range(n)])
        self.head = nn.Linear(d, d)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


KINDS = ["ao-int8", "ao-fp8", "ao-int4", "quanto-qint8", "quanto-qfloat8", "quanto-qint4"]


def quantize(model, kind, only=None):
    """Quantize `model` in place as `kind` (every nn.Linear, or only the module named `only`)."""
    if kind.startswith("ao-"):
        pytest.importorskip("torchao")
        from torchao.quantization import Float8WeightOnlyConfig, Int8WeightOnlyConfig, IntxWeightOnlyConfig, quantize_

        config = {"ao-int8": Int8WeightOnlyConfig(), "ao-fp8": Float8WeightOnlyConfig(),
                  "ao-int4": IntxWeightOnlyConfig(weight_dtype=torch.int4)}[kind]
        quantize_(model, config, filter_fn=None if only is None else (lambda mod, fqn: fqn == only))
    else:
        pytest.importorskip("optimum.quanto")
        from optimum import quanto

        qtype = {"quanto-qint8": quanto.qint8, "quanto-qfloat8": quanto.qfloat8, "quanto-qint4": quanto.qint4}[kind]
        quanto.quantize(model, weights=qtype, include=only)
        quanto.freeze(model)
    return model


def make(kind, seed=0, n=4):
    torch.manual_seed(seed)
    return quantize(Stack(n).to(torch.bfloat16).eval(), kind)


def leaves(t):
    """A tensor's plain inner tensors, recursively (the test's own flatten)."""
    if type(t) in (torch.Tensor, nn.Parameter) or not hasattr(type(t), "__tensor_flatten__"):
        return [t]
    return [x for name in t.__tensor_flatten__()[0] for x in leaves(getattr(t, name))]


def stored_bytes(module):
    return sum(x.numel() * x.element_size() for p in module.parameters() for x in leaves(p))


def bits(t):
    return [x.reshape(-1).contiguous().view(torch.uint8) for x in leaves(t)]


def assert_state_equal(sd, ref):
    assert sd.keys() == ref.keys(), sd.keys() ^ ref.keys()
    for k, v in ref.items():
        assert type(sd[k]) is type(v), (k, type(sd[k]), type(v))
        if hasattr(v, "__tensor_flatten__") and type(v) is not torch.Tensor:
            assert sd[k].__tensor_flatten__()[1] == v.__tensor_flatten__()[1], k
            assert sd[k].shape == v.shape and sd[k].dtype == v.dtype, k
        a, b = bits(sd[k]), bits(v)
        assert len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b)), k


def snapshot(sd):
    return {k: [x.clone() for x in leaves(v)] for k, v in sd.items()}


def inputs(n=3, seed=7):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, D, generator=g).to(torch.bfloat16) for _ in range(n)]


def run(model, xs):
    with torch.no_grad():
        return [model(x) for x in xs]


def assert_computes_from_slots(model):
    """Every streamed wrapper's leaves are views of its group's ring slots, and its
    outer shape and dtype are the resident model's."""
    for m in managers_of(model):
        for i in m.ring.streamed:
            for e in m.plan.layers[i].params:
                if e.wrapped is not None:
                    assert e.source().untyped_storage().data_ptr() in m.ring.ptrs, e.qualname
                    assert tuple(e.param.shape) == e.wrapped.form.size, e.qualname
