"""Dense transformers models written as GGUF files the way llama.cpp's `convert_hf_to_gguf.py`
writes their family (tensor names from gguf-py's own table, the family's metadata keys and its
tensor rewrites: Gemma's norms stored as `1 + w`, Llama's q/k rows permuted and its llama3 rope
scaling as `rope_freqs.weight`), so a test can load what a user would download.
"""

from __future__ import annotations

import math

import numpy as np

# transformers model type -> (gguf-py's architecture, its GGUF name)
_ARCH = {"gemma3_text": ("GEMMA3", "gemma3"), "llama": ("LLAMA", "llama"), "smollm3": ("SMOLLM3", "smollm3"),
         "granite": ("GRANITE", "granite"), "phi3": ("PHI3", "phi3"),
         "glm4": ("GLM4", "glm4")}
_PERMUTED = ("llama", "smollm3", "granite")  # llama.cpp's LlamaModel and its subclasses permute q/k


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order for the llama architecture (its converter's `permute`)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_freqs(cfg) -> np.ndarray:
    """The `rope_freqs.weight` llama.cpp's converter writes for a llama3-scaled config (its loop)."""
    rope = cfg.rope_parameters
    base, dim = rope["rope_theta"], cfg.hidden_size // cfg.num_attention_heads
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for freq in 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim)):
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def gguf_tensors(hf_model) -> dict[str, np.ndarray]:
    """The model's tensors under llama.cpp's names, float32, rewritten as its converter does."""
    import gguf

    cfg = hf_model.config
    arch, _ = _ARCH[cfg.model_type]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch], cfg.num_hidden_layers)
    out = {}
    for name, t in hf_model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        t = t.detach().float().numpy()
        if cfg.model_type == "gemma3_text" and name.endswith("norm.weight"):
            t = t + 1  # llama.cpp's Gemma norms multiply by the stored weight
        if cfg.model_type in _PERMUTED and name.endswith(("q_proj.weight", "k_proj.weight")):
            t = _permute(t, cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads)
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        out[gguf_name] = t
    if cfg.model_type == "llama" and cfg.rope_parameters.get("rope_type") == "llama3":
        out["rope_freqs.weight"] = llama3_rope_freqs(cfg)
    if cfg.model_type == "phi3" and cfg.rope_parameters.get("rope_type") == "longrope":
        out["rope_factors_long.weight"] = np.array(cfg.rope_parameters["long_factor"], np.float32)
        out["rope_factors_short.weight"] = np.array(cfg.rope_parameters["short_factor"], np.float32)
    return out


# A sentencepiece vocabulary as Gemma's GGUFs store one (`tokenizer.ggml.model` "llama"):
# <pad> <eos> <bos> <unk>, the 256 byte tokens, then pieces whose scores order their merges
SPM_SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>"]
_SPM_WORDS = "the quick brown fox jumps over lazy dog def add return speculative decoding draft target".split()


def spm_vocab() -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, token types) of a tiny Gemma-style vocabulary (`SPM_SPECIAL` first)."""
    pieces = sorted({w[:i] for w in _SPM_WORDS for i in range(1, len(w) + 1)}
                    | {"\u2581" + w[:i] for w in _SPM_WORDS for i in range(0, len(w) + 1)}, key=lambda p: (len(p), p))
    tokens = SPM_SPECIAL + [f"<0x{b:02X}>" for b in range(256)] + pieces
    scores = [0.0] * (len(SPM_SPECIAL) + 256) + [-float(i) for i in range(len(pieces))]
    types = [3] * len(SPM_SPECIAL) + [6] * 256 + [1] * len(pieces)  # control, byte, normal
    return tokens, scores, types


def shape_writer(path, arch: str, cfg):
    """A `GGUFWriter` of `arch` holding the shape keys every decoder's GGUF has (layers, widths,
    heads, head size, norm eps), and the head size."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch=arch)
    writer.add_name(f"tiny {arch}")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    return writer, head_dim


