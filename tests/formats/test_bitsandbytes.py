"""bitsandbytes (CPU backend) streams exactly, and derived copies are caught, never
trusted (layerwise/contract/rebinds.py, layerwise/formats/aliases.py): each test against the
resident quantized model with the same history of calls, bitwise.

bitsandbytes computes an int8 layer from `state.CB` (an alias of `weight`), repacks
an nf4 weight for an avx512-bf16 CPU on its first eval forward (rebinding
`weight.data`), unpacks it again in `_save_to_state_dict` (rebinding it once more)
and casts an fp32 bias to the input's dtype (`bias.data = ...`). Before this, the
int8 layers and repacked nf4 layers computed from resident memory, and a
state_dict() of a repacked model took other layers' bytes from shared slots."""
import logging
import re

import pytest
import torch
from torch import nn

import layerwise
from layerwise.configure import managers_of
from layerwise.contract import rebinds as drift_mod

from helpers.bnb import D, assert_computes_from_slots, assert_state_equal, inputs, make, run, same

bnb = pytest.importorskip("bitsandbytes")


def quantized_bytes(module):
    """What the quantized layers hold: their parameters (as the resident model has
    them after its forwards) and the side tensors beside them (absmax, SCB, ...)."""
    from layerwise.formats import aliases

    total = sum(p.numel() * p.element_size() for p in module.parameters())
    seen = set()
    for mod in module.modules():
        for p in mod._parameters.values():
            if p is not None and type(p) is not nn.Parameter:
                for t in aliases.side_tensors(p, mod):  # (not an alias of the weight: state.CB)
                    if t.data_ptr() not in seen and t.data_ptr() != p.data_ptr():
                        seen.add(t.data_ptr())
                        total += t.numel() * t.element_size()
    return total


MODES = [("int8", False), ("int8", True), ("nf4", False), ("nf4", True)]


@pytest.mark.parametrize("kind,train", MODES, ids=[f"{k}-{'train' if t else 'eval'}" for k, t in MODES])
@pytest.mark.parametrize("when", ["before_forward", "after_forward"])
def test_streams_bitwise_from_its_slots(kind, train, when):
    ref = make(kind, train=train)
    model = make(kind, train=train)
    if when == "after_forward":
        run(ref), run(model)
    expect = [run(ref) for _ in range(3)]
    [m] = layerwise.configure_layerwise_offload(model, "blocks", device="cpu", prefetch_depth=1)
    for want in expect:
        assert same(run(model), want)
    assert_computes_from_slots(model)
    quant = quantized_bytes(ref.blocks)
    copied = m.stats()["last_step"]["bytes_copied"]
    assert 0 < copied <= 1.15 * quant, (copied, quant)
    # The silent error: nf4 in eval, repacked: _save_to_state_dict unpacked
    # whichever layer last used each slot, and the model computed from that ever after.
    assert_state_equal(model.state_dict(), ref.state_dict())
    expect = run(ref)
    assert same(run(model), expect)
    assert_computes_from_slots(model)
    assert_state_equal(model.state_dict(), ref.state_dict())

    layerwise.remove_layerwise_offload(model)
    assert not managers_of(model)
    assert same(run(model), run(ref))
    assert_state_equal(model.state_dict(), ref.state_dict())
    assert type(model.blocks[0].up.weight) is type(ref.blocks[0].up.weight)
    if kind == "int8":  # bitsandbytes' alias is a plain tensor again, as in the resident model
        st = model.blocks[0].up.state
        assert type(st.CB) is torch.Tensor and st.CB.data_ptr() == model.blocks[0].up.weight.data_ptr()


TIERS = ["compress", "disk", "compress+disk"]
TIER_KINDS = [("nf4", torch.float32), ("nf4", torch.bfloat16), ("int8", None)]


