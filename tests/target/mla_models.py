"""Tiny random DeepSeek-V2/V3 models for the MLA tests: transformers configs with every feature on
(a dense first layer, shared experts, `q_lora_rank` None or set, group-limited routing, V3's
sigmoid scores with their choosing bias, interleaved and plain rope) and a `deepseek2` GGUF writer
laid out as llama.cpp's converter writes it (`attn_kv_b`, or split into `attn_k_b` / `attn_v_b`)."""

from __future__ import annotations

import numpy as np
import torch

# latent 48 + 16 = 64 wide (a multiple of 16: the C kernel), values 16, keys 32 + 16
SHAPE = dict(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
             n_shared_experts=2, kv_lora_rank=48, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=16,
             first_k_dense_replace=1, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1,
             eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
# name -> (family, overrides)
VARIANTS = {
    "v2": ("deepseek_v2", dict(q_lora_rank=None)),
    "v2-grouped": ("deepseek_v2", dict(q_lora_rank=32, topk_method="group_limited_greedy", n_group=4, topk_group=2)),
    "v3": ("deepseek_v3", dict(q_lora_rank=32, n_group=4, topk_group=2)),
    "v3-plain-rope": ("deepseek_v3", dict(q_lora_rank=None, n_group=1, topk_group=1, rope_interleave=False)),
}

_MODELS: dict = {}


def mla_hf_config(variant: str, **overrides):
    import transformers as tf

    family, features = VARIANTS[variant]
    cls = tf.DeepseekV3Config if family == "deepseek_v3" else tf.DeepseekV2Config
    return cls(**{**SHAPE, **features, **overrides})


def mla_hf_model(variant: str, seed: int = 0, **overrides):
    """A random transformers model of `variant` in fp32, eval mode (cached: tests only read it)."""
    from transformers import AutoModelForCausalLM

    key = (variant, seed, tuple(sorted(overrides.items())))
    if key not in _MODELS:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(mla_hf_config(variant, **overrides), dtype=torch.float32)
        with torch.no_grad():  # sharp logits and routers, norms away from their identity, a bias that matters
            for p in model.parameters():
                p.normal_(0, 0.2) if p.dim() >= 2 else p.add_(torch.randn_like(p) * 0.2)
            for name, b in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.normal_(0, 0.1)
        _MODELS[key] = model.eval()
    return _MODELS[key]


_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_a_proj.weight": "attn_q_a.weight",
    "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight", "self_attn.q_b_proj.weight": "attn_q_b.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight", "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
    "self_attn.kv_b_proj.weight": "attn_kv_b.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight", "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
    "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight", "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
}


def gguf_tensors(hf_model, split_kv_b: bool = False) -> dict[str, np.ndarray]:
    """The model's tensors under llama.cpp's `deepseek2` names, float32; with `split_kv_b`,
    `kv_b_proj` as llama.cpp's newer converter writes it: `attn_k_b [H, rank, nope]` (transposed)
    and `attn_v_b [H, v, rank]`."""
    cfg = hf_model.config
    out = {}
    state = {**hf_model.state_dict(), **dict(hf_model.named_buffers())}
    for name, t in state.items():
        t = t.detach().float().numpy()
        if name == "model.embed_tokens.weight":
            out["token_embd.weight"] = t
        elif name == "model.norm.weight":
            out["output_norm.weight"] = t
        elif name == "lm_head.weight":
            out["output.weight"] = t
        elif name.startswith("model.layers.") and "rotary" not in name:
            i, rest = name.removeprefix("model.layers.").split(".", 1)
            if rest == "mlp.experts.gate_up_proj":  # [E, 2I, H]: gate | up
                half = t.shape[1] // 2
                out[f"blk.{i}.ffn_gate_exps.weight"], out[f"blk.{i}.ffn_up_exps.weight"] = t[:, :half], t[:, half:]
            elif rest == "mlp.experts.down_proj":
                out[f"blk.{i}.ffn_down_exps.weight"] = t
            elif rest == "self_attn.kv_b_proj.weight" and split_kv_b:
                heads, nope = cfg.num_attention_heads, cfg.qk_nope_head_dim
                kv_b = t.reshape(heads, nope + cfg.v_head_dim, cfg.kv_lora_rank)
                out[f"blk.{i}.attn_k_b.weight"] = np.ascontiguousarray(kv_b[:, :nope].transpose(0, 2, 1))
                out[f"blk.{i}.attn_v_b.weight"] = np.ascontiguousarray(kv_b[:, nope:])
            else:
                out[f"blk.{i}.{_LAYER_NAMES[rest]}"] = t
    return out


def write_gguf(hf_model, path, tokenizer, split_kv_b: bool = False) -> None:
    """`hf_model` (a DeepSeek-V2 or V3) as a `deepseek2` GGUF with `tokenizer`, its metadata as
    llama.cpp's converter writes it; F32 tensors."""
    import gguf

    from tests.target.conftest import add_gguf_tokenizer

    cfg = hf_model.config
    v3 = cfg.model_type == "deepseek_v3"
    arch = "deepseek2"
    writer = gguf.GGUFWriter(str(path), arch=arch)
    writer.add_name("tiny deepseek2")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(1 if split_kv_b else cfg.num_attention_heads)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if cfg.q_lora_rank:
        writer.add_q_lora_rank(cfg.q_lora_rank)
    writer.add_kv_lora_rank(cfg.kv_lora_rank)
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    if split_kv_b:  # llama.cpp #12801: the MLA key and value widths, the per-head ones apart
        writer.add_key_length(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        writer.add_value_length(cfg.kv_lora_rank)
        writer.add_key_length_mla(qk)
        writer.add_value_length_mla(cfg.v_head_dim)
    else:
        writer.add_key_length(qk)
        writer.add_value_length(cfg.v_head_dim)
    writer.add_rope_dimension_count(cfg.qk_rope_head_dim)
    writer.add_expert_count(cfg.n_routed_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    writer.add_expert_shared_count(cfg.n_shared_experts)
    writer.add_leading_dense_block_count(cfg.first_k_dense_replace)
    writer.add_expert_weights_scale(cfg.routed_scaling_factor)
    if v3:
        writer.add_expert_weights_norm(cfg.norm_topk_prob)
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if v3 else gguf.ExpertGatingFuncType.SOFTMAX)
    if v3 or cfg.topk_method == "group_limited_greedy":
        writer.add_expert_group_count(cfg.n_group)
        writer.add_expert_group_used_count(cfg.topk_group)
    add_gguf_tokenizer(writer, tokenizer)
    writer.add_tokenizer_pre("qwen2")
    for name, values in gguf_tensors(hf_model, split_kv_b).items():
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
