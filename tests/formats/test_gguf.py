"""Quantized models whose parameters are plain tensors: a tiny Flux loaded
by diffusers from a real GGUF file (`GGUFParameter`: uint8 blocks of Q8_0 / Q4_0
with a `quant_type`, dequantized in each forward), and plain fp8 weights with a
bf16 scale. Each streams its quantized bytes, bitwise against the same model
resident, with the state contract."""
import copy

import pytest
import torch
from torch import nn

import layerwise
from layerwise.configure import managers_of
from layerwise.planning.layout import param_bytes

gguf = pytest.importorskip("gguf")
diffusers = pytest.importorskip("diffusers")

GROUPS = ["transformer_blocks", "single_transformer_blocks"]
CONFIG = dict(patch_size=1, in_channels=8, num_layers=3, num_single_layers=5, attention_head_dim=16,
              num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=8, axes_dims_rope=[4, 6, 6])


def flux_inputs(seed, tokens=16, text=6):
    g = torch.Generator().manual_seed(seed)
    bf = torch.bfloat16
    return dict(hidden_states=torch.randn(1, tokens, 8, generator=g).to(bf),
                encoder_hidden_states=torch.randn(1, text, 32, generator=g).to(bf),
                pooled_projections=torch.randn(1, 8, generator=g).to(bf), timestep=torch.rand(1, generator=g).to(bf),
                img_ids=torch.randint(0, 8, (tokens, 3), generator=g).float(), txt_ids=torch.zeros(text, 3),
                return_dict=False)