def tier_options(model, tier, spill_dir) -> dict:
    opts = {"compress": "lossless"} if "compress" in tier else {}
    if "disk" in tier:  # the least host_budget the planner takes: every streamed layer in the spill file
        with pytest.raises(ValueError, match=r"even with every streamed layer on disk") as err:
            layerwise.configure_layerwise_offload(model, "blocks", device="cpu", host_budget=1,
                                                  spill_dir=spill_dir, **opts)
        assert not managers_of(model)
        opts.update(host_budget=int(re.search(r"\((\d+) bytes", str(err.value)).group(1)), spill_dir=spill_dir)
    return opts


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("kind,compute", TIER_KINDS, ids=["nf4-fp32", "nf4-bf16", "int8"])
@pytest.mark.parametrize("when", ["before_forward", "after_forward"])
def test_composes_with_compress_and_the_disk_tier(kind, compute, when, tier, tmp_path):
    """What a library's forward or save rebinds (nf4's CPU repack and its inverse, a
    bias cast to bf16 in its fp32 place) becomes the layer's true bytes whatever holds
    them: an encoded block, a spill file, or both; exact against the resident model
    with the same calls, configured before or after the first forward."""
    ref = make(kind, compute=compute, mix=True)
    model = make(kind, compute=compute, mix=True)
    if when == "after_forward":
        run(ref), run(model)
    [m] = layerwise.configure_layerwise_offload(model, "blocks", device="cpu", **tier_options(model, tier, tmp_path))
    s = m.stats()
    if "compress" in tier:  # every streamed layer travels encoded: its bf16 weights shrink
        assert s["compress"]["layers"] == len(m.ring.streamed) and not s["compress"]["layers_raw"]
    if "disk" in tier:
        assert s["disk"]["layers"] == len(m.ring.streamed)
    for _ in range(3):
        assert same(run(model), run(ref))
    assert_computes_from_slots(model)
    assert_state_equal(model.state_dict(), ref.state_dict())
    assert same(run(model), run(ref))
    assert_computes_from_slots(model)

    # load_state_dict(state_dict()) round trips as it does in the resident model
    sd_ref, sd = ref.state_dict(), model.state_dict()
    assert_state_equal(sd, sd_ref)
    try:
        want = ref.load_state_dict(sd_ref, strict=False)
    except RuntimeError as err:  # int8 after a forward: bitsandbytes refuses (its SCB moved to its state)
        with pytest.raises(RuntimeError, match=re.escape(str(err).splitlines()[0][:60])):
            model.load_state_dict(sd, strict=False)
    else:
        got = model.load_state_dict(sd, strict=False)
        assert (sorted(got.missing_keys), sorted(got.unexpected_keys)) == (sorted(want.missing_keys),
                                                                           sorted(want.unexpected_keys))
    assert same(run(model), run(ref))
    assert_computes_from_slots(model)
    assert_state_equal(model.state_dict(), ref.state_dict())

    layerwise.remove_layerwise_offload(model)
    assert same(run(model), run(ref))
    assert_state_equal(model.state_dict(), ref.state_dict())


def llama_nf4(compute, bias=False):
    """A tiny LlamaForCausalLM whose attention and MLP projections are all nf4
    Linear4bit (fp32 weights quantized by .to("cpu")), in eval."""
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         attention_bias=bias, mlp_bias=bias)
    model = LlamaForCausalLM(config).eval()
    sd = model.state_dict()
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, lin in list(parent.named_children()):
                if isinstance(lin, nn.Linear):
                    setattr(parent, name, bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=bias,
                                                            quant_type="nf4", compute_dtype=compute))
    model.load_state_dict(sd)
    return model.to("cpu").eval()


@pytest.mark.parametrize("tier", ["arena", "compress", "disk"])
@pytest.mark.parametrize("compute,bias", [(torch.float32, False), (torch.bfloat16, True)], ids=["fp32", "bf16-bias"])
@pytest.mark.parametrize("when", ["before_forward", "after_forward"])
def test_llama_nf4_state_dict_then_forward_matches_resident(when, compute, bias, tier, tmp_path):
    """nf4 in a transformers Llama: state_dict() of the whole model runs each
    Linear4bit's own save (which unpacks the CPU layout and rebinds weight.data)
    outside its layer's forward, over its true bytes, and what it rebinds becomes
    them. The resident reference makes the same calls: bitsandbytes' unpacking
    re-quantizes the nested absmax statistics, so a resident Llama's forward after
    its own state_dict() is not the one before it (a plain stack's statistics
    happen to come back exact)."""
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(3))

    def logits(m):
        with torch.no_grad():
            return m(ids).logits

    ref, model = llama_nf4(compute, bias), llama_nf4(compute, bias)
    if when == "after_forward":
        assert torch.equal(logits(model), logits(ref))
    opts = {"compress": "lossless"} if tier == "compress" else {}
    if tier == "disk":  # the least host_budget the planner takes: every streamed layer in the spill file
        with pytest.raises(ValueError, match=r"even with every streamed layer on disk") as err:
            layerwise.configure_layerwise_offload(model, "model.layers", device="cpu", host_budget=1,
                                                  spill_dir=tmp_path)
        opts = {"host_budget": int(re.search(r"\((\d+) bytes", str(err.value)).group(1)), "spill_dir": tmp_path}
    [m] = layerwise.configure_layerwise_offload(model, "model.layers", device="cpu", **opts)
    if tier == "disk":
        assert m.stats()["disk"]["layers"] == len(m.ring.streamed)
    assert torch.equal(logits(model), logits(ref))
    for _ in range(2):
        sd, sd_ref = model.state_dict(), ref.state_dict()
        assert_state_equal(sd, sd_ref)
        q = model.model.layers[1].mlp.up_proj.weight  # unpacked by the save, as the resident one is
        assert q.shape == ref.model.layers[1].mlp.up_proj.weight.shape and q.shape[1] == 1
        assert torch.equal(logits(model), logits(ref))
        assert_computes_from_slots(model)

    want = ref.load_state_dict(ref.state_dict(), strict=False)
    got = model.load_state_dict(model.state_dict(), strict=False)
    assert (sorted(got.missing_keys), sorted(got.unexpected_keys)) == (sorted(want.missing_keys),
                                                                       sorted(want.unexpected_keys))
    assert torch.equal(logits(model), logits(ref))
    assert_computes_from_slots(model)
    layerwise.remove_layerwise_offload(model)
    assert torch.equal(logits(model), logits(ref))
    assert_state_equal(model.state_dict(), ref.state_dict())
    assert torch.equal(logits(model), logits(ref))


