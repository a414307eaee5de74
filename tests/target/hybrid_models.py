"""Tiny random hybrid models (Qwen3-Next and Qwen3.5: Gated DeltaNet layers beside full attention),
dense and MoE, as transformers builds them."""

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
_EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
# kind -> (transformers config class, what it adds): Qwen3-Next dense and MoE, Qwen3.5 dense and MoE
FAMILIES = {
    "dense": ("Qwen3NextConfig", dict(num_experts=0)),
    "moe": ("Qwen3NextConfig", _EXPERTS),
    "qwen3.5": ("Qwen3_5TextConfig", {}),
    "qwen3.5-moe": ("Qwen3_5MoeTextConfig", _EXPERTS),
}

_MODELS: dict = {}


def hybrid_hf_model(kind: str = "dense", seed: int = 0, **overrides):
    """A random transformers Qwen3-Next or Qwen3.5 in fp32, eval mode (cached: tests only read it)."""
    import transformers as tf

    key = (kind, seed, repr(sorted(overrides.items())))
    if key not in _MODELS:
        torch.manual_seed(seed)
        name, features = FAMILIES[kind]
        config = getattr(tf, name)(**{**SHAPE, **features, **overrides})
        model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
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