@pytest.fixture(scope="module", params=["Q8_0", "Q4_0"])
def gguf_file(request, tmp_path_factory):
    """A tiny Flux written as a GGUF file (diffusers' key names), its block weights
    quantized to `request.param`, the rest fp32; and the config directory."""
    import numpy as np

    qtype = getattr(gguf.GGMLQuantizationType, request.param)
    out = tmp_path_factory.mktemp(f"gguf-{request.param}")
    torch.manual_seed(0)
    model = diffusers.FluxTransformer2DModel(**CONFIG).to(torch.bfloat16)
    model.save_pretrained(out / "config")
    writer = gguf.GGUFWriter(str(out / "tiny.gguf"), "flux")
    for key, v in model.state_dict().items():
        a = v.float().numpy()
        if v.dim() == 2 and v.shape[1] % 32 == 0 and "blocks" in key:
            writer.add_tensor(key, gguf.quantize(a, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(key, a.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out / "tiny.gguf", out / "config", request.param


def load_gguf(path, config):
    from diffusers import GGUFQuantizationConfig

    return diffusers.FluxTransformer2DModel.from_single_file(
        str(path), quantization_config=GGUFQuantizationConfig(compute_dtype=torch.bfloat16), config=str(config),
        torch_dtype=torch.bfloat16)


def assert_computes_from_slots(model):
    """Every streamed parameter still points into its group's ring slots (a library that
    rebound .data to a copy of its own would compute from resident memory)."""
    n = 0
    for m in managers_of(model):
        for i in m.ring.streamed:
            for e in m.plan.layers[i].params:
                assert e.param.untyped_storage().data_ptr() in m.ring.ptrs, e.qualname
                n += 1
    assert n > 0


def quantized_bytes(model, groups):
    return sum(param_bytes(p) for g in groups for p in model.get_submodule(g).parameters())


def test_a_flux_from_a_gguf_file_streams_its_quantized_bytes_exactly(gguf_file):
    from diffusers.quantizers.gguf.utils import GGUFParameter

    path, config, qtype = gguf_file
    reference, model = load_gguf(path, config), load_gguf(path, config)
    ggufs = {n for n, p in model.named_parameters() if isinstance(p, GGUFParameter)}
    assert len(ggufs) >= 30 and all(model.get_parameter(n).dtype == torch.uint8 for n in ggufs)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    managers = layerwise.configure_layerwise_offload(model, GROUPS, device="cpu", prefetch_depth=1,
                                                     resident_layers=1, debug_copy_delay_us=200)
    # still GGUF parameters, with their quant type: the forward dequantizes the streamed blocks
    assert all(isinstance(model.get_parameter(n), GGUFParameter) for n in ggufs)
    assert {model.get_parameter(n).quant_type for n in ggufs} == {getattr(gguf.GGMLQuantizationType, qtype)}
    with torch.no_grad():
        for seed in (0, 1, 0, 2):
            assert torch.equal(model(**flux_inputs(seed))[0], reference(**flux_inputs(seed))[0]), seed
    assert_computes_from_slots(model)
    copied = sum(m.stats(sync=True)["last_step"]["bytes_copied"] for m in managers)
    streamed = sum(m.stats()["managed_bytes"] - m.stats()["resident_bytes"] for m in managers)
    assert 0 < copied <= 1.15 * streamed, (copied, streamed)
    raw_bf16 = sum(p.numel() * 2 for g in GROUPS for n, p in reference.get_submodule(g).named_parameters()
                   if f"{g}.{n}" in ggufs)
    assert quantized_bytes(model, GROUPS) < raw_bf16  # (Q8_0: 34 bytes per 32 values, Q4_0: 18)
    sd = model.state_dict()
    assert sd.keys() == before.keys() and all(torch.equal(sd[k], v) for k, v in before.items())
    model.load_state_dict(before)
    with torch.no_grad():
        assert torch.equal(model(**flux_inputs(3))[0], reference(**flux_inputs(3))[0])
    layerwise.remove_layerwise_offload(model)
    assert all(isinstance(model.get_parameter(n), GGUFParameter) for n in ggufs)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    with torch.no_grad():
        assert torch.equal(model(**flux_inputs(4))[0], reference(**flux_inputs(4))[0])


class Fp8Linear(nn.Module):
    """An fp8 weight with a bf16 per-row scale, dequantized in the forward."""

    def __init__(self, d_in, d_out, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        w = torch.randn(d_out, d_in, generator=g) * 0.05
        scale = w.abs().amax(dim=1, keepdim=True) / 448
        self.weight = nn.Parameter((w / scale).to(torch.float8_e4m3fn), requires_grad=False)
        self.scale = nn.Parameter(scale.to(torch.bfloat16), requires_grad=False)

    def forward(self, x):
        return x @ (self.weight.to(torch.bfloat16) * self.scale).t()


class Fp8Stack(nn.Module):
    def __init__(self, d=128, n=6):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(Fp8Linear(d, 2 * d, i), nn.GELU(), Fp8Linear(2 * d, d, 100 + i))
                                     for i in range(n)])

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return x


@pytest.mark.parametrize("compress", [None, "lossless"])
def test_fp8_weights_with_scales_stream_as_fp8(compress):
    reference, model = Fp8Stack(), Fp8Stack()
    before = copy.deepcopy(model.state_dict())
    (m,) = layerwise.configure_layerwise_offload(model, "blocks", device="cpu", prefetch_depth=2, compress=compress,
                                                 debug_copy_delay_us=200)
    x = torch.randn(4, 128).to(torch.bfloat16)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(model(x), reference(x))
    assert_computes_from_slots(model)
    last = m.stats(sync=True)["last_step"]
    fp8 = sum(p.numel() for p in model.blocks.parameters() if p.dtype == torch.float8_e4m3fn)
    assert fp8 > 0 and last["bytes_copied"] <= 1.15 * quantized_bytes(reference, ["blocks"]), last
    assert last["bytes_copied"] < 0.6 * sum(p.numel() * 2 for p in reference.blocks.parameters())  # vs bf16
    sd = model.state_dict()
    assert all(torch.equal(sd[k].view(torch.uint8), v.view(torch.uint8)) for k, v in before.items())
    layerwise.remove_layerwise_offload(model)
    for (k, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert p.dtype == q.dtype and torch.equal(p.view(torch.uint8), q.view(torch.uint8)), k
