"""Tiny real architectures (diffusers Flux, HunyuanVideo, Wan; transformers Llama)
built from small configs with random weights, and how to run and compare them
(tests/test_real_models.py, test_loading_recipes.py, stages/test_compress.py, and
the split-fetch ranks of split_worker.py). `build` skips a test where the
architecture's package (a test extra) is not installed."""
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
from torch import nn


@dataclass
class Arch:
    name: str
    package: str  # the test extra it needs
    build: Callable[[], nn.Module]
    inputs: Callable[[int], tuple]  # seed -> (args, kwargs) for one forward
    output: Callable[[object], torch.Tensor]  # model output -> the tensor to compare
    groups: list  # the block lists, in execution order
    layers: dict  # group -> number of blocks


def _flux(num_layers=2):
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel(
        patch_size=1, in_channels=8, num_layers=num_layers, num_single_layers=7, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=16, pooled_projection_dim=8, axes_dims_rope=(4, 6, 6),
    )


def _flux_inputs(seed, batch=1, tokens=16, text=6):
    g = torch.Generator().manual_seed(seed)
    kwargs = dict(
        hidden_states=torch.randn(batch, tokens, 8, generator=g),
        encoder_hidden_states=torch.randn(batch, text, 16, generator=g),
        pooled_projections=torch.randn(batch, 8, generator=g),
        timestep=torch.rand(batch, generator=g),
        img_ids=torch.randint(0, 8, (tokens, 3), generator=g).float(),
        txt_ids=torch.zeros(text, 3),
        return_dict=False,
    )
    return (), kwargs


def _hunyuan():
    from diffusers import HunyuanVideoTransformer3DModel

    return HunyuanVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=2,
        num_single_layers=7, num_refiner_layers=2, patch_size=2, patch_size_t=1, guidance_embeds=True,
        text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=(4, 6, 6),
    )


def _hunyuan_inputs(seed, batch=1, text=6):
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(batch, text, dtype=torch.bool)
    mask[:, text - 2 :] = False  # padded prompt tokens
    kwargs = dict(
        hidden_states=torch.randn(batch, 4, 2, 4, 4, generator=g),
        timestep=torch.randint(0, 1000, (batch,), generator=g),
        encoder_hidden_states=torch.randn(batch, text, 16, generator=g),
        encoder_attention_mask=mask,
        pooled_projections=torch.randn(batch, 8, generator=g),
        guidance=torch.full((batch,), 3.5),
        return_dict=False,
    )
    return (), kwargs


def _wan():
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
        text_dim=16, freq_dim=32, ffn_dim=64, num_layers=7, rope_max_seq_len=32,
    )


def _wan_inputs(seed, batch=1, text=6):
    g = torch.Generator().manual_seed(seed)
    kwargs = dict(
        hidden_states=torch.randn(batch, 4, 2, 4, 4, generator=g),
        timestep=torch.randint(0, 1000, (batch,), generator=g),
        encoder_hidden_states=torch.randn(batch, text, 16, generator=g),
        return_dict=False,
    )
    return (), kwargs


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=7, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    return LlamaForCausalLM(config).eval()


def _llama_inputs(seed, batch=2, tokens=7):
    g = torch.Generator().manual_seed(seed)
    return (), dict(input_ids=torch.randint(3, 128, (batch, tokens), generator=g))


ARCHS = {
    "flux": Arch("flux", "diffusers", _flux, _flux_inputs, lambda o: o[0],
                 ["transformer_blocks", "single_transformer_blocks"],
                 {"transformer_blocks": 2, "single_transformer_blocks": 7}),
    "hunyuan": Arch("hunyuan", "diffusers", _hunyuan, _hunyuan_inputs, lambda o: o[0],
                    ["context_embedder.token_refiner.refiner_blocks", "transformer_blocks",
                     "single_transformer_blocks"],
                    {"context_embedder.token_refiner.refiner_blocks": 2, "transformer_blocks": 2,
                     "single_transformer_blocks": 7}),
    "wan": Arch("wan", "diffusers", _wan, _wan_inputs, lambda o: o[0], ["blocks"], {"blocks": 7}),
    "llama": Arch("llama", "transformers", _llama, _llama_inputs, lambda o: o.logits, ["model.layers"],
                  {"model.layers": 7}),
}


def build(arch: Arch, seed: int = 0) -> nn.Module:
    pytest.importorskip(arch.package)
    torch.manual_seed(seed)
    model = arch.build().eval()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    return model


def run(arch: Arch, model: nn.Module, seed: int, device: str = "cpu") -> torch.Tensor:
    args, kwargs = arch.inputs(seed)
    if device != "cpu":
        kwargs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    with torch.no_grad():
        return arch.output(model(*args, **kwargs))


def run_bf16(arch: Arch, model: nn.Module, seed: int) -> torch.Tensor:
    """run() with the floating-point inputs cast to bf16, for a bf16 model."""
    args, kwargs = arch.inputs(seed)
    cast = lambda v: v.to(torch.bfloat16) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
    with torch.no_grad():
        return arch.output(model(*map(cast, args), **{k: cast(v) for k, v in kwargs.items()}))


def clone_state(model: nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_state_equal(model: nn.Module, sd: dict) -> None:
    now = model.state_dict()
    assert set(now) == set(sd)
    for k, v in now.items():
        assert v.dtype == sd[k].dtype and v.shape == sd[k].shape, k
        assert torch.equal(v.cpu(), sd[k]), k


def recopied(manager) -> int:
    """Streamed layers that share their ring slot with another one: each is copied in every step."""
    slots = [manager.ring.slot_of[i] for i in manager.ring.streamed]
    return sum(slots.count(s) > 1 for s in slots)


# One group of each model has 7 blocks, so that every (depth, resident) below
# really streams: at depth d a group needs more than 2d+1 streamed layers before
# two of them share a slot (fewer get a slot each and are copied only once).
SEEDS = [11, 12, 13]
