"""Quantized wrapper tensors (torchao, optimum-quanto) stream as their plain inner
tensors (layerwise/formats/quantized.py): each test against the resident quantized
model, bitwise, on the CPU backend. The libraries are test extras installed by
scripts/setup_env.sh (--no-deps); a test skips only where one is not installed."""
import glob
import os
import random
import re

import pytest
import torch

import layerwise
from layerwise.configure import managers_of
from layerwise.formats import quantized as quantized_mod
from layerwise.runtime import host_store as packing_mod

from helpers.quantized import (
    KINDS,
    Stack,
    assert_computes_from_slots,
    assert_state_equal,
    inputs,
    leaves,
    make,
    quantize,
    run,
    snapshot,
    stored_bytes,
)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("depth", [1, 2])
def test_block_stack_streams_quantized_bytes_bitwise(kind, depth):
    ref = make(kind, n=6)  # (6 layers: more than a depth-2 ring holds, so every step copies every layer)
    expect = run(ref, inputs())
    sd_ref = ref.state_dict()
    quant = stored_bytes(ref.blocks)
    bf16 = sum(p.numel() * 2 for p in Stack(6).blocks.parameters())
    assert quant < 0.6 * bf16

    model = make(kind, n=6)
    random.seed(depth)
    [m] = layerwise.configure_layerwise_offload(model, "blocks", device="cpu", prefetch_depth=depth,
                                                debug_copy_delay_us=random.randint(50, 500))
    assert m.plan.managed_bytes == quant  # the leaves' bytes, never the wrapper's outer dtype and shape
    for _ in range(3):
        for out, want in zip(run(model, inputs()), expect):
            assert torch.equal(out, want)
    assert_computes_from_slots(model)
    copied = m.stats()["last_step"]["bytes_copied"]
    assert 0 < copied <= 1.15 * quant, (copied, quant)
    assert_state_equal(model.state_dict(), sd_ref)

    layerwise.remove_layerwise_offload(model)
    assert not managers_of(model)
    assert_state_equal(model.state_dict(), sd_ref)
    for out, want in zip(run(model, inputs()), expect):
        assert torch.equal(out, want)


@pytest.mark.parametrize("kind", KINDS)
def test_load_state_dict_round_trip(kind):
    other = make(kind, seed=1)
    expect = run(other, inputs())
    sd_other = other.state_dict()
    model = make(kind)
    sd_own = snapshot(model.state_dict())
    layerwise.configure_layerwise_offload(model, "blocks", device="cpu")
    run(model, inputs())
    result = model.load_state_dict(sd_other)
    assert not result.missing_keys and not result.unexpected_keys
    for out, want in zip(run(model, inputs()), expect):
        assert torch.equal(out, want)
    assert_computes_from_slots(model)
    assert_state_equal(model.state_dict(), sd_other)
    layerwise.remove_layerwise_offload(model)
    assert_state_equal(model.state_dict(), sd_other)
    assert {k: [x.shape for x in v] for k, v in sd_own.items()} == {
        k: [x.shape for x in leaves(v)] for k, v in model.state_dict().items()}


@pytest.mark.parametrize("kind", ["ao-int8", "quanto-qint8"])
def test_a_state_dict_of_another_form_is_refused_and_the_model_unchanged(kind):
    model = make(kind)
    expect = run(make(kind), inputs())
    sd_ref = make(kind).state_dict()
    layerwise.configure_layerwise_offload(model, "blocks", device="cpu")
    bad = make("ao-fp8" if kind == "ao-int8" else "quanto-qfloat8", seed=1).state_dict()
    with pytest.raises(RuntimeError, match=r"cannot be loaded into the streamed .* The model is unchanged"):
        model.load_state_dict(bad)
    plain = {k: (torch.zeros(v.shape, dtype=torch.bfloat16) if k.endswith("up.weight") else v)
             for k, v in sd_ref.items()}
    if kind == "ao-int8":
        with pytest.raises(RuntimeError, match="plain torch.bfloat16"):
            model.load_state_dict(plain)
    for out, want in zip(run(model, inputs()), expect):
        assert torch.equal(out, want)
    assert_state_equal(model.state_dict(), sd_ref)


