"""The process-wide module-registration hook (docs/design.md, "Global side effects"):
installed with the first streaming model, kept while any model streams, removed with
the last one, whether that one is removed or dropped without its removal."""
import gc

import torch
from torch import nn
from torch.nn.modules import module as torch_module

import layerwise


def _hooks() -> int:
    return len(torch_module._global_module_registration_hooks)


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 8), nn.ModuleList([nn.Linear(8, 8) for _ in range(3)]))


def _configure(model):
    return layerwise.configure_layerwise_offload(model, "1", device="cpu", prefetch_depth=1)


def test_the_hook_lives_exactly_while_a_model_streams():
    before = _hooks()
    a, b = _model(0), _model(1)
    _configure(a)
    assert _hooks() == before + 1
    _configure(b)
    assert _hooks() == before + 1, "one process-wide hook, whatever the number of models"
    layerwise.remove_layerwise_offload(a)
    assert _hooks() == before + 1, "b still streams: its guard must stay"
    layerwise.remove_layerwise_offload(b)
    assert _hooks() == before, "the last removal must take the process-wide hook away"
    _configure(a)
    assert _hooks() == before + 1, "the next configure installs it again"
    layerwise.remove_layerwise_offload(a)
    assert _hooks() == before


def test_a_streaming_model_dropped_without_removal_takes_the_hook_with_it():
    before = _hooks()
    m = _model(2)
    _configure(m)
    assert _hooks() == before + 1
    del m
    for _ in range(3):
        gc.collect()
    assert _hooks() == before


def test_a_hook_installed_again_watches_modules_added_into_a_streamed_layer():
    from layerwise.contract import edits

    first, second = _model(3), _model(4)
    _configure(first)
    layerwise.remove_layerwise_offload(first)  # the hook goes with the last streaming model
    _configure(second)
    try:
        added = nn.Linear(8, 8)
        second[1][0].extra = added  # (peft's inject_adapter registers modules like this)
        assert added in edits.WATCHED, "a module added into a streamed layer must be watched (its merges guarded)"
    finally:
        layerwise.remove_layerwise_offload(second)
    late = nn.Linear(8, 8)
    second[1][1].extra = late
    assert late not in edits.WATCHED, "after removal nothing is watched"
