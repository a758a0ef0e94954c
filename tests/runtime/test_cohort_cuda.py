"""Concurrent calls sharing fetches on a GPU (scripts/gpu_check.sh runs these in
its `capture` stage; without a GPU they skip: tests/runtime/test_cohort.py and
tests/runtime/test_cohort_tiers.py cover the CPU backend). On the CPU backend a
call's compute is done when its post-hook runs; on a GPU it is queued on the
call's stream, so the next fetch into a slot must wait for every call's
compute on it (the ring's per-slot `done` events), also where each call
computes on a stream of its own."""
import threading

import pytest
import torch

import layerwise

from helpers.devices import cuda_usable
from helpers.models import TwoGroupModel

pytestmark = pytest.mark.skipif(not cuda_usable(), reason="needs a GPU (calls on several CUDA streams)")

GROUPS = ["transformer_blocks", "single_transformer_blocks"]


@pytest.mark.parametrize("own_streams", [False, True], ids=["default-stream", "a-stream-per-call"])
def test_calls_on_their_own_streams_share_fetches_and_stay_bitwise(own_streams):
    torch.manual_seed(0)
    model = TwoGroupModel(d=512, n_a=6, n_b=4)
    ref = TwoGroupModel(d=512, n_a=6, n_b=4)
    ref.load_state_dict(model.state_dict())
    ref = ref.cuda()
    xs = [torch.randn(64 * (1 + k % 3), 512, device="cuda") for k in range(4)]
    with torch.no_grad():
        want = [ref(x) for x in xs]
    layerwise.configure_layerwise_offload(model, GROUPS, device="cuda", prefetch_depth=1)
    barrier = threading.Barrier(len(xs))
    model.transformer_blocks[0].register_forward_pre_hook(lambda m, a: (barrier.wait(30), None)[1], prepend=True)

    def call(x):
        def run(m):
            stream = torch.cuda.Stream() if own_streams else torch.cuda.current_stream()
            with torch.no_grad(), torch.cuda.stream(stream):
                outs = []
                for _ in range(5):
                    # a long kernel after each forward's first layers keeps the stream behind the host
                    torch.cuda._sleep(200_000)
                    outs.append(m(x))
                stream.synchronize()
            return outs
        return run

    got = layerwise.run_together(model, [call(x) for x in xs])
    for outs, w in zip(got, want):
        assert all(torch.equal(o, w) for o in outs)
    st = layerwise.managers_of(model)[0].stats(sync=True)["calls"]
    assert st["calls_max"] == len(xs) and st["joins"] > 0, st
    layerwise.remove_layerwise_offload(model)
