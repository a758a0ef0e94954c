"""run_together on split-fetch models under attack (layerwise/runtime/turns.py):
gloo ranks on CPU, each running the same calls in shapes the turns must survive
(tests/helpers/split_attack_worker.py), every output bitwise equal to the call
alone and the turn count the same on every rank."""
import pytest

from helpers.ranks import run_ranks

W = "split_attack_worker.py"


@pytest.mark.parametrize("scenario", ["compile_eager", "compile_module", "many", "raises_outside", "loop", "state",
                                      "pipeline_partial", "second_batch", "empty", "compile_raises", "share_calls_false", "long_wait", "nested_other"])
def test_run_together_on_split_fetch_ranks_under_attack(scenario, tmp_path):
    run_ranks(2, tmp_path, scenario, worker=W)
