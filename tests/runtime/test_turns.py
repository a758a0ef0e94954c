"""runtime/turns.py without ranks: one split session at a time, the figures of a
model without split fetch, and the lockstep text of a turn's tag. The turns
themselves run on gloo ranks: tests/stages/test_split_together.py."""
import pytest
import torch

import layerwise
from layerwise.runtime import turns
from layerwise.stages.split import collectives


def test_one_split_session_at_a_time():
    s = turns.open_session(2)
    try:
        with pytest.raises(RuntimeError, match="another run_together on a split_fetch model"):
            turns.open_session(3)
    finally:
        turns.close_session(s)
    turns.close_session(turns.open_session(1))  # closed: a new one opens


def test_a_model_without_split_fetch_has_no_turns():
    net = torch.nn.Module()
    net.blocks = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(3)])
    net.forward = lambda x: net.blocks[2](net.blocks[1](net.blocks[0](x)))
    m = layerwise.configure_layerwise_offload(net, "blocks", device="cpu")[0]
    try:
        calls = m.stats()["calls"]
        assert calls["turns"] is None and calls["admitted_late"] is None
        assert turns.TURNS not in net.__dict__
        x = torch.randn(2, 8)
        outs = layerwise.run_together(net, [lambda mod: mod(x), lambda mod: mod(x)])
        assert torch.equal(outs[0], outs[1])
        assert not turns.SESSION  # no session for a model without split fetch
    finally:
        layerwise.remove_layerwise_offload(net)


def test_a_turns_tag_names_the_turn_and_the_batch():
    g = collectives.SplitGroup.__new__(collectives.SplitGroup)
    g.layer_names = ["blocks"]
    row = [collectives._MAGIC, collectives.TURN, -1, 5, 3, 0, 0, 0]
    assert g._what(row) == "the start of run_together's turn 5 of 3 calls"
