"""set_residency on one thread while calls of the model on others share fetches
(runtime/cohort.py): a call waiting for its layer finds a new ring (other slots,
its layer perhaps resident now) and carries on with it, exactly."""
import copy
import threading

import torch

import layerwise

from helpers.disk import make


def test_set_residency_while_calls_wait_for_their_layers_is_exact():
    torch.manual_seed(0)
    ref = make(dtype=torch.float32, depth=8)
    model = copy.deepcopy(ref)
    layerwise.configure_layerwise_offload(model, "blocks", device="cpu", prefetch_depth=2, debug_copy_delay_us=3000)
    group = layerwise.managers_of(model)[0]
    xs = [torch.randn(1 + k, 256) for k in range(4)]
    with torch.no_grad():
        expect = [ref(x) for x in xs]
    stop, errors, flips = threading.Event(), [], [0]

    def flip():
        k = 0
        while not stop.is_set():
            try:  # (fewer slots, then more: a waiting call's slot index changes meaning)
                group.set_residency([] if k % 2 else [0, 3, 5], prefetch_depth=1 + k % 2)
                flips[0] += 1
            except Exception as err:  # noqa: BLE001
                errors.append(err)
            k += 1
            stop.wait(0.005)

    def call(x):
        def run(m):
            with torch.no_grad():
                return [m(x) for _ in range(12)]
        return run

    t = threading.Thread(target=flip)
    t.start()
    try:
        outs = layerwise.run_together(model, [call(x) for x in xs])
    finally:
        stop.set()
        t.join(60)
    assert not errors and flips[0] > 0
    assert all(torch.equal(o, e) for outs_k, e in zip(outs, expect) for o in outs_k)
    assert group.stats()["calls"]["calls_max"] == 4
