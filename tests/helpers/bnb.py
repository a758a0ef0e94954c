"""A stack of bitsandbytes layers (int8 or nf4, CPU backend) built as the
library's recipe builds one, and bitwise checks of its state
(tests/formats/test_bitsandbytes.py and the split-fetch ranks of split_worker.py).
Importing it skips a test module where bitsandbytes is not installed."""
import pytest
import torch
from torch import nn

from layerwise.configure import managers_of

bnb = pytest.importorskip("bitsandbytes")


D = 256


class Block(nn.Module):
    def __init__(self, linear, mix=False):
        super().__init__()
        self.up = linear(D, 2 * D)
        self.down = linear(2 * D, D)
        # (mix: a plain bf16 layer beside the quantized ones, so that compress has bytes to encode)
        self.mix = nn.Linear(D, D, dtype=torch.bfloat16) if mix else None

    def forward(self, x):
        x = x + self.down(torch.relu(self.up(x)))
        return x if self.mix is None else x + self.mix(x)


class Stack(nn.Module):
    def __init__(self, linear, n, mix=False):
        super().__init__()
        self.blocks = nn.ModuleList([Block(linear, mix) for _ in range(n)])
        self.head = nn.Linear(D, D, dtype=torch.bfloat16)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def make(kind, seed=0, n=6, train=False, compute=torch.bfloat16, mix=False):
    """The bitsandbytes recipe: its modules built in fp32, a bf16 state dict loaded,
    quantized by .to(device). Biases stay fp32 until a forward casts them (to the
    input's dtype: int8, and nf4 with a bf16 `compute` dtype)."""
    torch.manual_seed(seed)
    ref = Stack(nn.Linear, n, mix).to(torch.bfloat16)
    if kind == "int8":
        def linear(i, o):
            return bnb.nn.Linear8bitLt(i, o, has_fp16_weights=False)
    else:
        def linear(i, o):
            return bnb.nn.Linear4bit(i, o, quant_type="nf4", compute_dtype=compute)
    model = Stack(linear, n, mix)
    model.load_state_dict(ref.state_dict())
    return model.to("cpu").train(train)


def inputs(n=3, seed=7):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, D, generator=g).to(torch.bfloat16) for _ in range(n)]


def run(model, xs=None):
    with torch.no_grad():
        return [model(x) for x in (xs or inputs())]


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def assert_state_equal(sd, ref):
    assert sd.keys() == ref.keys(), sd.keys() ^ ref.keys()
    for k, v in ref.items():
        assert sd[k].dtype == v.dtype and sd[k].shape == v.shape, (k, sd[k].dtype, sd[k].shape, v.dtype, v.shape)
        assert torch.equal(sd[k].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)), k


def assert_computes_from_slots(model):
    """Every planned parameter of every streamed layer is bound where drift.Bound says:
    its view of its slot (and bitsandbytes' own alias, state.CB, is the parameter)."""
    for m in managers_of(model):
        for i in m.ring.streamed:
            params, ptrs, _ = m.bound.layers[i]
            for p, ptr in zip(params, ptrs):
                assert p.untyped_storage().data_ptr() in m.ring.ptrs and p.data_ptr() == ptr
            for mod in m.plan.layers[i].module.modules():
                cb = getattr(getattr(mod, "state", None), "CB", None)
                if cb is not None:
                    assert cb is mod.weight
