"""The capture path of a streamed step (layerwise/runtime/capture.py) on the CPU:
the group's hooks are driven as under CUDA graph capture, with a stand-in for
torch.cuda's streams and events that records every call and runs each copy at
once. A copy issued into a slot whose layer has not computed yet would change
that layer's output, so the outputs being bitwise equal to the resident model's
is the schedule's test; the record shows every fork joined. The captured graph
itself is checked on a GPU by scripts/gpu_check.sh."""
import copy

import pytest
import torch

import layerwise
from layerwise.runtime import capture

from helpers.models import TwoGroupModel

GROUPS = ["transformer_blocks", "single_transformer_blocks"]


class FakeApi:
    """Streams are names, events are numbers; `log` holds every call in order."""

    log: list = []
    copies: list = []

    def __init__(self, device):
        self.device = device

    def current_stream(self):
        return "compute"

    def new_stream(self):
        return f"copy{len([e for e in FakeApi.log if e[0] == 'stream'])}"

    def record(self, stream):
        ev = len(FakeApi.log)
        FakeApi.log.append(("record", stream, ev))
        return ev

    def wait(self, stream, event):
        FakeApi.log.append(("wait", stream, event))

    def copy(self, stream, dst, src):
        FakeApi.log.append(("copy", stream, dst.data_ptr()))
        FakeApi.copies.append((dst, src))
        dst.copy_(src)

    def pinned(self, t):
        return True


@pytest.fixture
def fake_capture(monkeypatch):
    FakeApi.log, FakeApi.copies = [], []
    monkeypatch.setattr(capture, "CudaApi", FakeApi)
    capturing = {"on": False}

    def start(managers):
        for m in managers:
            m.engine.synchronize()  # (torch.cuda.graph synchronizes the device before it captures)
            m._capturing = lambda: capturing["on"]  # (the instance attribute shadows the method)
        capturing["on"] = True

    def stop():
        capturing["on"] = False

    return start, stop


def _pair(seed=0, **kw):
    torch.manual_seed(seed)
    resident = TwoGroupModel(d=16, n_a=5, n_b=3)
    model = copy.deepcopy(resident)
    return resident, model, layerwise.configure_layerwise_offload(model, GROUPS, device="cpu", **kw)


def _joined(log) -> bool:
    """Every event recorded on a copy stream is waited on by the compute stream."""
    copy_events = {e[2] for e in log if e[0] == "record" and e[1] != "compute"}
    waited = {e[2] for e in log if e[0] == "wait" and e[1] == "compute"}
    return copy_events <= waited


@pytest.mark.parametrize("depth,resident", [(1, 0), (2, 0), (1, 2)])
def test_a_captured_step_copies_every_streamed_layer_in_order_and_joins_every_fork(fake_capture, depth, resident):
    start, stop = fake_capture
    ref_model, model, managers = _pair(prefetch_depth=depth, resident_layers=resident)
    x = torch.randn(3, 16)
    with torch.no_grad():
        ref = ref_model(x)
        model(x)  # an eager step first: its wrap-around prefetch leaves slots the capture must not trust
        start(managers)
        for m in managers:
            for s in m.ring.slots:
                s.data.fill_(255)  # what a capture finds in the slots is never what it computes on
        out = model(x)
        stop()
    assert torch.equal(out, ref)
    streamed = sum(len(m.ring.streamed) for m in managers)
    assert len([e for e in FakeApi.log if e[0] == "copy"]) == streamed  # each streamed layer once per step
    assert _joined(FakeApi.log)
    with torch.no_grad():  # eager again: the record is forgotten (replays refill slots behind it)
        for m in managers:
            for s in m.ring.slots:
                s.data.fill_(255)
        assert torch.equal(model(x), ref)


