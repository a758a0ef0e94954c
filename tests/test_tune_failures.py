"""layerwise.tune when something fails, beyond test_tune.py: a
run() that fails once the new placement is applied (a model whose blocks call
each other, or any other failure), and budgets that are not numbers of bytes."""
import pytest
import torch
from torch import nn

import layerwise

from helpers.models import TwoGroupModel
from helpers.tune import only_layer_hooks

GROUPS = ["transformer_blocks", "single_transformer_blocks"]


def make(seed=0):
    torch.manual_seed(seed)
    return TwoGroupModel(d=32, n_a=6, n_b=4).eval()


def non_layer_bytes(model):
    from layerwise.planning.device_budget import non_layer_bytes as fixed

    return fixed(model, layerwise.configure.managers_of(model))


def test_a_run_that_fails_after_the_placement_was_applied_leaves_the_old_one():
    """tune raised from the run after _apply and left the new placement in force
    (its note claiming a prediction): a tune that raises changes nothing."""
    ref = make()
    x = torch.randn(3, 32)
    with torch.no_grad():
        want = ref(x)
    model = make()
    ms = layerwise.configure_layerwise_offload(model, GROUPS, device="cpu")
    ms[0].set_residency([0, 1, 2], 1)
    old = [(list(m.resident), m.prefetch_depth, m.placement) for m in ms]
    budget = non_layer_bytes(model) + sum(m.device_bytes([], 1) for m in ms)  # the old one does not fit
    calls = [0]

    def run(mm):
        calls[0] += 1
        if calls[0] == 4:  # warm, timed, probed (repeats=1), then the first run under the new placement
            raise ValueError("the step failed")
        mm(x)

    with pytest.raises(ValueError, match="the step failed"):
        layerwise.tune(model, run, device_budget=budget, repeats=1)
    assert [(list(m.resident), m.prefetch_depth, m.placement) for m in ms] == old
    assert all(only_layer_hooks(m) and m.meter.copy_log is None for m in ms)
    with torch.no_grad():
        assert torch.equal(model(x), want)


class Caller(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.callee = None  # another block of the same list, called from this one's forward

    def forward(self, x):
        x = torch.tanh(self.lin(x))
        if self.callee is not None:
            x = x + self.callee[0](x)
        return x


class Nested(nn.Module):
    def __init__(self, d=16, n=8):
        super().__init__()
        self.blocks = nn.ModuleList([Caller(d) for _ in range(n)])
        self.blocks[2].callee = [self.blocks[6]]

    def forward(self, x):
        for i, b in enumerate(self.blocks):
            if i != 6:
                x = b(x)
        return x


def test_tune_never_leaves_a_placement_under_which_the_model_fails():
    """Block 2 calls block 6: a placement where they share a ring slot is refused at
    the forward. tune's pipeline model does not see it, applied such a placement,
    raised from its measuring run and left the model broken."""
    torch.manual_seed(0)
    ref = Nested().eval()
    torch.manual_seed(0)
    model = Nested().eval()
    x = torch.randn(2, 16)
    with torch.no_grad():
        want = ref(x)
    (m,) = layerwise.configure_layerwise_offload(model, "blocks", device="cpu")
    m.set_residency([6], 1)
    with torch.no_grad():
        assert torch.equal(model(x), want)
    try:
        layerwise.tune(model, lambda mm: mm(x), device_budget=m.device_bytes([6], 1) + non_layer_bytes(model),
                       repeats=1)
    except RuntimeError as err:
        assert "still computing" in str(err)
    with torch.no_grad():
        assert torch.equal(model(x), want)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_budget_that_is_not_a_finite_number_of_bytes_is_refused_clearly(bad):
    model = make()
    (a, b) = layerwise.configure_layerwise_offload(model, GROUPS, device="cpu")
    with pytest.raises(ValueError, match="device_budget must be"):
        layerwise.tune(model, lambda mm: mm(torch.randn(3, 32)), device_budget=bad, repeats=1)
    assert (a.resident, b.resident) == ([], [])


@pytest.mark.parametrize("bad", [(1.7,), (True,), ("2",)])
def test_depths_that_are_not_ints_are_refused(bad):
    model = make()
    layerwise.configure_layerwise_offload(model, GROUPS, device="cpu")
    with pytest.raises((TypeError, ValueError), match="depth"):
        layerwise.tune(model, lambda mm: mm(torch.randn(3, 32)), depths=bad, repeats=1)