def test_side_tensors_stay_resident_and_are_counted():
    model = make("nf4", n=3)
    [m] = layerwise.configure_layerwise_offload(model, "blocks", device="cpu")
    run(model)
    side = m.stats()["side_tensor_bytes"]
    qs = model.blocks[0].up.weight.quant_state
    assert side >= 6 * qs.absmax.numel() * qs.absmax.element_size()
    rep = layerwise.report(model)
    assert rep["groups"][0]["side_tensor_bytes"] == side
    assert "side tensors of streamed parameters" in str(rep)


def test_load_state_dict_round_trip():
    # int8: loadable before a forward (the resident bitsandbytes refuses after one: its SCB moved to state)
    other = make("int8", seed=1)
    sd_other = other.state_dict()
    expect = run(other)
    model = make("int8")
    layerwise.configure_layerwise_offload(model, "blocks", device="cpu")
    result = model.load_state_dict(sd_other)
    assert not result.missing_keys and not result.unexpected_keys
    assert same(run(model), expect)
    assert_computes_from_slots(model)
    assert_state_equal(model.state_dict(), other.state_dict())
    layerwise.remove_layerwise_offload(model)
    assert same(run(model), run(other))

    # nf4, repacked: its own state dict back (bitsandbytes loads the weight, not the quant_state keys)
    ref, model = make("nf4"), make("nf4")
    run(ref), run(model)
    layerwise.configure_layerwise_offload(model, "blocks", device="cpu")
    run(model)
    run(ref)
    sd_ref, sd = ref.state_dict(), model.state_dict()
    assert_state_equal(sd, sd_ref)
    want = ref.load_state_dict(sd_ref, strict=False)
    got = model.load_state_dict(sd, strict=False)
    assert (sorted(got.missing_keys), sorted(got.unexpected_keys)) == (sorted(want.missing_keys),
                                                                       sorted(want.unexpected_keys))
    assert same(run(model), run(ref))
    assert_computes_from_slots(model)
    layerwise.remove_layerwise_offload(model)
    assert same(run(model), run(ref))


# ------------------------------------------------ the detection is general
class Rebinding(nn.Module):
    """A toy library: its forward rebinds weight.data to a derived copy."""

    def __init__(self, derive):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(D, D) / 16)
        self.derive = derive

    def forward(self, x):
        y = x @ self.weight.t()
        self.weight.data = self.derive(self.weight.data)
        return y


class Toys(nn.Module):
    def __init__(self, derive, n=4):
        super().__init__()
        torch.manual_seed(5)
        self.blocks = nn.ModuleList([Rebinding(derive) for _ in range(n)])

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return x


def _xs():
    return [x.float() for x in inputs()]


@pytest.mark.parametrize("derive", [lambda w: w.clone(), lambda w: w * 0.5, lambda w: w.t().contiguous().t()],
                         ids=["copy", "scaled copy", "transposed layout"])
def test_a_module_that_rebinds_its_weight_to_a_copy_is_adopted(derive, caplog):
    ref, model = Toys(derive), Toys(derive)
    layerwise.configure_layerwise_offload(model, "blocks", device="cpu", prefetch_depth=1)
    with caplog.at_level(logging.INFO, logger="layerwise"):
        for _ in range(3):
            assert same(run(model, _xs()), run(ref, _xs()))
    assert "blocks.0.weight" in caplog.text and "stream from now on" in caplog.text
    assert_computes_from_slots(model)
    assert_state_equal(model.state_dict(), ref.state_dict())
    layerwise.remove_layerwise_offload(model)
    assert same(run(model, _xs()), run(ref, _xs()))


