"""A placement change (set_residency, layerwise.tune) while the model is in use,
beyond the other residency tests: tune while another thread serves the model, a
graph that uses streamed parameters without saving them, parameters replaced by
load_state_dict(assign=True) while their layer was resident, and the natural
argument types of set_residency and tune (numpy and torch integers, generators).

Threads meet at points fixed by events (never by sleeps): each wait has a long
timeout only so that a broken interleaving fails instead of hanging."""
import gc
import threading
import weakref

import numpy as np
import pytest
import torch
from torch import nn

import layerwise
from layerwise.planning.device_budget import non_layer_bytes

from helpers.residency import GROUPS, inputs, make, outputs, same

WAIT_S = 120  # a guard against a hang, never a measure of speed


def sd_equal(model, ref) -> bool:
    sd = model.state_dict()
    return all(torch.equal(sd[k], v) for k, v in ref.state_dict().items())


def in_ring(m, p) -> bool:
    """`p` is a view of one of the group's ring slots (its layer streams)."""
    return p.untyped_storage().data_ptr() in {s.untyped_storage().data_ptr() for s in m.ring.slots}


# ------------------------------------------------------------- tune while serving
class Interleave:
    """Puts a call of the serving thread inside a layer call of the tuning thread,
    at each run: asked to (`request`), the server parks after its embed (inside
    its forward, holding nothing); the tuning thread's forward releases it from
    inside block 0 (holding the model's lock) and leaves block 0 only once the
    server has reached block 0's hooks (its call waits for the lock there)."""

    def __init__(self, model):
        self.request, self.parked, self.release, self.at_door = (threading.Event() for _ in range(4))
        self.going = False  # the server's forward that was released: it signals at block 0
        self.pending = False  # the tuning thread's forward that must wait for the server inside block 0
        self.tuner = threading.get_ident()
        block = model.transformer_blocks[0]
        # Registered before configure: runs before the manager's post-hook, with the lock held.
        self.inside = block.register_forward_hook(self._inside)
        model.embed.register_forward_hook(self._after_embed)

    def install_door(self, model):
        # Registered after configure with prepend: runs before the manager's pre-hook (the lock).
        model.transformer_blocks[0].register_forward_pre_hook(self._door, prepend=True)

    def _after_embed(self, module, args, output):
        if threading.get_ident() != self.tuner and self.request.is_set():
            self.request.clear()
            self.parked.set()
            assert self.release.wait(WAIT_S), "the tuning thread never released the server"
            self.release.clear()
            self.going = True

    def _door(self, module, args):
        if threading.get_ident() != self.tuner and self.going:
            self.going = False
            self.at_door.set()

    def _inside(self, module, args, output):
        if threading.get_ident() == self.tuner and self.pending:
            self.pending = False
            self.release.set()
            assert self.at_door.wait(WAIT_S), "the server never reached block 0"
            self.at_door.clear()

    def run(self, model, x):
        self.request.set()
        assert self.parked.wait(WAIT_S), "the server never parked"
        self.parked.clear()
        self.pending = True
        return model(x)


def test_tune_while_another_thread_serves_measures_its_own_calls():
    ref = make()
    xs, serve_x = inputs(1), inputs(2)[1]
    want = outputs(ref, [serve_x])[0]
    model = make()
    meet = Interleave(model)
    managers = layerwise.configure_layerwise_offload(model, GROUPS, device="cpu")
    meet.install_door(model)
    budget = non_layer_bytes(model, managers) + 3 * max(lp.nbytes for m in managers for lp in m.plan.layers) * 2
    stop, bad, errors, served = threading.Event(), [], [], [0]

    def serve():
        try:
            while not stop.is_set():
                with torch.no_grad():
                    out = model(serve_x)
                if not torch.equal(out, want):
                    bad.append(served[0])
                served[0] += 1
        except BaseException as err:  # noqa: BLE001 - reported by the test
            errors.append(err)

    t = threading.Thread(target=serve)
    t.start()
    try:
        plan = layerwise.tune(model, lambda mm: meet.run(mm, xs[0]), device_budget=budget, repeats=2)
    finally:
        stop.set()
        meet.release.set()  # (a server parked when tune stopped asking)
        t.join(WAIT_S)
    assert not t.is_alive() and not errors, errors
    assert plan.applied and served[0] > 0 and not bad, (served[0], bad)
    for m, g in zip(managers, plan.groups):
        assert (m.resident, m.prefetch_depth) == (g["resident"], g["prefetch_depth"])
    meet.inside.remove()
    assert same(outputs(model, xs), outputs(ref, xs))


