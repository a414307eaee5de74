"""Tiny random hybrid models (Qwen3-Next: Gated DeltaNet layers beside full attention), dense and
MoE, as transformers builds them, and ours with the same weights."""

from __future__ import annotations

import torch

VOCAB = 96
# three linear-attention layers, then a full one (Qwen3-Next's 3:1), GQA on both kinds (2 value
# heads a key head), partial rotary (Qwen3-Next's 0.25 of the head)
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
             linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4,
             layer_types=["linear_attention"] * 3 + ["full_attention"], max_position_embeddings=256,
             rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
FAMILIES = {
    "dense": dict(num_experts=0),
    "moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32),
}

_MODELS: dict = {}


def hybrid_hf_model(kind: str = "dense", seed: int = 0, **overrides):
    """A random transformers Qwen3-Next in fp32, eval mode (cached: tests only read it)."""
    from transformers import AutoModelForCausalLM, Qwen3NextConfig

    key = (kind, seed, repr(sorted(overrides.items())))
    if key not in _MODELS:
        torch.manual_seed(seed)
        config = Qwen3NextConfig(**{**SHAPE, **FAMILIES[kind], **overrides})
        config.architectures = ["Qwen3NextForCausalLM"]
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():  # sharp logits, norms and gates away from their identity
            for name, p in model.named_parameters():
                if p.dim() >= 2:
                    p.normal_(0, 0.2)
                elif "A_log" in name or "dt_bias" in name:
                    p.copy_(torch.randn_like(p) * 0.5)
                else:
                    p.add_(torch.randn_like(p) * 0.2)
        _MODELS[key] = model.eval()
    return _MODELS[key]
