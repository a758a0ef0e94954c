"""Split fetch over torch.distributed (layerwise/stages/split/): 2 and 3 gloo
ranks on CPU, each holding and copying ~1/N of every streamed layer. The checks
run inside the ranks (tests/helpers/split_worker.py); a rank that hangs fails the
test at the timeout instead of blocking CI."""
import importlib.util

import pytest
import torch.distributed as dist

from layerwise.stages.split import share_span

from helpers.ranks import run_ranks


def test_share_span_covers_the_block_once_aligned():
    for nbytes in (1, 511, 512, 4096 + 3, 10_000, 1 << 20):
        for world in (1, 2, 3, 4, 8):
            spans = [share_span(nbytes, r, world) for r in range(world)]
            share = spans[0][0]
            assert share % 512 == 0 and share * world >= nbytes
            assert spans[0][1] == 0 and spans[-1][2] == nbytes
            for (_, lo, hi), (_, lo2, _) in zip(spans, spans[1:]):
                assert lo <= hi == lo2  # contiguous, no overlap
            assert all(lo % 512 == 0 or lo == hi == nbytes for _, lo, hi in spans)


needs_gloo = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch built without gloo")


@needs_gloo
@pytest.mark.parametrize("world", [2, 3])
def test_split_fetch_on_gloo_ranks(world, tmp_path):
    run_ranks(world, tmp_path)


@needs_gloo
@pytest.mark.parametrize("world", [2, 3])
def test_split_rank_out_of_lockstep_raises_on_every_rank(world, tmp_path):
    """Blocks called in another order (equal and unequal sizes), state_dict
    against a forward: SplitError on every rank naming both sides, no abort, exact after."""
    run_ranks(world, tmp_path, "lockstep")


@needs_gloo
@pytest.mark.parametrize("world", [2, 3])
def test_split_composes_with_compression_and_the_disk_tier(world, tmp_path):
    """Split + compress, disk (spill or checkpoint) + split, and all three:
    bitwise on every rank, depth 1 and 2, a resident layer, copy delays; each rank reads
    and copies only its share (encoded: <= 0.80x); state_dict, load_state_dict, remove."""
    run_ranks(world, tmp_path, "tiers")


@needs_gloo
def test_split_disk_compress_survive_real_sigints_in_configure_forward_and_remove(tmp_path):
    """Real SIGINTs (delivered on every rank at the same, randomly drawn
    stage call) during configure, forward and remove with disk + compress + split:
    each is interrupted cleanly and the next calls in lockstep are exact."""
    run_ranks(2, tmp_path, "sigint")


needs_real_models = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("diffusers", "transformers")),
    reason="the real-architecture tests need the diffusers and transformers test extras")


@needs_gloo
@needs_real_models
def test_split_composes_with_the_tiers_on_flux_and_llama(tmp_path):
    """Real architectures (tiny Flux, its two block lists streamed, and
    Llama; bf16, weight-like): split + compress, split + spill, split + spill + compress,
    and load_offloaded (each rank reads its share of the checkpoint) + spill + compress:
    bitwise on every rank with its own inputs, depth 1 and 2, resident layers, copy
    delays; each rank copies at most its share (encoded: <= 0.80x); state_dict,
    load_state_dict, remove (spill files deleted)."""
    run_ranks(2, tmp_path, "real_tiers")


@needs_gloo
@needs_real_models
def test_split_disk_compress_survive_real_sigints_on_flux_and_llama(tmp_path):
    """The SIGINTs of the test above (configure, forward, remove with disk +
    compress + split), on the two-group Flux and on Llama."""
    run_ranks(2, tmp_path, "real_sigint")


@needs_gloo
def test_split_fetch_streams_quantized_layers_with_the_tiers(tmp_path):
    """Torchao Int8 / Float8 weight-only and quanto qint4 layers with split
    fetch, split + spill, split + spill + compress on 2 ranks: bitwise, each rank copies
    about half of the quantized bytes; the state contract (tests/helpers/split_worker.py)."""
    pytest.importorskip("torchao")
    pytest.importorskip("optimum.quanto")
    run_ranks(2, tmp_path, "quantized")


@needs_gloo
def test_split_fetch_adopts_what_bitsandbytes_rebinds(tmp_path):
    """bitsandbytes nf4 / int8 configured before their first forward (a repack, a bias
    cast to bf16 in its place) with split fetch, alone and with compress, on 2 ranks:
    each rebind is written to every rank's share; bitwise (tests/helpers/split_worker.py)."""
    pytest.importorskip("bitsandbytes")
    run_ranks(2, tmp_path, "bitsandbytes")


@needs_gloo
def test_split_ranks_with_different_weights_are_refused(tmp_path):
    """Configure / offload_pipeline compare the streamed layers' bytes."""
    run_ranks(2, tmp_path, "seeds")


@needs_gloo
def test_split_refused_load_state_dict_keeps_the_true_weights(tmp_path):
    """State_dict, forward and remove show the old weights after a refusal."""
    run_ranks(2, tmp_path, "refused_load")


@needs_gloo
def test_split_gather_failure_is_a_split_error(tmp_path):
    """SplitError, not ReadError."""
    run_ranks(2, tmp_path, "gather_error")


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="torch built without gloo")
def test_split_bench_suite_tiny():
    import torch

    from layerwise.bench import split
    from layerwise.bench.common import Context

    res = split.run(Context(torch.device("cpu"), "tiny", show_progress=False))
    rows = {r.short: r for r in res.rows}
    host = rows["host MiB per rank, split (2 ranks)"]
    assert host.ratios["/all"] == pytest.approx(0.5, abs=0.02)  # each of 2 ranks holds half the layers
    link = rows["host-link MiB/step/rank, split (2 ranks)"]
    assert link.ratios["/all"] == pytest.approx(0.5, abs=0.02)
    assert rows["GPU split fetch: not measured"].ours is None
    assert rows["all-gather GiB/s (2 ranks, gloo, CPU)"].ours > 0
    assert res.data["runs"]["split"][0]["gathers"] > 0
    # run_together's 4 calls on split fetch: one call's bytes for the batch, the same turns on every rank
    together = rows["run_together x4 on split fetch (2 ranks)"]
    assert together.ratios["bytes per call /serial"] <= 0.3, together.ratios
    assert len({r["turns"] for r in res.data["together"]}) == 1, res.data["together"]