def test_tune_says_so_when_only_another_thread_called_the_model():
    model = make()
    (x,) = inputs(1)
    layerwise.configure_layerwise_offload(model, GROUPS, device="cpu")

    def elsewhere(mm):
        t = threading.Thread(target=lambda: outputs(mm, [x]))
        t.start()
        t.join()

    with pytest.raises(RuntimeError, match="another thread"):
        layerwise.tune(model, elsewhere, repeats=1)


# ------------------------------------------------- a graph across a placement change
class ShiftBlock(nn.Module):
    """adaLN-like: parameters the graph uses without saving them (AccumulateGrad only)."""

    def __init__(self, d):
        super().__init__()
        self.shift = nn.Parameter(torch.randn(d))
        self.bias = nn.Parameter(torch.randn(d))

    def forward(self, x):
        return torch.tanh(x + self.shift + self.bias)  # (tanh saves its output, not a weight)


class ShiftModel(nn.Module):
    def __init__(self, d=16, n=4):
        super().__init__()
        self.blocks = nn.ModuleList([ShiftBlock(d) for _ in range(n)])
        self.head = nn.Linear(d, d)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def shift_model(seed=0):
    torch.manual_seed(seed)
    return ShiftModel()


def grads_of(ref, x):
    ref.zero_grad(set_to_none=True)
    ref(x).square().sum().backward()
    return [p.grad.clone() for p in ref.parameters()]


def grads_equal(model, want) -> bool:
    return all(p.grad is not None and torch.equal(p.grad, w) for p, w in zip(model.parameters(), want))


def test_a_graph_using_streamed_parameters_without_saving_them_refuses_a_change_until_its_backward():
    x = torch.randn(3, 16)
    want = grads_of(shift_model(), x)
    model = shift_model()
    (m,) = layerwise.configure_layerwise_offload(model, "blocks", device="cpu")
    loss = model(x).square().sum()
    with pytest.raises(RuntimeError, match="between a forward and its backward") as err:
        m.set_residency([1, 2], 2)
    assert "no_grad" in str(err.value) and "backward first" in str(err.value)
    assert (m.resident, m.prefetch_depth) == ([], 1)
    loss.backward()
    assert grads_equal(model, want)
    m.set_residency([1, 2], 2)  # its backward ran (the graph may stay alive)
    model.zero_grad(set_to_none=True)
    model(x).square().sum().backward()
    assert grads_equal(model, want)
    out = model(x)  # a graph dropped without its backward holds nothing back
    del out
    m.set_residency([3], 1)
    model.zero_grad(set_to_none=True)
    model(x).square().sum().backward()
    assert grads_equal(model, want)
    with torch.no_grad():
        assert torch.equal(model(x), shift_model()(x))


def test_a_graph_dropped_without_its_backward_is_freed():
    """A saved-tensor hook that gives back an op's own output as it is makes a cycle
    through C++ (node -> saved output -> its grad_fn) that no collector frees."""
    model = shift_model()
    layerwise.configure_layerwise_offload(model, "blocks", device="cpu")
    seen = []
    model.blocks[1].register_forward_hook(lambda mod, args, out: seen.append(weakref.ref(out)))
    out = model(torch.randn(3, 16))
    del out
    gc.collect()
    assert seen and seen[0]() is None


