"""The state contract's checks (tests/contract/test_contract.py, test_removal.py):
the two-group test model, a fingerprint of everything a rollback must give back
(values, dtype, device, strides, requires_grad per tensor), and whether a model
still carries anything of layerwise (hooks, instance overrides, managers)."""
import torch
from torch import nn

from layerwise.configure import managers_of

from helpers.models import TwoGroupModel


def make(seed=0, **kw):
    torch.manual_seed(seed)
    return TwoGroupModel(**kw)


def inputs(n=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 32, generator=g) for _ in range(n)]


def run(model, xs):
    with torch.no_grad():
        return [model(x) for x in xs]


def fingerprint(model):
    """Everything a rollback must give back: values, dtype, device, strides, per tensor."""
    out = {}
    for n, p in model.named_parameters():
        out[n] = (p.detach().clone(), p.dtype, p.device, p.stride(), p.requires_grad)
    for n, b in model.named_buffers():
        out["buffer:" + n] = (b.clone(), b.dtype, b.device, b.stride(), False)
    return out


def assert_fingerprint(model, fp):
    now = fingerprint(model)
    assert set(now) == set(fp)
    for k, (v, dt, dev, st, rg) in fp.items():
        w, dt2, dev2, st2, rg2 = now[k]
        assert (dt2, dev2, st2, rg2) == (dt, dev, st, rg), k
        assert torch.equal(w, v), f"{k} changed"


def no_trace_of_layerwise(model):
    hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) + len(m._state_dict_hooks)
                + len(m._load_state_dict_pre_hooks) for m in model.modules())
    extra = [k for m in model.modules() for k in m.__dict__
             if k.startswith("_layerwise") or k in ("_apply", "__deepcopy__", "__reduce_ex__")]
    return hooks == 0 and not extra and not managers_of(model)


class Caller(nn.Module):
    """A block that calls another block of its own list (held outside the module tree)."""

    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.callee = None

    def forward(self, x):
        x = torch.tanh(self.lin(x))
        if self.callee is not None:
            x = self.callee[0](x)
        return x


def nested_model(pairs, n=6, d=16):
    torch.manual_seed(0)
    model = nn.Module()
    model.blocks = nn.ModuleList([Caller(d) for _ in range(n)])
    for a, b in pairs:
        model.blocks[a].callee = [model.blocks[b]]

    def forward(x):
        for blk in model.blocks:
            x = blk(x)
        return x

    model.forward = forward
    return model
