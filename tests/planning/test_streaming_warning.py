"""The WARNING "streaming saves no device memory": logged once per layer group per
configure (or offload_pipeline) call, exactly where it is true (the group's slot ring
holds at least as many bytes as its streamed layers would hold resident), with advice
that exists: followed, the warning goes away and the ring holds less."""
import logging
import re

import pytest
from torch import nn

import layerwise

SAYS = "streaming saves no device memory"


class Sized(nn.Module):
    """One block list whose layers are square Linear layers of the widths given."""

    def __init__(self, widths):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(d, d, bias=False) for d in widths)


def warnings_about(caplog, text=SAYS):
    return [r.getMessage() for r in caplog.records
            if r.name == "layerwise" and r.levelno == logging.WARNING and text in r.getMessage()]


def saves_nothing(m) -> bool:
    """The truth, from what the manager holds: ring bytes >= the streamed layers' bytes."""
    streamed = [lp.nbytes for lp in m.plan.layers if lp.index not in set(m.resident)]
    return m.stats()["ring_bytes"] >= sum(streamed)


@pytest.mark.parametrize("widths,depth,resident,expected", [
    ([16, 16], 1, 0, True),          # 2 slots x one layer == both layers
    ([16, 8], 1, 0, True),           # 2 slots of the larger layer: more than both layers
    ([16] * 3, 1, 0, True),          # a cycle of 3 at depth 1 needs 3 slots
    ([16] * 4, 1, 0, False),         # 2 slots for 4 layers: half
    ([32, 8, 8, 8], 1, 0, True),     # 2 slots of the large layer outweigh all four
    ([16] * 4, 3, 0, True),          # 4 slots for 4 layers
    ([16] * 8, 3, 0, False),
    ([16] * 4, 1, 2, True),          # 2 resident, 2 streamed in 2 slots
    ([16, 16], 0, 0, False),         # depth 0: one slot
])
def test_warned_once_exactly_where_true(caplog, widths, depth, resident, expected):
    model = Sized(widths)
    with caplog.at_level(logging.WARNING, logger="layerwise"):
        (m,) = layerwise.configure_layerwise_offload(model, "blocks", device="cpu", prefetch_depth=depth,
                                                     resident_layers=resident)
    assert saves_nothing(m) == expected
    warned = warnings_about(caplog)
    assert len(warned) == (1 if expected else 0), warned
    if expected:
        (msg,) = warned
        assert "'blocks'" in msg and "or less" not in msg
        assert f"{len(widths) - resident} streamed layer(s)" in msg, msg
        assert "leave it out of layer_names" in msg, msg
    assert (SAYS in str(layerwise.report(model))) == expected


@pytest.mark.parametrize("widths,depth", [([16, 16], 1), ([16] * 3, 1), ([16] * 4, 3), ([32, 16], 1), ([16], 1)])
def test_the_advice_works(caplog, widths, depth):
    """The prefetch_depth the warning names (where one would help) is valid, and with it
    the ring holds less than the streamed layers; the group left out of layer_names goes
    to the device whole."""
    with caplog.at_level(logging.WARNING, logger="layerwise"):
        layerwise.configure_layerwise_offload(Sized(widths), "blocks", device="cpu", prefetch_depth=depth)
    (msg,) = warnings_about(caplog)
    advised = re.search(r"; or prefetch_depth=(\d+) for every group of the call", msg)
    if len(widths) == 1:  # one layer, one slot at any depth: no depth helps
        assert advised is None, msg
        return
    assert advised, msg
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="layerwise"):
        (m,) = layerwise.configure_layerwise_offload(Sized(widths), "blocks", device="cpu",
                                                     prefetch_depth=int(advised.group(1)))
    assert not warnings_about(caplog) and not saves_nothing(m)


def test_configured_twice_warned_twice_once_each(caplog):
    """Once per call: a second model configured the same way is told again, once."""
    with caplog.at_level(logging.WARNING, logger="layerwise"):
        for _ in range(2):
            layerwise.configure_layerwise_offload(Sized([16, 16]), "blocks", device="cpu")
    assert len(warnings_about(caplog)) == 2


# ------------------------------------------------------------------ pipelines
def expected_groups(managers) -> set:
    return {(c, m.layer_name) for c, ms in managers.items() for m in ms if saves_nothing(m)}


@pytest.mark.parametrize("uses", [None, "dict", "warmup"])
def test_offload_pipeline_warns_each_group_at_most_once(caplog, uses):
    """Every component's groups, each told at most once per offload_pipeline call, also
    with uses=<warm-up callable> (which offloads the pipeline twice), naming the component."""
    pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    from layerwise.bench.pipeline import SIZES, generate, tiny_flux_pipeline

    pipe = tiny_flux_pipeline(SIZES["tiny"])
    arg = {None: None, "dict": {"transformer": 4, "vae": 1},
           "warmup": lambda p: generate(p, SIZES["tiny"])}[uses]
    with caplog.at_level(logging.WARNING, logger="layerwise"):
        managers = layerwise.offload_pipeline(pipe, device="cpu", pin_budget=None, uses=arg)
    warned = warnings_about(caplog)
    want = expected_groups(managers)
    assert want and ("transformer", "single_transformer_blocks") not in want  # 4 layers in 2 slots: it saves
    told = []
    for msg in warned:
        (hit,) = [(c, g) for c, g in want if f"component {c!r}, layer group {g!r}" in msg]
        told.append(hit)
    assert sorted(told) == sorted(want), warned  # each true group once, nothing else
    assert all("or less" not in w for w in warned)