def test_a_captured_copy_into_a_slot_waits_for_the_layer_that_used_it(fake_capture):
    start, stop = fake_capture
    _, model, managers = _pair(prefetch_depth=1)
    m = managers[0]
    with torch.no_grad():
        start(managers)
        model(torch.randn(2, 16))
        stop()
    log = FakeApi.log
    first_use = {}
    for k, e in enumerate(log):
        if e[0] != "copy":
            continue
        slot = next(s for s, t in enumerate(m.ring.slots) if t.data_ptr() == e[2]) if any(
            t.data_ptr() == e[2] for t in m.ring.slots) else None
        if slot is None:
            continue
        # the copy stream waited right before the copy on an event recorded on the compute stream
        assert log[k - 1][0] == "wait" and log[k - 1][1] == e[1]
        after = log[k - 1][2]
        assert log[after][0] == "record" and log[after][1] == "compute"
        if slot in first_use:
            assert after > first_use[slot]  # recorded after the slot's previous layer computed
        first_use[slot] = k


def test_the_captured_copies_read_the_host_blocks_a_load_state_dict_writes(fake_capture):
    start, stop = fake_capture
    ref_model, model, managers = _pair(prefetch_depth=1)
    with torch.no_grad():
        start(managers)
        model(torch.randn(2, 16))
        stop()
    srcs = [src for _, src in FakeApi.copies]
    torch.manual_seed(5)
    new = TwoGroupModel(d=16, n_a=5, n_b=3)
    model.load_state_dict(new.state_dict())
    for m in managers:
        for i in m.ring.streamed:
            assert any(s.data_ptr() == m.read_layer(i).data_ptr() for s in srcs)  # the same host block
            assert any(torch.equal(s, m.read_layer(i)) for s in srcs)  # holding the new bytes
    x = torch.randn(2, 16)
    with torch.no_grad():
        start(managers)
        out = model(x)
        stop()
        assert torch.equal(out, new(x))


def test_a_captured_step_takes_the_order_its_layers_are_called_in_and_refuses_a_second_call(fake_capture):
    start, stop = fake_capture
    ref_model, model, managers = _pair(prefetch_depth=1)
    x = torch.randn(2, 16)
    order = [0, 2, 1, 4, 3]
    with torch.no_grad():
        start(managers)
        out = model(x, order_a=order)
        assert torch.equal(out, ref_model(x, order_a=order))
        assert _joined(FakeApi.log)
        with pytest.raises(RuntimeError, match="called twice in one captured step"):
            model(x, order_a=[0, 1, 2, 2, 3])
        stop()
        assert torch.equal(model(x), ref_model(x))  # eager afterwards: exact


@pytest.mark.parametrize("what,kw,match", [
    ("grad", {}, "grad enabled"),
    ("compress", {"compress": "lossless"}, "decode"),
])
def test_what_cannot_be_captured_is_refused_naming_it(fake_capture, what, kw, match):
    start, stop = fake_capture
    torch.manual_seed(0)
    model = TwoGroupModel(d=16, n_a=5, n_b=3)
    managers = layerwise.configure_layerwise_offload(model, GROUPS, device="cpu", **kw)
    x = torch.randn(2, 16)
    start(managers)
    with pytest.raises(RuntimeError, match=match):
        if what == "grad":
            model(x)
        else:
            with torch.no_grad():
                model(x)
    stop()
    with torch.no_grad():
        model(x)  # eager afterwards: streams as before


def test_a_disk_read_is_refused_at_capture_naming_it(fake_capture, tmp_path):
    from helpers import disk

    start, stop = fake_capture
    model = disk.make()
    managers = layerwise.configure_layerwise_offload(
        model, ["blocks"], device="cpu", host_budget=disk.budget(model, keep=2), spill_dir=str(tmp_path))
    assert any(m.sources[i].kind == "disk" for m in managers for i in m.ring.streamed)
    x = torch.randn(2, 256, dtype=torch.bfloat16)
    start(managers)
    with torch.no_grad(), pytest.raises(RuntimeError, match="a disk read"):
        model(x)
    stop()