class SaveRebinding(nn.Module):
    """A toy library whose own save rebinds weight.data to a value derived from it
    (as bitsandbytes' nf4 unpacks its CPU layout), which it computes from ever after."""

    def __init__(self, derive):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(D, D) / 16)
        self.derive = derive

    def forward(self, x):
        return x @ self.weight.t().to(x.dtype)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        self.weight.data = self.derive(self.weight.data)
        super()._save_to_state_dict(destination, prefix, keep_vars)


class SaveToys(Toys):
    def __init__(self, derive, n=4):
        nn.Module.__init__(self)
        torch.manual_seed(5)
        self.blocks = nn.ModuleList([SaveRebinding(derive) for _ in range(n)])


@pytest.mark.parametrize("tier", TIERS[:2] + ["arena"])
@pytest.mark.parametrize("derive", [lambda w: w * 0.5, lambda w: w.t().contiguous().t(), lambda w: w.bfloat16()],
                         ids=["scaled copy", "transposed layout", "narrower dtype"])
def test_a_save_that_rebinds_is_adopted_from_the_true_bytes_of_every_layer(derive, tier, tmp_path):
    """state_dict() on the root model runs each module's own save outside its
    layer's forward, while its slot holds another layer's bytes: the save reads
    and rebinds over the layer's true bytes (arena, encoded block or spill file),
    and what it made becomes them."""
    ref, model = SaveToys(derive), SaveToys(derive)
    [m] = layerwise.configure_layerwise_offload(model, "blocks", device="cpu", prefetch_depth=1,
                                                **tier_options(model, tier, tmp_path))
    assert len(m.ring.slots) < len(m.ring.streamed)  # the slots are shared
    if "compress" in tier:
        assert not m.stats()["compress"]["layers_raw"]
    for _ in range(2):
        assert same(run(model, _xs()), run(ref, _xs()))
        assert_state_equal(model.state_dict(), ref.state_dict())
        assert same(run(model, _xs()), run(ref, _xs()))
        assert_computes_from_slots(model)
    model.load_state_dict(model.state_dict())
    ref.load_state_dict(ref.state_dict())
    assert same(run(model, _xs()), run(ref, _xs()))
    layerwise.remove_layerwise_offload(model)
    assert same(run(model, _xs()), run(ref, _xs()))
    assert_state_equal(model.state_dict(), ref.state_dict())