def test_a_change_from_another_thread_during_a_backward_is_refused_and_the_gradients_stay_exact():
    x = torch.randn(3, 16)
    want = grads_of(shift_model(), x)
    model = shift_model()
    (m,) = layerwise.configure_layerwise_offload(model, "blocks", device="cpu")
    mid = {}
    # The backward pauses once the blocks after block 2 are done (their gradients given):
    # half of the graph has run, the rest (blocks 0-1) is still to run.
    def keep_input(mod, args):
        mid.setdefault("x", args[0])

    model.blocks[2].register_forward_pre_hook(keep_input)
    loss = model(x).square().sum()
    in_backward, tried, result = threading.Event(), threading.Event(), {}

    def pause(grad):
        in_backward.set()
        assert tried.wait(WAIT_S), "the other thread never tried its change"
        return grad

    mid["x"].register_hook(pause)

    def backward():
        try:
            loss.backward()
        except BaseException as err:  # noqa: BLE001 - reported by the test
            result["backward"] = err

    def change():
        try:
            assert in_backward.wait(WAIT_S)
            m.set_residency([0, 3], 2)
        except BaseException as err:  # noqa: BLE001 - the refusal expected
            result["change"] = err
        finally:
            tried.set()

    threads = [threading.Thread(target=backward), threading.Thread(target=change)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    assert "backward" not in result, result["backward"]
    assert isinstance(result.get("change"), RuntimeError), result
    assert "between a forward and its backward" in str(result["change"])
    assert (m.resident, m.prefetch_depth) == ([], 1)
    assert grads_equal(model, want)
    m.set_residency([0, 3], 2)  # the backward is over
    model.zero_grad(set_to_none=True)
    model(x).square().sum().backward()
    assert grads_equal(model, want)


# ------------------------------------------------- load_state_dict(assign=True)
def shifted(ref, by=0.5):
    return {k: (v + by).clone() if v.is_floating_point() else v.clone() for k, v in ref.state_dict().items()}


def test_parameters_assigned_into_a_resident_layer_stream_when_it_leaves_the_device():
    ref = make()
    xs = inputs()
    model = make()
    a, _ = layerwise.configure_layerwise_offload(model, GROUPS, device="cpu", resident_layers=2)
    new = shifted(ref)
    model.load_state_dict(new, assign=True)
    ref.load_state_dict(new, assign=True)
    assert same(outputs(model, xs), outputs(ref, xs))
    a.set_residency([])
    for i in (0, 1):  # the objects assign=True put there are the ones bound to the ring
        for name, p in model.transformer_blocks[i].named_parameters():
            assert in_ring(a, p), f"transformer_blocks.{i}.{name} is not in the ring"
    assert a.stats()["resident_bytes"] == 0
    assert same(outputs(model, xs), outputs(ref, xs)) and sd_equal(model, ref)
    # their bytes are the layers' truth: a load reaches them, and they come back resident
    again = shifted(ref, 0.25)
    model.load_state_dict(again)
    ref.load_state_dict(again)
    assert same(outputs(model, xs), outputs(ref, xs))
    a.set_residency([0, 1])
    assert same(outputs(model, xs), outputs(ref, xs)) and sd_equal(model, ref)
    layerwise.remove_layerwise_offload(model)
    assert same(outputs(model, xs), outputs(ref, xs)) and sd_equal(model, ref)


def test_a_parameter_assigned_in_another_layout_keeps_its_layer_resident_with_a_clear_error():
    ref = make()
    xs = inputs()
    model = make()
    _, b = layerwise.configure_layerwise_offload(model, GROUPS, device="cpu", resident_layers=2)
    key = "single_transformer_blocks.1.down_t"
    value = ref.state_dict()[key] * 2
    transposed = {key: value.t().contiguous().t()}  # the same values, stored column-major
    model.load_state_dict(transposed, strict=False, assign=True)
    ref.load_state_dict(transposed, strict=False, assign=True)
    with pytest.raises(RuntimeError, match="assign=True") as err:
        b.set_residency([])
    assert key in str(err.value) and "strides" in str(err.value) and "resident" in str(err.value)
    assert b.resident == [0, 1]
    assert same(outputs(model, xs), outputs(ref, xs))
    b.set_residency([1])  # layer 0 may leave; layer 1 stays
    assert same(outputs(model, xs), outputs(ref, xs)) and sd_equal(model, ref)


def test_assign_into_a_streamed_layer_loads_its_values_and_keeps_it_streaming():
    ref = make()
    xs = inputs()
    model = make()
    a, _ = layerwise.configure_layerwise_offload(model, GROUPS, device="cpu")
    new = shifted(ref)
    model.load_state_dict(new, assign=True)
    ref.load_state_dict(new, assign=True)
    assert all(in_ring(a, p) for p in model.transformer_blocks.parameters())
    assert same(outputs(model, xs), outputs(ref, xs)) and sd_equal(model, ref)
    a.set_residency([0, 3])
    a.set_residency([])
    assert all(in_ring(a, p) for p in model.transformer_blocks.parameters())
    assert same(outputs(model, xs), outputs(ref, xs)) and sd_equal(model, ref)


# ------------------------------------------------------------- argument types
@pytest.mark.parametrize("spec", [
    np.array([0, 2]), np.array([2, 0, 2], dtype=np.int32), torch.tensor([0, 2]),
    torch.tensor([2, 0], dtype=torch.int16),
    "generator", [np.int64(0), np.int32(2)], (torch.tensor(0), 2), {0: "a", 2: "b"}.keys(),
], ids=["ndarray", "ndarray-int32", "tensor", "tensor-int16", "generator", "numpy-ints", "0d-tensors", "dict-keys"])
def test_set_residency_takes_indices_in_their_natural_types(spec):
    ref = make()
    xs = inputs()
    model = make()
    a, _ = layerwise.configure_layerwise_offload(model, GROUPS, device="cpu")
    a.set_residency((i for i in (0, 2)) if isinstance(spec, str) else spec)
    assert a.resident == [0, 2]
    assert same(outputs(model, xs), outputs(ref, xs))


def test_set_residency_takes_numpy_and_tensor_counts():
    model = make()
    a, _ = layerwise.configure_layerwise_offload(model, GROUPS, device="cpu")
    a.set_residency(np.int64(2))
    assert a.resident == [0, 1]
    a.set_residency(torch.tensor(3))
    assert a.resident == [0, 1, 2]
    a.set_residency(np.float64(0.5))
    assert a.resident == [0, 1, 2]


@pytest.mark.parametrize("bad", [
    torch.tensor([0.0, 2.0]), np.array([0.5, 2.0]), np.array([True, False]), torch.tensor([True, False]),
    [True, 2], True, np.bool_(True), np.array([[0, 1]]), torch.tensor(1.0), [torch.tensor(0.0)],
], ids=["float-tensor", "float-ndarray", "bool-ndarray", "bool-tensor", "bool-in-list", "bool", "numpy-bool",
        "2d", "0d-float-tensor", "float-tensor-in-list"])
def test_set_residency_refuses_floats_and_bools_as_indices_naming_resident(bad):
    ref = make()
    xs = inputs()
    model = make()
    a, _ = layerwise.configure_layerwise_offload(model, GROUPS, device="cpu")
    a.set_residency([1])
    with pytest.raises(TypeError, match="resident="):
        a.set_residency(bad)
    assert a.resident == [1]
    assert same(outputs(model, xs), outputs(ref, xs))


def test_tune_takes_numpy_integers_for_its_budget_and_repeats():
    ref = make()
    xs = inputs()
    model = make()
    managers = layerwise.configure_layerwise_offload(model, GROUPS, device="cpu")
    budget = non_layer_bytes(model, managers) + 4 * max(lp.nbytes for m in managers for lp in m.plan.layers)
    plan = layerwise.tune(model, lambda mm: outputs(mm, xs[:1]), device_budget=np.int64(budget),
                          repeats=np.int64(1))
    assert plan.applied and plan.budget == budget
    assert same(outputs(model, xs), outputs(ref, xs))
    with pytest.raises(ValueError, match="device_budget"):
        layerwise.tune(model, lambda mm: outputs(mm, xs[:1]), device_budget=np.float64("nan"))
    with pytest.raises((TypeError, ValueError), match="repeats"):
        layerwise.tune(model, lambda mm: outputs(mm, xs[:1]), repeats=np.float64(1.5))
    with pytest.raises(ValueError, match="repeats"):
        layerwise.tune(model, lambda mm: outputs(mm, xs[:1]), repeats=np.int64(0))
