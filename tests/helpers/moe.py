"""Tiny mixture-of-experts language models of transformers (Mixtral, Qwen3-MoE,
OLMoE, DeepSeek-V3) with random weights, and their inputs
(tests/stages/test_moe.py and the scripts it runs in a fresh process).
Importing it skips a test module where transformers is not installed."""
import pytest
import torch

transformers = pytest.importorskip("transformers")


V = 128


def _mixtral(dtype=torch.float32, layers=6):
    cfg = transformers.MixtralConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                                     num_experts_per_tok=2, max_position_embeddings=128)
    return transformers.MixtralForCausalLM(cfg).to(dtype).eval()


def _qwen3():
    cfg = transformers.Qwen3MoeConfig(vocab_size=V, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
                                      num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                                      num_experts=8, num_experts_per_tok=2, max_position_embeddings=128, head_dim=16)
    return transformers.Qwen3MoeForCausalLM(cfg).eval()


def _olmoe():
    cfg = transformers.OlmoeConfig(vocab_size=V, hidden_size=64, intermediate_size=64, num_hidden_layers=6,
                                   num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
                                   max_position_embeddings=128, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    return transformers.OlmoeForCausalLM(cfg).eval()


def _deepseek():
    cfg = transformers.DeepseekV3Config(
        vocab_size=V, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, n_group=2, topk_group=1, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=16, max_position_embeddings=128)
    return transformers.DeepseekV3ForCausalLM(cfg).eval()


ARCHS = {"mixtral": _mixtral, "qwen3": _qwen3, "olmoe": _olmoe, "deepseek": _deepseek}


def _make(arch, seed=0):
    torch.manual_seed(seed)
    return ARCHS[arch]()


def _ids(batch=1, tokens=6, seed=1):
    return torch.randint(3, V, (batch, tokens), generator=torch.Generator().manual_seed(seed))


def _bf16(arch):
    torch.manual_seed(0)
    return (_mixtral(torch.bfloat16) if arch == "mixtral" else _make(arch).to(torch.bfloat16))


def _host_budget(model, keep_fraction=0.85):
    return int(keep_fraction * sum(p.numel() * p.element_size() for p in model.parameters()))