def write_gguf(hf_model, path, tokenizer=None) -> None:
    """`hf_model` as a GGUF file with `tokenizer` (a byte-level BPE, as Llama 3's), or without one
    with `spm_vocab`'s vocabulary (Gemma's kind: the model's vocabulary must be its size), BOS
    added as Gemma's and Llama's tokenizers add it."""
    cfg = hf_model.config
    writer, head_dim = shape_writer(path, _ARCH[cfg.model_type][1], cfg)
    if cfg.model_type == "gemma3_text":
        writer.add_rope_freq_base(float(cfg.rope_parameters["full_attention"]["rope_theta"]))
        writer.add_sliding_window(cfg.sliding_window)
    else:
        writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
        if cfg.model_type not in ("phi3", "glm4"):
            writer.add_rope_dimension_count(head_dim)
    if cfg.model_type == "glm4":  # its converter: the rotary width, q/k rows as stored (not permuted)
        writer.add_rope_dimension_count(int(head_dim * cfg.rope_parameters.get("partial_rotary_factor", 0.5)))
    if cfg.model_type == "phi3":  # its converter: the rotary width, the original context, no window (0)
        rope = cfg.rope_parameters
        writer.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * head_dim))
        writer.add_rope_scaling_orig_ctx_len(rope.get("original_max_position_embeddings") or cfg.max_position_embeddings)
        writer.add_sliding_window(cfg.sliding_window or 0)
    if cfg.model_type == "granite":  # its converter's names for the multipliers
        writer.add_attention_scale(cfg.attention_multiplier)
        writer.add_embedding_scale(cfg.embedding_multiplier)
        writer.add_residual_scale(cfg.residual_multiplier)
        writer.add_logit_scale(cfg.logits_scaling)
    if tokenizer is not None:
        from tests.target.conftest import add_gguf_tokenizer

        add_gguf_tokenizer(writer, tokenizer)
        writer.add_tokenizer_pre("llama-bpe")
        writer.add_add_bos_token(True)
    else:
        _add_spm_vocab(writer, hf_model.config.vocab_size)
    for name, values in gguf_tensors(hf_model).items():
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _add_spm_vocab(writer, vocab_size: int) -> None:
    tokens, scores, types = spm_vocab()
    assert vocab_size == len(tokens)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_pad_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_bos_token_id(2)
    writer.add_unk_token_id(3)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(False)


def write_gpt_oss_gguf(hf_model, path, tokenizer, mxfp4_experts: bool = False) -> None:
    """A transformers gpt-oss (float experts) as llama.cpp's converter writes one with float
    experts: gate and up split from the interleaved `gate_up_proj` (even columns gate, odd up),
    each expert stored [out, in]; the router, sinks and biases under gguf-py's names; YaRN's
    parameters as scaling keys. `mxfp4_experts`: the experts' weights as gpt-oss ships them, MXFP4
    blocks (gguf-py's quantizer; `llama-quantize MXFP4_MOE` writes the same blocks)."""
    import gguf
    from gguf import quants

    def add_expert(name, values):
        if mxfp4_experts and name.endswith(".weight"):
            blocks = quants.quantize(values, gguf.GGMLQuantizationType.MXFP4)
            writer.add_tensor(name, blocks, raw_dtype=gguf.GGMLQuantizationType.MXFP4)
        else:
            writer.add_tensor(name, values)

    cfg = hf_model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT_OSS, cfg.num_hidden_layers)
    writer, _ = shape_writer(path, "gpt-oss", cfg)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_expert_count(cfg.num_local_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    writer.add_expert_feed_forward_length(cfg.intermediate_size)
    writer.add_sliding_window(cfg.sliding_window)
    rope = cfg.rope_parameters
    if rope.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    add_gguf_tokenizer_to(writer, tokenizer)
    for name, t in hf_model.state_dict().items():
        t = t.detach().float()
        stem = name.rsplit(".", 1)[0]
        if "experts.gate_up_proj" in name:
            gate_up = t if name.endswith("_bias") else t.transpose(-1, -2)  # [E, 2I(, H)]
            suffix = ".bias" if name.endswith("_bias") else ".weight"
            for part, rows in (("gate_proj", gate_up[:, ::2]), ("up_proj", gate_up[:, 1::2])):
                add_expert(names.get_name(f"{stem}.{part}") + suffix, rows.contiguous().numpy())
        elif "experts.down_proj" in name:
            suffix = ".bias" if name.endswith("_bias") else ".weight"
            values = t if name.endswith("_bias") else t.transpose(-1, -2)  # [E, H, I]
            add_expert(names.get_name(f"{stem}.down_proj") + suffix, values.contiguous().numpy())
        elif name.endswith("self_attn.sinks"):
            writer.add_tensor(names.get_name(name) + ".weight", t.numpy())
        else:
            gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
            assert gguf_name is not None, name
            writer.add_tensor(gguf_name, t.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def add_gguf_tokenizer_to(writer, tokenizer) -> None:
    """`tokenizer` (a byte-level BPE) written as llama.cpp writes one, no BOS added."""
    from tests.target.conftest import add_gguf_tokenizer

    add_gguf_tokenizer(writer, tokenizer)
    writer.add_tokenizer_pre("llama-bpe")
    writer.add_add_bos_token(False)
