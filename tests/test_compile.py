"""torch.compile over a streamed model (CPU inductor): outputs equal the compiled
resident model's, and the hooks cause no recompile per layer or per step."""
import copy

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import layerwise
from models import TwoGroupModel

GROUPS = ["transformer_blocks", "single_transformer_blocks"]


def blocks(model):
    return list(model.transformer_blocks) + list(model.single_transformer_blocks)


@pytest.mark.parametrize("scope", ["model", "blocks"])
def test_compiled_streaming_matches_compiled_resident_without_recompiles(scope):
    torch.manual_seed(0)
    resident = TwoGroupModel(d=32, n_a=4, n_b=2)
    model = copy.deepcopy(resident)
    xs = [torch.randn(3, 32) for _ in range(3)]

    def compile_(m):
        if scope == "model":
            return torch.compile(m)
        for b in blocks(m):
            b.compile()
        return m

    torch._dynamo.reset()
    with torch.no_grad():
        c = compile_(resident)
        refs = [c(x) for x in xs]
    # dynamo does not guard on module hooks: start from an empty cache so that the
    # streamed model cannot reuse graphs compiled for the resident one.
    torch._dynamo.reset()
    counters.clear()
    managers = layerwise.configure_layerwise_offload(model, GROUPS, device="cpu", prefetch_depth=1)
    cm = compile_(model)
    with torch.no_grad():
        assert torch.equal(cm(xs[0]), refs[0])  # first step compiles
        graphs = counters["stats"]["unique_graphs"]
        frames = counters["frames"]["total"]
        assert graphs > 0
        for _ in range(3):
            for x, ref in zip(xs, refs):
                assert torch.equal(cm(x), ref)
    assert counters["stats"]["unique_graphs"] == graphs  # nothing recompiled
    assert "recompiles" not in counters or not counters["recompiles"]
    assert managers[0].stats()["steps"] == 10 and managers[0].stats()["copies"] > 0  # hooks really ran
    assert counters["frames"]["total"] - frames < 10 * len(blocks(model))  # no compile attempt per layer call
