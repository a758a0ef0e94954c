"""The `shared` bench suite at its tiny size (python -m layerwise.bench shared):
its processes run, attach rather than pack, and the host memory it measures
shows one arena for N processes against N separate ones. No timing is
asserted (the machine's load decides those)."""
import os

import pytest
import torch

from layerwise.bench import shared
from layerwise.bench.common import Context

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="share_host needs Linux (memfd_create)")


def test_the_shared_suite_measures_one_arena_for_four_processes():
    result = shared.run(Context(torch.device("cpu"), "tiny", False))
    rows = {row.short: row for row in result.rows}
    memory = rows["host MiB, 4 processes shared"]
    # 4 separate arenas hold the streamed weights 4 times; shared, once plus what each process adds
    assert memory.ratios["/separate"] < 0.6, memory
    streamed = result.data["streamed_bytes"] / 2**20
    assert memory.baselines["4 separate arenas"] > 3.5 * streamed, memory
    assert memory.targets and memory.targets[0].label == "<= 1.15x 1 process"
    for n in (2, 4):
        assert "roles of processes 2..%d: attached" % n in rows[f"ready s, processes 2..{n}"].note
    runs = result.data["runs"]
    assert [p["role"] for p in runs["shared-4"]] == ["packer"] + ["attached"] * 3
    assert {p["role"] for p in runs["separate-4"]} == {"separate"}
