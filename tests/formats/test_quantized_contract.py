"""The state contract on quantized models off the happy path: a peft adapter added
after configure, a wrapper rebuild failing during remove, a cast to the dtype the
model already has, an in-place write into a quantized leaf. Each test against the
resident quantized model, bitwise, or a clear refusal with the model unchanged."""
import pytest
import torch

import layerwise
from layerwise.configure import managers_of
from layerwise.formats import quantized as quantized_mod

from helpers.quantized import assert_computes_from_slots, assert_state_equal, inputs, make, run


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("kind", ["ao-int8", "quanto-qint8"])
def test_peft_lora_added_after_configure_to_a_quantized_group(kind):
    """peft's inject_adapter registers a tuner layer inside a streamed layer; the
    registration hook checked the base weight's own storage, which a quantized
    wrapper does not have (torch: 'invalid python storage'), so get_peft_model failed
    half-way with the model's modules partly replaced."""
    peft = pytest.importorskip("peft")
    cfg = dict(r=4, target_modules=["up", "down"], init_lora_weights=False)
    ref = make(kind)
    torch.manual_seed(5)
    ref = peft.get_peft_model(ref, peft.LoraConfig(**cfg))
    expect = run(ref, inputs())
    model = make(kind)
    layerwise.configure_layerwise_offload(model, "blocks", device="cpu")
    run(model, inputs())
    torch.manual_seed(5)
    peft_model = peft.get_peft_model(model, peft.LoraConfig(**cfg))
    for _ in range(2):
        assert same(run(peft_model, inputs()), expect)
    assert_computes_from_slots(model)
    assert_state_equal(peft_model.state_dict(), ref.state_dict())
    layerwise.remove_layerwise_offload(model)
    assert same(run(peft_model, inputs()), expect)
    assert_state_equal(peft_model.state_dict(), ref.state_dict())


@pytest.mark.parametrize("kind", ["ao-int8", "quanto-qint4"])
@pytest.mark.parametrize("exc", [RuntimeError, MemoryError])
def test_a_wrapper_rebuild_failing_during_remove_leaves_the_model_streaming(monkeypatch, kind, exc):
    """remove_layerwise_offload is a transaction: phase one builds, phase two only
    rebinds. The quantized wrappers were rebuilt (the library's __tensor_unflatten__)
    in phase two, after the hooks were gone: a failure at the second wrapper left the
    first ones plain, the rest on slot views, no hooks, and state_dict() wrong."""
    ref = make(kind, n=4)
    expect = run(ref, inputs())
    sd_ref = ref.state_dict()
    orig = quantized_mod.rebuild
    calls, fail_at = [0], [0]

    def counting(*a, **kw):
        calls[0] += 1
        if calls[0] == fail_at[0]:
            raise exc(f"injected at {fail_at[0] - 1}")
        return orig(*a, **kw)

    monkeypatch.setattr(quantized_mod, "rebuild", counting)
    probe = make(kind, n=4)
    layerwise.configure_layerwise_offload(probe, "blocks", device="cpu")
    calls[0] = 0
    layerwise.remove_layerwise_offload(probe)
    total = calls[0]
    assert total >= 8
    for k in (1, total // 2, total - 1):
        model = make(kind, n=4)
        layerwise.configure_layerwise_offload(model, "blocks", device="cpu")
        run(model, inputs())
        calls[0], fail_at[0] = 0, k + 1
        with pytest.raises(exc, match=f"injected at {k}$"):
            layerwise.remove_layerwise_offload(model)
        fail_at[0] = 0
        assert managers_of(model)
        for _ in range(2):
            assert same(run(model, inputs()), expect)
        assert_computes_from_slots(model)
        assert_state_equal(model.state_dict(), sd_ref)
        layerwise.remove_layerwise_offload(model)
        assert not managers_of(model)
        assert same(run(model, inputs()), expect)
        assert_state_equal(model.state_dict(), sd_ref)


@pytest.mark.parametrize("kind", ["ao-int8", "ao-fp8", "quanto-qint8"])
@pytest.mark.parametrize("cast", ["bfloat16", "to_bf16"])
def test_a_cast_to_the_dtype_a_quantized_model_already_has_is_a_no_op(kind, cast):
    """`.to(torch.bfloat16)` of a bf16 model quantized by torchao is a no-op resident
    (the wrapper keeps its fp32 scale); the cast guard probed each leaf's dtype and
    refused it ("would turn the streamed torch.float32 weights into bfloat16")."""
    def apply(m):
        return m.bfloat16() if cast == "bfloat16" else m.to(torch.bfloat16)

    ref = apply(make(kind))
    expect = run(ref, inputs())
    model = make(kind)
    layerwise.configure_layerwise_offload(model, "blocks", device="cpu")
    run(model, inputs())
    apply(model)
    for _ in range(2):
        assert same(run(model, inputs()), expect)
    assert_computes_from_slots(model)
    assert_state_equal(model.state_dict(), ref.state_dict())
    with pytest.raises(RuntimeError, match=r"would turn the streamed torch\.bfloat16 .* into torch\.float16.*unchanged"):
        model.half()
    assert same(run(model, inputs()), expect)
    layerwise.remove_layerwise_offload(model)
    assert_state_equal(model.state_dict(), ref.state_dict())


def test_an_in_place_write_into_a_quantized_leaf_names_the_weight_once():
    """Its leaves (qdata, scale) share the weight's name: the error says it once."""
    from helpers.quantized import inputs, make

    pytest.importorskip("torchao")
    model = make("ao-int8", n=6)
    layerwise.configure_layerwise_offload(model, "blocks", device="cpu", prefetch_depth=1)
    x = inputs(1)[0]
    with torch.no_grad():
        model(x)
        model.blocks[0].up.weight.qdata.add_(1)
        model.blocks[0].up.weight.scale.mul_(2)
        with pytest.raises(RuntimeError, match="in-place write") as err:
            model(x)
    msg = str(err.value)
    # (which names it gives depends on whether the slot still held blocks[0]: each at most once)
    assert msg.count("up.weight") == 1 and msg.count("down.weight") <= 1, msg