@pytest.mark.parametrize("kind", ["ao-int8", "quanto-qint4"])
def test_compress_lossless_composes_bitwise(kind):
    ref = make(kind)
    expect = run(ref, inputs())
    model = make(kind)
    [m] = layerwise.configure_layerwise_offload(model, "blocks", device="cpu", compress="lossless")
    for _ in range(2):
        for out, want in zip(run(model, inputs()), expect):
            assert torch.equal(out, want)
    assert m.stats()["last_step"]["bytes_copied"] <= 1.15 * stored_bytes(ref.blocks)
    assert_state_equal(model.state_dict(), ref.state_dict())
    layerwise.remove_layerwise_offload(model)
    assert_state_equal(model.state_dict(), ref.state_dict())


@pytest.mark.parametrize("kind", ["ao-int8", "ao-fp8", "quanto-qint8"])
def test_a_quantized_head_outside_the_group_does_not_block_plain_blocks(kind):
    def build():
        torch.manual_seed(0)
        model = Stack().to(torch.bfloat16).eval()
        return quantize(model, kind, only="head")

    ref = build()
    expect = run(ref, inputs())
    model = build()
    assert quantized_mod.is_wrapper(model.head.weight)
    [m] = layerwise.configure_layerwise_offload(model, "blocks", device="cpu")
    assert m.plan.managed_bytes == stored_bytes(ref.blocks)
    for out, want in zip(run(model, inputs()), expect):
        assert torch.equal(out, want)
    assert_state_equal(model.state_dict(), ref.state_dict())
    layerwise.remove_layerwise_offload(model)
    assert_state_equal(model.state_dict(), ref.state_dict())


def _fingerprint(model):
    return {n: (id(p), type(p), [x.clone() for x in leaves(p)]) for n, p in model.named_parameters()}


def _assert_fingerprint(model, fp):
    now = dict(model.named_parameters())
    assert now.keys() == fp.keys()
    for n, (pid, cls, data) in fp.items():
        p = now[n]
        assert id(p) == pid and type(p) is cls, n
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(leaves(p), data)), n
        assert tuple(p.shape) == tuple(now[n].shape)


@pytest.mark.parametrize("kind", ["ao-int8", "quanto-qint4"])
@pytest.mark.parametrize("where", ["before_copy", "placeholder", "rebind"])
@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_a_failure_at_every_parameter_index_rolls_back_exactly(monkeypatch, kind, where, exc):
    ref = make(kind, n=2)
    expect = run(ref, inputs())
    from layerwise.planning.layout import ParamEntry

    target = {"before_copy": (ParamEntry, "source"), "placeholder": (packing_mod.HostLayers, "leaf_placeholder"),
              "rebind": (quantized_mod, "rebind")}[where]
    orig = getattr(*target)
    calls = [0]

    def counting(*a, **kw):
        calls[0] += 1
        if calls[0] == fail_at[0]:
            raise exc(f"injected at {fail_at[0] - 1}")
        return orig(*a, **kw)

    fail_at = [0]
    monkeypatch.setattr(*target, counting)
    probe = make(kind, n=2)
    layerwise.configure_layerwise_offload(probe, "blocks", device="cpu")
    total = calls[0]  # (those of configure: removal rebinds too)
    layerwise.remove_layerwise_offload(probe)
    assert total >= 4
    for k in range(total):
        model = make(kind, n=2)
        fp = _fingerprint(model)
        calls[0], fail_at[0] = 0, k + 1
        with pytest.raises(exc, match=f"injected at {k}$"):
            layerwise.configure_layerwise_offload(model, "blocks", device="cpu")
        assert not managers_of(model)
        _assert_fingerprint(model, fp)
        fail_at[0] = 0
        for out, want in zip(run(model, inputs()), expect):
            assert torch.equal(out, want)


