"""Tiny random mixture-of-experts models for the MoE tests: transformers configs of the four
families (every feature on: a dense layer among sparse ones, a shared expert, renormalized and
plain top k, OLMoE's whole-width q/k norms and clipping) and a GGUF writer that lays a transformers
model out as llama.cpp's converter does (stacked `ffn_*_exps`, `ffn_*_shexp`)."""

from __future__ import annotations

import numpy as np
import torch

VOCAB = 96
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
             max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0,
             tie_word_embeddings=False)
# expert widths are multiples of 32, so the experts fit the C kernel (head_dim 32: the C layer loop)
FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")


# per family: every feature on (a dense layer among sparse ones, a shared expert, renormalized and
# plain top k, OLMoE's clipping)
_FAMILY = {
    "qwen3_moe": ("Qwen3MoeConfig", dict(head_dim=32, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                                         num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1])),
    "qwen2_moe": ("Qwen2MoeConfig", dict(intermediate_size=96, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=64, num_experts=8, num_experts_per_tok=3)),
    "mixtral": ("MixtralConfig", dict(intermediate_size=64, num_local_experts=4, num_experts_per_tok=2)),
    "olmoe": ("OlmoeConfig", dict(intermediate_size=32, num_experts=8, num_experts_per_tok=2, clip_qkv=4.0)),
}


def moe_hf_config(family: str, **overrides):
    import transformers as tf

    name, features = _FAMILY[family]
    return getattr(tf, name)(**{**SHAPE, **features, **overrides})


_MODELS: dict = {}


def moe_hf_model(family: str, seed: int = 0, **overrides):
    """A random transformers model of `family` in fp32, eval mode (cached: tests only read it)."""
    from transformers import AutoModelForCausalLM

    key = (family, seed, tuple(sorted(overrides.items())))
    if key not in _MODELS:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(moe_hf_config(family, **overrides), dtype=torch.float32)
        with torch.no_grad():  # sharp logits and routers, norms away from their identity
            for p in model.parameters():
                p.normal_(0, 0.2) if p.dim() >= 2 else p.add_(torch.randn_like(p) * 0.2)
        _MODELS[key] = model.eval()
    return _MODELS[key]


_GGUF_ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "qwen3": "qwen3", "qwen2": "qwen2", "mixtral": "llama",
             "olmoe": "olmoe"}
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight", "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight", "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order for the llama architecture (its converter's `permute`)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(hf_model) -> dict[str, np.ndarray]:
    """The model's tensors under llama.cpp's GGUF names (experts stacked), float32; a Mixtral's q/k
    rows permuted as llama.cpp writes the llama architecture."""
    cfg = hf_model.config
    out = {}
    for name, t in hf_model.state_dict().items():
        t = t.detach().float().numpy()
        if name == "model.embed_tokens.weight":
            out["token_embd.weight"] = t
        elif name == "model.norm.weight":
            out["output_norm.weight"] = t
        elif name == "lm_head.weight":
            out["output.weight"] = t
        elif name.startswith("model.layers."):
            i, rest = name.removeprefix("model.layers.").split(".", 1)
            if rest == "mlp.experts.gate_up_proj":  # [E, 2I, H]: gate | up
                half = t.shape[1] // 2
                out[f"blk.{i}.ffn_gate_exps.weight"], out[f"blk.{i}.ffn_up_exps.weight"] = t[:, :half], t[:, half:]
            elif rest == "mlp.experts.down_proj":
                out[f"blk.{i}.ffn_down_exps.weight"] = t
            elif rest == "mlp.shared_expert_gate.weight":  # [1, H] -> [H], as llama.cpp stores it
                out[f"blk.{i}.ffn_gate_inp_shexp.weight"] = t[0]
            elif "rotary" not in rest:
                if cfg.model_type == "mixtral" and rest in ("self_attn.q_proj.weight", "self_attn.k_proj.weight"):
                    t = _permute(t, cfg.num_attention_heads if "q_proj" in rest else cfg.num_key_value_heads)
                out[f"blk.{i}.{_LAYER_NAMES[rest]}"] = t
    return out


def write_gguf(hf_model, path, tokenizer, expert_type: str = "F32") -> None:
    """`hf_model` (a Qwen3 / Qwen2, MoE or dense, an OLMoE, or a Mixtral: llama.cpp's llama architecture) as a
    GGUF file with `tokenizer`; the stacked experts in `expert_type` (F32, Q8_0, or Q4_K: random
    valid blocks in place of the weights, which gguf cannot quantize to), the rest F32."""
    import gguf

    from tests.target.conftest import add_gguf_tokenizer

    from tests.target.gguf_models import shape_writer

    cfg = hf_model.config
    arch = _GGUF_ARCH[cfg.model_type]
    writer, head_dim = shape_writer(path, arch, cfg)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    if cfg.model_type == "mixtral":
        writer.add_expert_count(cfg.num_local_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
    elif cfg.model_type == "olmoe":  # llama.cpp's OlmoeModel: feed_forward_length is the experts' width,
        writer.add_expert_count(cfg.num_experts)  # the norm eps always 1e-5, no clip_qkv nor norm_topk_prob
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        writer.add_layer_norm_rms_eps(1e-5)
    elif "moe" in cfg.model_type:
        writer.add_expert_count(cfg.num_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        if getattr(cfg, "shared_expert_intermediate_size", None):
            writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    add_gguf_tokenizer(writer, tokenizer)
    writer.add_tokenizer_pre("qwen2")
    writer.add_rope_dimension_count(head_dim)
    for name, values in gguf_tensors(hf_model).items():
        if expert_type == "Q4_K" and name.endswith("_exps.weight"):
            from tests.target.test_kquant import k_blocks

            e, n, k = values.shape
            blocks = k_blocks(12, e * n, k, seed=len(name)).reshape(e, n, -1)
            writer.add_tensor(name, blocks, raw_dtype=gguf.GGMLQuantizationType.Q4_K)
        elif expert_type != "F32" and name.endswith("_exps.weight"):
            qtype = gguf.GGMLQuantizationType[expert_type]
            writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
