"""set_residency as a transaction, beyond test_residency.py: what it cannot apply
whole is refused before anything changes (a weakly referenced quantized wrapper, a
read-only checkpoint layer changed while resident), a parameter rebound
(`.data =`) since the last check is kept, and a failure in the second phase
leaves one placement whole."""
import weakref

import pytest
import torch
from torch import nn

import layerwise
from layerwise import contract
from layerwise.contract import rebinds

from helpers.residency import GROUPS, inputs, leaves_equal, make, outputs, quantized, same


def sd_diffs(model, ref) -> list:
    sd = model.state_dict()
    return [k for k, v in ref.state_dict().items() if not leaves_equal(sd[k], v)]


def test_a_weakly_referenced_quantized_weight_is_refused_before_anything_changes():
    """A weak reference to a streamed torchao wrapper (taken after configure, which
    refuses one at configure) makes torch.utils.swap_tensors refuse in the second
    phase: the group was left half-applied (new ring, old bindings), outputs and
    state_dict wrong. It must be refused in phase one, the old placement whole."""
    q = quantized
    ref = q()
    xs = inputs()
    want = outputs(ref, xs)
    model = q()
    a = layerwise.configure_layerwise_offload(model, GROUPS, device="cpu")[0]
    held = weakref.ref(model.transformer_blocks[2].up.weight)
    with pytest.raises(RuntimeError, match="weak"):
        a.set_residency([1, 2], 2)
    assert (a.resident, a.prefetch_depth) == ([], 1)
    assert same(outputs(model, xs), want)
    del held
    assert sd_diffs(model, ref) == []
    a.set_residency([1, 2], 2)
    assert same(outputs(model, xs), want)
    assert sd_diffs(model, ref) == []


@pytest.mark.parametrize("case", ["made resident", "stays streamed"])
def test_a_parameter_rebound_since_the_last_check_is_kept(case):
    """`p.data = t` on a streamed parameter outside a forward is adopted by the
    state contract (layerwise/rebinds.py) at the next check; set_residency rebound
    every parameter without that check and silently dropped the new values."""
    ref = make()
    xs = inputs()
    model = make()
    a = layerwise.configure_layerwise_offload(model, GROUPS, device="cpu")[0]
    outputs(model, xs)
    for m in (model, ref):
        b = m.transformer_blocks[3].up.bias
        b.data = torch.full_like(b.data, 0.5)
    a.set_residency([3] if case == "made resident" else [0], 2)
    assert same(outputs(model, xs), outputs(ref, xs))
    assert sd_diffs(model, ref) == []


@pytest.mark.parametrize("target", [
    "install_layer_hooks",
    "Bound",
    "unwatch",
])
def test_a_failure_in_the_second_phase_leaves_one_placement_whole(monkeypatch, target):
    """Phase two of set_residency allocates (the drift record, the contract's hooks):
    a MemoryError there left the new ring bound without the contract's hooks (or
    the old bindings over a released ring): state_dict() read slot views."""
    ref = make()
    xs = inputs()
    want = outputs(ref, xs)
    model = make()
    a = layerwise.configure_layerwise_offload(model, GROUPS, device="cpu")[0]
    a.set_residency([5], 1)  # five streamed layers over three slots
    where = {"install_layer_hooks": contract, "Bound": rebinds, "unwatch": contract}[target]

    real, calls = getattr(where, target), [0]

    def refuse(*args, **kw):  # (the first call fails: the way back may call it again)
        calls[0] += 1
        if calls[0] == 1:
            raise MemoryError(f"injected in {target}")
        return real(*args, **kw)

    monkeypatch.setattr(where, target, refuse)
    if target == "unwatch":  # (stale records only make guards refuse: the change goes through)
        a.set_residency([], 2)
    else:
        with pytest.raises(MemoryError):
            a.set_residency([], 2)  # six over three: a slot view is not its layer's bytes between forwards
    monkeypatch.undo()
    assert calls[0] >= 1
    assert (a.resident, a.prefetch_depth) in (([5], 1), ([], 2))
    assert same(outputs(model, xs), want)
    assert sd_diffs(model, ref) == []
    a.set_residency([0], 1)
    assert same(outputs(model, xs), want)
    assert sd_diffs(model, ref) == []


def test_a_checkpoint_layer_changed_while_resident_is_refused_with_the_way_out(tmp_path):
    """A layer streamed from a read-only checkpoint file, made resident, changed by
    load_state_dict, then made streamed: refused, the model unchanged. The error
    named only configure-time remedies (load_offloaded's spill_dir / host_budget),
    not the call that failed nor what to do now (keep the layer resident)."""
    from helpers.disk import budget, meta_model, save_checkpoint
    from helpers.disk import inputs as net_inputs
    from helpers.disk import make as make_net

    ref = make_net()
    ckpt = save_checkpoint(ref, str(tmp_path / "model.safetensors"))
    model = meta_model()
    (m,) = layerwise.load_offloaded(model, ckpt, "blocks", device="cpu", host_budget=budget(ref, 1))
    disk = [i for i, s in enumerate(m.sources) if s.kind == "disk"]
    k = disk[1]
    m.set_residency([k], 1)
    key = f"blocks.{k}.fc.weight"
    new = {key: ref.state_dict()[key] * 2}
    model.load_state_dict(new, strict=False)
    ref.load_state_dict(new, strict=False)
    xs = net_inputs()
    want = outputs(ref, xs)
    with pytest.raises(RuntimeError, match=rf"(?si)set_residency.*blocks\[{k}\].*changed while resident.*keep it resident"):
        m.set_residency([], 1)
    assert (m.resident, m.prefetch_depth) == ([k], 1)
    assert same(outputs(model, xs), want)
    assert sd_diffs(model, ref) == []
    layerwise.remove_layerwise_offload(model)


def test_state_dict_of_a_weakly_referenced_quantized_weight_says_what_to_do():
    """Found on the way: state_dict() rebinds a streamed wrapper over its true bytes
    (contract._bound_to_truth) with swap_tensors, which refuses a weakly referenced
    one: "Cannot swap t1 because it has weakref associated with it", naming neither
    the parameter nor the way out."""
    quant = pytest.importorskip("torchao.quantization")
    model = make()
    for blocks in (model.transformer_blocks, model.single_transformer_blocks):
        quant.quantize_(blocks, quant.Int8WeightOnlyConfig(), filter_fn=lambda mod, fqn: isinstance(mod, nn.Linear))
    xs = inputs()
    layerwise.configure_layerwise_offload(model, GROUPS, device="cpu")
    want = outputs(model, xs)
    held = weakref.ref(model.transformer_blocks[2].up.weight)
    with pytest.raises(RuntimeError, match=r"(?s)transformer_blocks\.2\.up\.weight.*referenced weakly.*Drop"):
        model.state_dict()
    assert same(outputs(model, xs), want)
    del held
    model.state_dict()
