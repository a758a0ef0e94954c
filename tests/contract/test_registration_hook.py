"""The process-wide module-registration hook (docs/design.md, "Global side effects"):
installed with the first streaming model, kept while any model streams, removed with
the last one, whether that one is removed or dropped without its removal.

The lifetime checks run in a fresh interpreter: in the test process another test's
model may still stream (held by a fixture or a traceback), which keeps the hook, rightly."""
import subprocess
import sys
import textwrap

import torch
from torch import nn

import layerwise

PRELUDE = textwrap.dedent("""
    import gc
    import torch
    from torch import nn
    from torch.nn.modules import module as torch_module
    import layerwise

    def hooks():
        return len(torch_module._global_module_registration_hooks)

    def model(seed):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(8, 8), nn.ModuleList([nn.Linear(8, 8) for _ in range(3)]))

    def configure(m):
        return layerwise.configure_layerwise_offload(m, "1", device="cpu", prefetch_depth=1)
""")


def _run(body: str) -> None:
    code = PRELUDE + textwrap.dedent(body) + "\nprint('ok')\n"
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr


def test_the_hook_lives_exactly_while_a_model_streams():
    _run("""
        before = hooks()
        a, b = model(0), model(1)
        configure(a)
        assert hooks() == before + 1, hooks()
        configure(b)
        assert hooks() == before + 1, "one process-wide hook, whatever the number of models"
        layerwise.remove_layerwise_offload(a)
        assert hooks() == before + 1, "b still streams: its guard must stay"
        layerwise.remove_layerwise_offload(b)
        assert hooks() == before, "the last removal must take the process-wide hook away"
        configure(a)
        assert hooks() == before + 1, "the next configure installs it again"
        layerwise.remove_layerwise_offload(a)
        assert hooks() == before
    """)


def test_a_streaming_model_dropped_without_removal_takes_the_hook_with_it():
    _run("""
        before = hooks()
        m = model(2)
        configure(m)
        assert hooks() == before + 1
        del m
        for _ in range(3):
            gc.collect()
        assert hooks() == before, "the dropped model was the last to stream: its hook must go"
    """)


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 8), nn.ModuleList([nn.Linear(8, 8) for _ in range(3)]))


def test_a_hook_installed_again_watches_modules_added_into_a_streamed_layer():
    from layerwise.contract import edits

    first, second = _model(3), _model(4)
    layerwise.configure_layerwise_offload(first, "1", device="cpu", prefetch_depth=1)
    layerwise.remove_layerwise_offload(first)  # the hook goes with the last streaming model
    layerwise.configure_layerwise_offload(second, "1", device="cpu", prefetch_depth=1)
    try:
        added = nn.Linear(8, 8)
        second[1][0].extra = added  # (peft's inject_adapter registers modules like this)
        assert added in edits.WATCHED, "a module added into a streamed layer must be watched (its merges guarded)"
    finally:
        layerwise.remove_layerwise_offload(second)
    late = nn.Linear(8, 8)
    second[1][1].extra = late
    assert late not in edits.WATCHED, "after removal nothing is watched"