@pytest.mark.parametrize("derive,match", [(lambda w: w.double(), r"narrower dtype .*not a wider"),
                                          (lambda w: w[D // 2:].clone(), r"number of elements")],
                         ids=["wider dtype", "another size"])
def test_a_rebind_that_cannot_stream_is_refused_naming_module_and_library(derive, match):
    model = Toys(derive)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    layerwise.configure_layerwise_offload(model, "blocks", device="cpu")
    with pytest.raises(RuntimeError, match=rf"blocks\.0\.weight \(.*Rebinding, library 'test_bitsandbytes'\) .*"
                                           rf"{match}.*bound to its true bytes again, unchanged\. .*Rebinding"):
        run(model, _xs())
    assert_computes_from_slots(model)  # never silently resident
    assert_state_equal(model.state_dict(), sd)
    layerwise.remove_layerwise_offload(model)
    assert_state_equal(model.state_dict(), sd)


class PackingOnce(nn.Module):
    """A toy library that keeps state describing its weight's layout, as bitsandbytes'
    quant_state does: its first forward repacks weight.data (rows reversed), and it
    computes from the packed layout ever after."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(D, D) / 16)
        self.packed = False

    def forward(self, x):
        if not self.packed:
            self.weight.data, self.packed = self.weight.data.flip(0), True
        return x @ self.weight.flip(0).t()


class PackingToys(Toys):
    def __init__(self, n=4):
        nn.Module.__init__(self)
        torch.manual_seed(5)
        self.blocks = nn.ModuleList([PackingOnce() for _ in range(n)])


@pytest.mark.parametrize("kind", ["toy", "nf4-bf16"])
def test_a_rebind_into_a_checkpoint_layer_is_held_refused_until_removal_then_exact(kind, tmp_path):
    """A layer streamed from a checkpoint file layerwise does not write cannot take
    what its library rebound; bound back to its old bytes, a library that recorded the
    change (PackingOnce, bitsandbytes' quant_state) would compute garbage from its next
    call on. So the layer refuses every later call, and removal gives each such
    parameter the data its library made: exact against the resident model again."""
    from safetensors.torch import save_file

    build = PackingToys if kind == "toy" else (lambda: make("nf4", mix=False))
    xs = _xs() if kind == "toy" else inputs()
    ref, model = build(), build()
    ckpt = str(tmp_path / "model.safetensors")
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, ckpt)
    opts = {"device": "cpu", "strict": False}
    with pytest.raises(ValueError, match=r"even with every streamed layer on disk") as err:
        layerwise.load_offloaded(model, ckpt, "blocks", host_budget=1, **opts)
    least = int(re.search(r"\((\d+) bytes", str(err.value)).group(1))
    [m] = layerwise.load_offloaded(model, ckpt, "blocks", host_budget=least, **opts)
    assert m.stats()["disk"]["layers"] == len(m.ring.streamed) and not m.stats()["disk"]["spill"]
    expect = run(ref, xs)
    with pytest.raises(RuntimeError, match=r"blocks\.0\..* does not write\. The parameter is bound to its true "
                                           r"bytes again, unchanged, and its layer refuses every call from now on.*"
                                           r"remove_layerwise_offload.*spill_dir="):
        run(model, xs)
    assert_computes_from_slots(model)
    for call in (lambda: run(model, xs), model.state_dict):  # never silently: PackingOnce would not repack again
        with pytest.raises(RuntimeError, match=r"layer 0 of group 'blocks' refuses .*, as since an earlier call: "
                                               r"blocks\.0\."):
            call()
    layerwise.remove_layerwise_offload(model)
    assert not managers_of(model)
    assert same(run(model, xs), expect)
    assert same(run(model, xs), run(ref, xs))
    assert_state_equal(model.state_dict(), ref.state_dict())


def test_the_rebinds_layerwise_does_itself_never_fire_it(monkeypatch):
    from helpers.quantized import Stack as Plain

    fired = []
    monkeypatch.setattr(drift_mod, "settle", lambda *a: fired.append(a))
    torch.manual_seed(0)
    model = Plain(n=4).to(torch.bfloat16)
    other = Plain(n=4).to(torch.bfloat16)
    layerwise.configure_layerwise_offload(model, "blocks", device="cpu", prefetch_depth=2)
    xs = inputs()
    run(model, xs)
    sd = model.state_dict(keep_vars=True)
    model.load_state_dict(other.state_dict())
    run(model, xs)
    with torch.no_grad():
        model.blocks[1].up.weight.data = model.blocks[1].up.weight.data  # a rebind to the same view
    run(model, xs)
    assert same(run(model, xs), run(other, xs))
    assert sd and not fired


class WideRebinding(nn.Module):
    """Many parameters before the one its first forward rebinds (a repack, once): the
    post-hook checks a chunk of them per call (drift.Bound.PER_HOOK), in turn."""

    def __init__(self, derive, extra=40):
        super().__init__()
        self.extra = nn.ParameterList([nn.Parameter(torch.zeros(4)) for _ in range(extra)])
        self.weight = nn.Parameter(torch.randn(D, D) / 16)
        self.derive, self.repacked = derive, False

    def forward(self, x):
        y = x @ self.weight.t() + sum(p.sum() for p in self.extra)
        if not self.repacked:
            self.weight.data, self.repacked = self.derive(self.weight.data), True
        return y


def test_a_rebind_past_the_first_chunk_of_a_wide_layer_is_seen_within_a_round(caplog):
    from layerwise.contract.rebinds import Bound

    torch.manual_seed(5)
    ref = nn.ModuleList([WideRebinding(lambda w: w * 0.5) for _ in range(4)])
    torch.manual_seed(5)
    model = nn.Module()
    model.blocks = nn.ModuleList([WideRebinding(lambda w: w * 0.5) for _ in range(4)])
    n = len(list(model.blocks[0].parameters()))
    assert n > 2 * Bound.PER_HOOK
    layerwise.configure_layerwise_offload(model, "blocks", device="cpu", prefetch_depth=1)
    rounds = -(-n // Bound.PER_HOOK)
    x = _xs()[0]
    with caplog.at_level(logging.INFO, logger="layerwise"):
        for _ in range(rounds):
            h, r = x, x
            for b, rb in zip(model.blocks, ref):
                h, r = h + b(h), r + rb(r)
            assert same([h], [r])  # exact meanwhile: the library computes from its own copy
    assert caplog.text.count("stream from now on") == 4, caplog.text  # every layer's rebind seen
    assert_computes_from_slots(model)
    assert_state_equal(model.state_dict(), nn.Module.state_dict(nn.Sequential(*ref), prefix="blocks."))