def test_a_wrapper_that_cannot_be_rebuilt_is_refused_naming_it():
    pytest.importorskip("torchao")
    model = make("ao-int8", n=2)
    fp = _fingerprint(model)
    cls = type(model.blocks[0].up.weight)

    class Broken(cls):
        @classmethod
        def __tensor_unflatten__(klass, *a, **kw):
            raise TypeError("no")

    model.blocks[1].up.weight.__class__ = Broken
    with pytest.raises(ValueError, match=r"'blocks\.1\.up\.weight' is a .*Broken .*cannot rebuild"):
        layerwise.configure_layerwise_offload(model, "blocks", device="cpu")
    model.blocks[1].up.weight.__class__ = cls
    _assert_fingerprint(model, fp)


def _llama(kind):
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
                         bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    if kind.startswith("ao-"):
        return quantize(model, kind)
    pytest.importorskip("optimum.quanto")
    from optimum import quanto

    quanto.quantize(model.model.layers, weights={"quanto-qint8": quanto.qint8, "quanto-qint4": quanto.qint4}[kind])
    quanto.freeze(model.model.layers)
    return model


@pytest.mark.parametrize("kind", ["ao-int8", "ao-fp8", "ao-int4", "quanto-qint8"])
def test_tiny_llama_generate_matches_resident(kind):
    ref = _llama(kind)
    prompt = torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(31))
    gen = dict(max_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    with torch.no_grad():
        expected = ref.generate(prompt, attention_mask=torch.ones_like(prompt), **gen)
    model = _llama(kind)
    [m] = layerwise.configure_layerwise_offload(model, "model.layers", device="cpu", prefetch_depth=2,
                                                debug_copy_delay_us=200)
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), **gen)
    assert torch.equal(out.sequences, expected.sequences)
    assert all(torch.equal(a, b) for a, b in zip(out.logits, expected.logits))
    assert_computes_from_slots(model)
    assert m.stats()["last_step"]["bytes_copied"] <= 1.15 * stored_bytes(ref.model.layers)
    assert_state_equal(model.state_dict(), ref.state_dict())
    layerwise.remove_layerwise_offload(model)
    assert_state_equal(model.state_dict(), ref.state_dict())


# ------------------------------------------------------------------ the disk tier
TIER_KINDS = ["ao-int8", "ao-fp8", "quanto-qint4"]


@pytest.fixture
def spill_dir(tmp_path):
    from layerwise.stages.disk.reader import filesystem_type

    if filesystem_type(tmp_path) in ("tmpfs", "ramfs"):
        pytest.skip("tmp_path is on a memory file system here")
    return str(tmp_path)


def spill_files(d):
    return sorted(glob.glob(os.path.join(d, "layerwise-*.spill")))


def host_budget_keeping(offload, layers_in_memory, layer_bytes):
    """A host_budget that keeps about `layers_in_memory` layers in memory and the
    rest on disk: the smallest budget the planner accepts (the one a refusal names)
    plus that many layers."""
    try:
        model = offload(64 << 10)
    except ValueError as e:
        need = re.search(r"host memory needs [^(]*\((\d+) bytes", str(e))
        assert "too small" in str(e) and need, e
        return int(need[1]) + layers_in_memory * layer_bytes
    layerwise.remove_layerwise_offload(model)
    raise AssertionError("a 64 KiB host budget was accepted")


def check_streamed_contract(model, ref_kind, expect, sd_ref, n, spill=None):
    """Outputs bitwise (several steps), wrappers computing from their slots,
    state_dict, a load_state_dict round trip, remove bitwise with spill files deleted."""
    for _ in range(3):
        for out, want in zip(run(model, inputs()), expect):
            assert torch.equal(out, want)
    assert_computes_from_slots(model)
    assert_state_equal(model.state_dict(), sd_ref)
    other = make(ref_kind, seed=1, n=n)
    model.load_state_dict(other.state_dict())
    for out, want in zip(run(model, inputs()), run(other, inputs())):
        assert torch.equal(out, want)
    assert_state_equal(model.state_dict(), other.state_dict())
    model.load_state_dict(sd_ref)
    layerwise.remove_layerwise_offload(model)
    assert not managers_of(model)
    if spill is not None:
        assert spill_files(spill) == []
    assert_state_equal(model.state_dict(), sd_ref)
    for out, want in zip(run(model, inputs()), expect):
        assert torch.equal(out, want)


