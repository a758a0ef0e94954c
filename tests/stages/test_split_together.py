"""run_together on split-fetch models (layerwise/runtime/turns.py): gloo ranks on
CPU, each running the same calls, every output bitwise equal to the call alone."""
import pytest

from helpers.ranks import run_ranks

W = "split_together_worker.py"


@pytest.mark.parametrize("scenario", ["together", "collective", "pipeline", "tiers", "raises", "sigint", "out_of_lockstep"])
def test_run_together_on_split_fetch_ranks(scenario, tmp_path):
    run_ranks(2, tmp_path, scenario, worker=W)