def test_what_a_captured_graph_touches_outlives_a_set_residency_and_a_removal(fake_capture):
    start, stop = fake_capture
    ref_model, model, managers = _pair(prefetch_depth=1)
    x = torch.randn(2, 16)
    with torch.no_grad():
        start(managers)
        model(x)
        stop()
    slots = [t.untyped_storage().data_ptr() for m in managers for t in m.ring.slots]
    blocks = [m.sources[i].host.data_ptr() for m in managers for i in m.ring.streamed]
    managers[0].set_residency(2)
    layerwise.remove_layerwise_offload(model)
    kept = model.__dict__[capture.KEPT]
    assert {t.untyped_storage().data_ptr() for k in kept for t in k[0]} == set(slots)
    assert {b.data_ptr() for k in kept for b in k[1].values()} == set(blocks)
    with torch.no_grad():
        assert torch.equal(model(x), ref_model(x))


@pytest.mark.parametrize("kind", ["ao-int8", "quanto-qint4"])
def test_a_quantized_model_is_captured_as_plain_bytes(fake_capture, kind):
    from helpers import quantized

    start, stop = fake_capture
    ref_model = quantized.make(kind, n=6)
    model = quantized.make(kind, n=6)
    managers = layerwise.configure_layerwise_offload(model, ["blocks"], device="cpu", prefetch_depth=1)
    x = torch.randn(2, quantized.D, dtype=torch.bfloat16)
    with torch.no_grad():
        ref = ref_model(x)
        start(managers)
        for m in managers:
            for s in m.ring.slots:
                s.data.fill_(255)
        out = model(x)
        stop()
    assert torch.equal(out, ref)
    assert len([e for e in FakeApi.log if e[0] == "copy"]) == len(managers[0].ring.streamed)
    assert _joined(FakeApi.log)


def test_routed_experts_are_refused_at_capture_naming_them(fake_capture):
    from helpers import moe

    start, stop = fake_capture
    model = moe._make("mixtral")
    managers = layerwise.configure_layerwise_offload(model, ["model.layers"], device="cpu", experts="routed")
    start(managers)
    with torch.no_grad(), pytest.raises(RuntimeError, match="routed experts"):
        model(moe._ids())
    stop()
    with torch.no_grad():
        model(moe._ids())  # eager afterwards


def test_a_capture_interrupted_mid_step_leaves_nothing_to_the_next_one(fake_capture):
    start, stop = fake_capture
    ref_model, model, managers = _pair(prefetch_depth=2)
    x = torch.randn(2, 16)
    block = model.single_transformer_blocks[1]
    h = block.register_forward_pre_hook(lambda m, a: (_ for _ in ()).throw(KeyboardInterrupt()))
    with torch.no_grad():
        start(managers)
        with pytest.raises(KeyboardInterrupt):
            model(x)
        h.remove()
        begin = len(FakeApi.log)
        out = model(x, order_b=[1, 0, 2])  # (the group's first call is not its layer 0)
        stop()
        assert torch.equal(out, ref_model(x, order_b=[1, 0, 2]))
    second = FakeApi.log[begin:]
    # every event the second capture waits on was recorded in it
    assert all(e[2] >= begin for e in second if e[0] == "wait")
    assert _joined(second)


def test_capture_is_refused_while_another_call_of_the_model_runs():
    """A captured step's copies are its own: with a second forward under way on
    another thread the capture is refused, naming the cause; alone it is not."""
    import threading

    model = TwoGroupModel()
    layerwise.configure_layerwise_offload(model, GROUPS, device="cpu")
    group = layerwise.managers_of(model)[0]
    inside, release, seen = threading.Event(), threading.Event(), {}

    def hold(mod, args):
        inside.set()
        release.wait(30)

    def other():
        with torch.no_grad():
            model(torch.randn(2, 32))

    handle = model.head.register_forward_pre_hook(hold)
    t = threading.Thread(target=other)
    t.start()
    assert inside.wait(30)
    handle.remove()

    def probe(mod, args):
        seen["why"] = capture.refusal(group, FakeApi("cpu"))

    model.transformer_blocks[0].register_forward_pre_hook(probe, prepend=True)
    with torch.no_grad():
        model(torch.randn(2, 32))
    release.set()
    t.join(30)
    assert seen["why"] is not None and "another call of the model is under way" in seen["why"]
    with torch.no_grad():
        model(torch.randn(2, 32))
        assert capture.refusal(group, FakeApi("cpu")) is None