@pytest.mark.parametrize("kind", TIER_KINDS)
@pytest.mark.parametrize("compress", [None, "lossless"])
def test_disk_tier_streams_quantized_bytes_from_spill_files(spill_dir, kind, compress):
    """host_budget + spill_dir: the layers that do not fit are written to a spill file
    as their quantized leaves and read back per step (at most their quantized bytes);
    the others stay in memory; bitwise, with the state contract."""
    n = 6
    ref = make(kind, n=n)
    expect = run(ref, inputs())
    sd_ref = ref.state_dict()
    quant = stored_bytes(ref.blocks)
    opts = dict(device="cpu", spill_dir=spill_dir, compress=compress, debug_copy_delay_us=100,
                debug_read_delay_us=100)

    def offload(budget):
        model = make(kind, n=n)
        layerwise.configure_layerwise_offload(model, "blocks", host_budget=budget, **opts)
        return model

    model = offload(host_budget_keeping(offload, 2, quant // n))
    [m] = managers_of(model)
    assert 1 <= len(m.tiers.disk_layers) < n, m.stats()["tier_plan"]
    assert len(spill_files(spill_dir)) == 1
    run(model, inputs())
    run(model, inputs())  # (the first step's reads include the configure's)
    last = m.stats(sync=True)["last_step"]
    disk_quant = sum(stored_bytes(ref.blocks[i]) for i in m.tiers.disk_layers)
    assert 0 < last["bytes_read"] <= 1.15 * disk_quant, (last, disk_quant)
    assert 0 < last["bytes_copied"] <= 1.15 * quant, (last, quant)
    check_streamed_contract(model, kind, expect, sd_ref, n, spill=spill_dir)


# ------------------------------------------------ load_offloaded of a quantized checkpoint
def meta_quantized(kind, n=4):
    """A Stack built on the meta device and quantized as `kind` (the same way as make())."""
    with torch.device("meta"):
        model = Stack(n).to(torch.bfloat16).eval()
    return quantize(model, kind)


def save_quantized(model, kind, path):
    """The checkpoint as the library's own save writes it: torchao's safetensors layout
    (torchao.prototype.safetensors.flatten_tensor_state_dict: `<module>._<attr>_<inner>`
    tensors and a JSON form per wrapper in the metadata, as transformers' save_pretrained
    writes a torchao model), or quanto's state dict (`weight._data`, `weight._scale`, ...)."""
    from safetensors.torch import save_file

    sd = model.state_dict()
    if kind.startswith("ao-"):
        from torchao.prototype.safetensors.safetensors_support import flatten_tensor_state_dict

        tensors, metadata = flatten_tensor_state_dict(sd)
        save_file(tensors, path, metadata=metadata)
    else:
        save_file({k: v.contiguous() for k, v in sd.items()}, path)
    return path


LOAD_KINDS = ["ao-int8", "ao-fp8", "ao-int4", "quanto-qint8", "quanto-qfloat8"]


@pytest.mark.parametrize("kind", LOAD_KINDS)
@pytest.mark.parametrize("tier", ["memory", "checkpoint", "spill"])
def test_load_offloaded_of_a_quantized_checkpoint(tmp_path, kind, tier):
    """A quantized checkpoint (the library's own layout) loaded into a meta model quantized
    the same way: the leaves are read from the file into their places (the quantized head
    outside the group too); with host_budget, layers stream from the checkpoint as stored
    (or from spill files); bitwise, bytes per step the quantized bytes, state contract."""
    n = 6
    ref = make(kind, n=n)
    expect = run(ref, inputs())
    sd_ref = ref.state_dict()
    quant = stored_bytes(ref.blocks)
    ckpt = save_quantized(ref, kind, str(tmp_path / "model.safetensors"))
    spill = tmp_path / "spill"
    spill.mkdir()
    opts = dict(device="cpu", prefetch_depth=2, debug_copy_delay_us=100)
    if tier == "spill":
        opts["spill_dir"] = str(spill)

    def load(budget=None):
        model = meta_quantized(kind, n)
        layerwise.load_offloaded(model, ckpt, "blocks", host_budget=budget, **opts)
        return model

    model = load(None if tier == "memory" else host_budget_keeping(load, 2, quant // n))
    [m] = managers_of(model)
    if tier != "memory":
        assert 1 <= len(m.tiers.disk_layers) < n, m.stats()["tier_plan"]
        assert any(r.startswith(tier) for r in m.stats()["tier_plan"]), m.stats()["tier_plan"]
    assert m.plan.managed_bytes == quant
    for _ in range(3):
        for out, want in zip(run(model, inputs()), expect):
            assert torch.equal(out, want)
    assert_computes_from_slots(model)
    last = m.stats(sync=True)["last_step"]
    assert 0 < last["bytes_copied"] <= 1.15 * quant, (last, quant)
    if tier != "memory":
        disk_quant = sum(stored_bytes(ref.blocks[i]) for i in m.tiers.disk_layers)
        assert 0 < last["bytes_read"] <= 1.15 * disk_quant + 8192 * len(m.tiers.disk_layers), (last, disk_quant)
    assert_state_equal(model.state_dict(), sd_ref)
    if tier != "checkpoint":  # (layers read from the checkpoint as stored are read-only)
        other = make(kind, seed=1, n=n)
        model.load_state_dict(other.state_dict())
        for out, want in zip(run(model, inputs()), run(other, inputs())):
            assert torch.equal(out, want)
        model.load_state_dict(sd_ref)
    layerwise.remove_layerwise_offload(model)
    assert spill_files(str(spill)) == []
    assert_state_equal(model.state_dict(), sd_ref)
    for out, want in zip(run(model, inputs()), expect):
        assert torch.equal(out, want)


def _meta_fingerprint(model):
    return {n: (id(p), type(p), p.device, [(x.dtype, tuple(x.shape), x.device) for x in leaves(p)])
            for n, p in model.named_parameters()}


@pytest.mark.parametrize("ckpt_kind,model_kind,words", [
    ("ao-int8", "ao-fp8", r"'blocks\.0\.up\.weight' is a torchao\..*Float8Tensor.*Int8Tensor"),
    ("ao-int8", "quanto-qint8", r"'blocks\.0\.up\.weight' is a optimum\.quanto\..*WeightQBytesTensor"),
    ("quanto-qint4", "quanto-qint4", r"'blocks\.0\.up\.weight' is a optimum\.quanto\..*WeightQBitsTensor.*frozen on meta"),
    ("quanto-qfloat8", "quanto-qint8", r"'blocks\.0\.up\.weight' is a optimum\.quanto\..*float8_e4m3fn.*torch\.int8"),
    ("plain", "ao-int8", r"'blocks\.0\.up\.weight' is a torchao\..*Int8Tensor.*plain torch\.bfloat16"),
])
def test_a_quantized_checkpoint_that_cannot_be_loaded_exactly_is_refused(tmp_path, ckpt_kind, model_kind, words):
    """A checkpoint whose quantized tensors do not have the model's form (another config,
    another library, a plain checkpoint, or a layout the library saves derived tensors in):
    a ValueError naming the parameter, its library type, the format and what to do,
    before the model changes."""
    if ckpt_kind == "plain":
        from safetensors.torch import save_file

        torch.manual_seed(0)
        ckpt = str(tmp_path / "plain.safetensors")
        save_file(Stack(2).to(torch.bfloat16).state_dict(), ckpt)
    else:
        ckpt = save_quantized(make(ckpt_kind, n=2), ckpt_kind, str(tmp_path / "q.safetensors"))
    model = meta_quantized(model_kind, 2)
    fp = _meta_fingerprint(model)
    with pytest.raises(ValueError, match=words + r".*The model is unchanged"):
        layerwise.load_offloaded(model, ckpt, "blocks", device="cpu", strict=False)
    assert _meta_fingerprint(model) == fp
    assert not managers_of(model)


@pytest.mark.parametrize("kind", ["ao-int8", "quanto-qint8"])
def test_a_failed_quantized_load_gives_the_meta_model_back(tmp_path, monkeypatch, kind):
    """A read that fails at any tensor of load_offloaded (layer leaves and the quantized
    head alike) leaves the meta model as it was: its wrappers over their meta leaves."""
    from layerwise.formats import safetensors as sft

    ckpt = save_quantized(make(kind, n=2), kind, str(tmp_path / "q.safetensors"))
    orig = sft.read_into
    calls, fail_at = [0], [0]

    def failing(*a, **kw):
        calls[0] += 1
        if calls[0] == fail_at[0]:
            raise OSError(f"injected at {fail_at[0] - 1}")
        return orig(*a, **kw)

    monkeypatch.setattr(sft, "read_into", failing)
    probe = meta_quantized(kind, 2)
    layerwise.load_offloaded(probe, ckpt, "blocks", device="cpu", prefetch_depth=0)
    total = calls[0]
    layerwise.remove_layerwise_offload(probe)
    assert total >= 10
    for k in range(total):
        model = meta_quantized(kind, 2)
        fp = _meta_fingerprint(model)
        calls[0], fail_at[0] = 0, k + 1
        with pytest.raises(OSError, match=f"injected at {k}$"):
            layerwise.load_offloaded(model, ckpt, "blocks", device="cpu", prefetch_depth=0)
        assert _meta_fingerprint(model) == fp, k
        assert not managers_of(model)


def test_load_offloaded_refuses_a_dtype_that_would_cast_a_quantized_wrapper(tmp_path):
    ckpt = save_quantized(make("ao-int8", n=2), "ao-int8", str(tmp_path / "q.safetensors"))
    model = meta_quantized("ao-int8", 2)
    fp = _meta_fingerprint(model)
    with pytest.raises(ValueError, match=r"dtype=torch\.float16 would cast parameter 'blocks\.0\.up\.weight', a "
                                         r"torchao\..*Int8Tensor.*The model is unchanged"):
        layerwise.load_offloaded(model, ckpt, "blocks", device="cpu", dtype=torch.float16)
    assert _meta_fingerprint(model) == fp


# ------------------------------------------------ offload_pipeline with a quantized transformer
@pytest.mark.parametrize("kind", ["ao-int8", "ao-fp8"])
def test_offload_pipeline_with_a_torchao_quantized_transformer(kind):
    """A tiny Flux pipeline in bf16 whose transformer is torchao-quantized (its block
    lists and the linears outside them): the image is bitwise the resident pipeline's,
    the transformer's groups copy their quantized bytes per step, its state_dict is
    the resident one's; remove gives the quantized pipeline back."""
    pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    import dataclasses

    from layerwise.bench.pipeline import SIZES, generate, tiny_flux_pipeline

    size = dataclasses.replace(SIZES["tiny"], double=4, single=6)  # more layers than 2 slots: re-copied each step

    def build():
        pipe = tiny_flux_pipeline(size, dtype=torch.bfloat16)
        quantize(pipe.transformer, kind)
        return pipe

    ref = build()
    assert quantized_mod.is_wrapper(ref.transformer.transformer_blocks[0].attn.to_q.weight)
    image = generate(ref, size)
    sd_ref = ref.transformer.state_dict()
    pipe = build()
    managers = layerwise.offload_pipeline(pipe, device="cpu")
    groups = managers["transformer"]
    assert [m.layer_name for m in groups] == ["transformer_blocks", "single_transformer_blocks"]
    for _ in range(2):
        assert torch.equal(generate(pipe, size), image)
    assert_computes_from_slots(pipe.transformer)
    for m in groups:
        quant = m.plan.managed_bytes
        assert quant == stored_bytes(ref.transformer.get_submodule(m.layer_name)), m.layer_name
        copied = m.stats()["last_step"]["bytes_copied"]
        # every layer once per step, as its block: the quantized bytes and the alignment gaps between
        # leaves (layerwise.planning.layout.PARAM_ALIGN; at width 32 the gaps are 15% of the layers' bytes)
        assert copied == sum(lp.nbytes for lp in m.plan.layers), (m.layer_name, copied, quant)
        entries = sum(len(lp.params) for lp in m.plan.layers)
        assert quant < copied <= quant + 256 * entries, (m.layer_name, copied, quant)
    assert_state_equal(pipe.transformer.state_dict(), sd_ref)
    layerwise.remove_pipeline_offload(pipe)
    assert_state_equal(pipe.transformer.state_dict(), sd_ref)
    assert torch.equal(generate(pipe, size), image)


# ------------------------------------------------- backward and torch.compile
@pytest.mark.parametrize("kind", KINDS)
def test_backward_through_streamed_quantized_layers_is_exact(kind):
    """Input gradients through the streamed layers equal the resident model's. Found:
    quanto's autograd function saves the weight wrapper itself for backward, whose
    leaves are views of a ring slot that a later layer has refilled by then: the
    gradients were computed from another layer's bytes (max |diff| 1.6), silently."""
    ref, model = make(kind, n=6), make(kind, n=6)
    layerwise.configure_layerwise_offload(model, "blocks", device="cpu", prefetch_depth=1, debug_copy_delay_us=100)
    for x in inputs(2):
        grads = []
        for m in (ref, model):
            leaf = x.clone().requires_grad_(True)
            m(leaf).float().square().sum().backward()
            grads.append(leaf.grad)
        assert torch.equal(*grads), kind
    layerwise.remove_layerwise_offload(model)


@pytest.mark.parametrize("kind", ["ao-int8", "quanto-qint4"])
def test_torch_compile_of_a_streamed_quantized_model_is_exact(kind):
    ref, model = make(kind, n=6), make(kind, n=6)
    layerwise.configure_layerwise_offload(model, "blocks", device="cpu", prefetch_depth=1)
    compiled = torch.compile(model, backend="eager")
    with torch.no_grad():
        for x in inputs(3):
            assert torch.equal(compiled(x), ref(x))
    assert_computes_from_slots(model)


# ------------------------------------------------------------- README recipes
def test_readme_quantized_recipes_run_as_written(tmp_path, monkeypatch):
    """The recipes of docs/quantized.md, run as written (device "cuda" -> "cpu",
    the hub path -> a tiny Flux saved by save_pretrained, in a temporary directory):
    quantize then configure, and load_offloaded of the torchao safetensors checkpoint
    into an empty model quantized the same way; both bitwise equal to the quantized
    model resident."""
    import pathlib

    pytest.importorskip("torchao")
    diffusers = pytest.importorskip("diffusers")
    from torchao.quantization import Float8WeightOnlyConfig, quantize_

    text = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "quantized.md").read_text()
    recipes = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(recipes) == 2, recipes
    torch.manual_seed(0)
    config = dict(patch_size=1, in_channels=8, num_layers=3, num_single_layers=4, attention_head_dim=32,
                  num_attention_heads=2, joint_attention_dim=64, pooled_projection_dim=8, axes_dims_rope=[8, 12, 12])
    tiny = diffusers.FluxTransformer2DModel(**config).to(torch.bfloat16).eval()
    tiny.save_pretrained(tmp_path / "transformer")
    reference = diffusers.FluxTransformer2DModel.from_pretrained(tmp_path, subfolder="transformer",
                                                                 torch_dtype=torch.bfloat16)
    quantize_(reference, Float8WeightOnlyConfig())
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    for code in recipes:
        code = code.replace('"cuda"', '"cpu"').replace('"black-forest-labs/FLUX.1-dev"', repr(str(tmp_path)))
        exec(compile(code, "README.md", "exec"), scope)

    g = torch.Generator().manual_seed(3)
    kw = dict(hidden_states=torch.randn(1, 16, 8, generator=g).to(torch.bfloat16),
              encoder_hidden_states=torch.randn(1, 6, 64, generator=g).to(torch.bfloat16),
              pooled_projections=torch.randn(1, 8, generator=g).to(torch.bfloat16),
              timestep=torch.rand(1, generator=g).to(torch.bfloat16),
              img_ids=torch.randint(0, 8, (16, 3), generator=g).float(), txt_ids=torch.zeros(6, 3), return_dict=False)
    with torch.no_grad():
        want = reference(**kw)[0]
        for name in ("model", "empty"):
            model = scope[name]
            assert managers_of(model), name
            assert_computes_from_slots(model)
            assert torch.equal(model(**kw)[0], want), name
            assert torch.equal(model(**kw)[0], want), name
