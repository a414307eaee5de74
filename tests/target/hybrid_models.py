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


def _tiled(t: torch.Tensor, dim: int, key_heads: int, per_key: int, head_dim: int) -> torch.Tensor:
    """llama.cpp's converter's reorder of Qwen3.5's value heads along `dim`: grouped by key head
    ([k0: v0 v1, k1: v0 v1]) -> tiled ([k0 v0, k1 v0, k0 v1, k1 v1])."""
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], key_heads, per_key, head_dim, *shape[dim + 1:])
    return t.transpose(dim, dim + 1).reshape(shape)


def hybrid_gguf_tensors(hf_model) -> dict:
    """`hf_model`'s tensors as llama.cpp's converter writes a `qwen3next` / `qwen35` GGUF (f32):
    norms as 1 + w (but the linear layers' gated norm), A_log as A = -exp(A_log), the convolution
    squeezed to [C, K], Qwen3-Next's in_proj_qkvz split into q|k|v (attn_qkv) and z (attn_gate),
    each regrouped from per key head, in_proj_ba as ssm_ba; Qwen3.5's value heads tiled."""
    cfg = hf_model.config
    hk, hv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                      cfg.linear_value_head_dim)
    r = hv // hk
    qwen35 = cfg.model_type != "qwen3_next"
    names = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
             "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
             "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
             "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
             "linear_attn.in_proj_qkv.weight": "attn_qkv.weight", "linear_attn.in_proj_z.weight": "attn_gate.weight",
             "linear_attn.in_proj_a.weight": "ssm_alpha.weight", "linear_attn.in_proj_b.weight": "ssm_beta.weight",
             "linear_attn.in_proj_ba.weight": "ssm_ba.weight", "linear_attn.A_log": "ssm_a",
             "linear_attn.conv1d.weight": "ssm_conv1d.weight", "linear_attn.dt_bias": "ssm_dt.bias",
             "linear_attn.norm.weight": "ssm_norm.weight", "linear_attn.out_proj.weight": "ssm_out.weight",
             "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
             "mlp.down_proj.weight": "ffn_down.weight", "mlp.gate.weight": "ffn_gate_inp.weight",
             "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
             "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
             "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
             "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight"}
    out = {}
    for name, t in hf_model.state_dict().items():
        t = t.detach().float().clone()
        if name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
            gg = {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight",
                  "model.norm.weight": "output_norm.weight"}[name]
            out[gg] = t + 1 if gg == "output_norm.weight" else t
            continue
        layer, rest = name.split(".")[2], name.split(".", 3)[3]
        blk = f"blk.{layer}."
        if rest.startswith("mlp.experts."):  # stacked [E, out, in] -> ffn_{gate,up,down}_exps
            if rest == "mlp.experts.gate_up_proj":
                gate, up = t.chunk(2, dim=1)
                out[blk + "ffn_gate_exps.weight"], out[blk + "ffn_up_exps.weight"] = gate, up
            else:
                out[blk + "ffn_down_exps.weight"] = t
            continue
        if rest == "linear_attn.in_proj_qkvz.weight":  # per key head [q, k, v, z] -> q|k|v and z
            q, k, v, z = t.view(hk, 2 * dk + 2 * r * dv, -1).split([dk, dk, r * dv, r * dv], dim=1)
            out[blk + "attn_qkv.weight"] = torch.cat([x.reshape(-1, t.shape[1]) for x in (q, k, v)])
            out[blk + "attn_gate.weight"] = z.reshape(-1, t.shape[1])
            continue
        if rest.endswith("norm.weight") and rest != "linear_attn.norm.weight":
            t = t + 1
        if rest == "linear_attn.A_log":
            t = -torch.exp(t)
        if rest == "linear_attn.conv1d.weight":
            t = t.squeeze(1)
        if qwen35 and r > 1 and rest.startswith("linear_attn."):
            if rest == "linear_attn.in_proj_qkv.weight":
                t = torch.cat([t[: 2 * hk * dk], _tiled(t[2 * hk * dk:], 0, hk, r, dv)])
            elif rest == "linear_attn.conv1d.weight":
                t = torch.cat([t[: 2 * hk * dk], _tiled(t[2 * hk * dk:], 0, hk, r, dv)])
            elif rest == "linear_attn.in_proj_z.weight":
                t = _tiled(t, 0, hk, r, dv)
            elif rest in ("linear_attn.in_proj_a.weight", "linear_attn.in_proj_b.weight", "linear_attn.A_log",
                          "linear_attn.dt_bias"):
                t = _tiled(t, 0, hk, r, 1)
            elif rest == "linear_attn.out_proj.weight":
                t = _tiled(t, 1, hk, r, dv)
        out[blk + names[rest]] = t
    return {k: v.numpy() for k, v in out.items()}


def write_hybrid_gguf(hf_model, path, tokenizer) -> None:
    """`hf_model` (Qwen3-Next or Qwen3.5, dense or MoE) as llama.cpp's converter writes its GGUF."""
    from tests.target.gguf_models import add_gguf_tokenizer_to, shape_writer

    cfg = hf_model.config
    arch = {"qwen3_next": "qwen3next", "qwen3_5_text": "qwen35", "qwen3_5_moe_text": "qwen35moe"}[cfg.model_type]
    writer, head_dim = shape_writer(path, arch, cfg)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_rope_dimension_count(int(head_dim * cfg.rope_parameters.get("partial_rotary_factor", 0.25)))
    writer.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
    writer.add_ssm_state_size(cfg.linear_key_head_dim)
    writer.add_ssm_group_count(cfg.linear_num_key_heads)
    writer.add_ssm_time_step_rank(cfg.linear_num_value_heads)
    writer.add_ssm_inner_size(cfg.linear_value_head_dim * cfg.linear_num_value_heads)
    writer.add_array(f"{arch}.attention.recurrent_layers", [t == "linear_attention" for t in cfg.layer_types])
    if getattr(cfg, "num_experts", 0):
        writer.add_expert_count(cfg.num_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    add_gguf_tokenizer_to(writer, tokenizer)
    for name, values in hybrid_gguf_tensors(hf_model).items():
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
