"""Model configuration: the decoder's shapes and per-family features, read from an HF config.

One transformer covers every family below; a family is a set of features on top of Llama's
layer (q/k norms, Gemma's norms and soft-capping, sliding windows, fused checkpoint projections),
each a field of `ModelConfig` whose default is Llama's.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

from specdec.target.rope import LAYER_TYPES, layer_typed, rope_parameters

log = logging.getLogger("specdec")

# architecture -> model_type, for configs that name only one of the two
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MistralForCausalLM": "mistral",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "Phi3ForCausalLM": "phi3",
    "SmolLM3ForCausalLM": "smollm3",
    "GraniteForCausalLM": "granite",
    "Glm4ForCausalLM": "glm4",
    # mixtures of experts (`MoEConfig`)
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "MixtralForCausalLM": "mixtral",
    "OlmoeForCausalLM": "olmoe",
    "GptOssForCausalLM": "gpt_oss",
    # multi-head latent attention (`MLAConfig`) over mixtures of experts
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    # hybrid: Gated DeltaNet linear attention beside full attention (`LinearAttentionConfig`)
    "Qwen3NextForCausalLM": "qwen3_next",
    "Qwen3_5ForCausalLM": "qwen3_5_text",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe_text",
}
MLA_TYPES = ("deepseek_v2", "deepseek_v3")
HYBRID_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
QWEN35_TYPES = ("qwen3_5_text", "qwen3_5_moe_text")  # q|k|v, z, b and a projected apart
MOE_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "gpt_oss", "qwen3_next", "qwen3_5_moe_text", *MLA_TYPES)
GEMMA_TYPES = ("gemma2", "gemma3_text")
# Multimodal configs whose text model we run (the image tower is not loaded).
TEXT_OF_MULTIMODAL = ("gemma3", "qwen3_5", "qwen3_5_moe")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture is not one our transformer implements."""


@dataclass(frozen=True)
class MoEConfig:
    """A sparse MLP: a router picks `top_k` of `num_experts` SiLU-GLU experts per token.

    Qwen, Mixtral and OLMoE route by softmax over all experts, then the top k (Mixtral's top k of
    the logits, then softmax over those, is the same distribution as softmax, top k, renormalize).
    DeepSeek adds group-limited routing (the top k taken within the `topk_groups` best of
    `num_groups` expert groups), a scale on the routed experts' weights, and in V3 sigmoid scores
    with a per-expert bias that only chooses (the weights are the unbiased scores).
    """

    num_experts: int
    top_k: int
    expert_size: int  # each expert's intermediate width
    norm_topk: bool  # renormalize the top k weights to sum 1 (Mixtral always; Qwen / OLMoE by config)
    shared_expert_size: int = 0  # an always-on expert of this width; 0: none
    shared_expert_gated: bool = True  # Qwen2-MoE: the shared expert scaled by sigmoid(x . w); DeepSeek: not
    sparse_layers: tuple[bool, ...] = ()  # per layer: MoE (True) or the dense MLP of `intermediate_size`
    scoring: str = "softmax"  # "softmax" over all experts, or "sigmoid" per expert (DeepSeek-V3)
    score_bias: bool = False  # DeepSeek-V3: `gate.e_score_correction_bias` added to choose, not to weigh
    num_groups: int = 1  # DeepSeek: experts in groups, the top k chosen in the best `topk_groups` of them
    topk_groups: int = 1
    group_score: str = "max"  # a group's score: its best expert ("max", V2) or its best two summed ("top2", V3)
    routed_scaling: float = 1.0  # DeepSeek: the routed experts' weights times this
    fp32_router: bool = False  # DeepSeek: the router's product in fp32 whatever the model dtype
    router_bias: bool = False  # gpt-oss: the router's scores have a bias (it chooses and weighs)
    expert_bias: bool = False  # gpt-oss: each expert's gate, up and down projections have biases
    swiglu_limit: float | None = None  # gpt-oss: gate clamped above, up to +-limit; (up + 1) * gate * sigmoid(alpha gate)
    swiglu_alpha: float = 1.702

    def is_sparse(self, layer_idx: int) -> bool:
        return self.sparse_layers[layer_idx] if self.sparse_layers else True

    @property
    def plain_routing(self) -> bool:
        """Softmax, the top k of every expert, weights unscaled: what the C expert kernel routes
        (its router product is fp32 whatever the weights' dtype, as `fp32_router` asks)."""
        return (self.scoring == "softmax" and not self.score_bias and self.num_groups == 1 and self.routed_scaling == 1.0
                and not self.router_bias)

    @property
    def plain_experts(self) -> bool:
        """SiLU-GLU experts without biases: what the C expert kernel computes."""
        return not self.expert_bias and self.swiglu_limit is None


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): keys and values come from one latent per token,
    `kv_lora_rank` wide (normalized), plus a `qk_rope_head_dim`-wide rotated key part shared by
    every head; the cache holds just those (`latent_dim` values a token and layer).

    A head's key is `[k_nope | k_rope]` with `k_nope = W_UK c` (`qk_nope_head_dim`), its value
    `W_UV c` (`v_head_dim`), `kv_b_proj` holding `W_UK | W_UV` per head. Queries come from `q_proj`,
    or with `q_lora_rank` from `q_b_proj(norm(q_a_proj(x)))`. DeepSeek rotates interleaved pairs
    (`rope_interleave`, V2 always); the model turns them into rotate-half order before rope, the
    same permutation for queries and keys, so every dot product is unchanged.
    """

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    rope_interleave: bool = True

    @property
    def latent_dim(self) -> int:
        """What the cache holds per token and layer: the latent and the rotated key part."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class LinearAttentionConfig:
    """A hybrid model's Gated DeltaNet layers (Qwen3-Next; `target/linear_attention.py`): a causal
    short convolution over q, k and v, then the gated delta rule's recurrent state per value head,
    `[key_head_dim, value_head_dim]`; each key head serves num_value_heads // num_key_heads value heads."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    layers: tuple[int, ...]  # the linear-attention layers (the rest are full attention)
    # Qwen3.5: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a; Qwen3-Next: in_proj_qkvz and
    # in_proj_ba, grouped by key head
    split_projections: bool = False
    # value head j reads key head j mod num_key_heads (llama.cpp's Qwen3.5 GGUFs); False: j // (Hv / Hk)
    tiled_value_heads: bool = False

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim


@dataclass
class ModelConfig:
    """Shapes and hyper-parameters of one decoder (Llama, Qwen2/3, Mistral, Gemma 2/3, Phi-3,
    SmolLM3, Granite, and the MoE / MLA families)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False  # Qwen2 has biases on q/k/v
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    hf_config: Any = None  # kept for rope initialisation (scaling types live in transformers)
    # Features beyond Llama's layer; the defaults are Llama's.
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over each head of q and k, before rope
    gemma_norms: bool = False  # RMSNorm scales by (1 + w) in fp32; norms after attention and the MLP too
    embedding_scale: float | None = None  # Gemma: embeddings times sqrt(hidden_size)
    hidden_act: str = "silu"  # the MLP's gate activation: "silu" or "gelu_pytorch_tanh" (Gemma)
    query_scale: float | None = None  # attention scale; None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar)
    attn_logit_softcap: float | None = None  # Gemma 2: scores = cap * tanh(scores / cap)
    final_logit_softcap: float | None = None  # Gemma 2: logits = cap * tanh(logits / cap)
    sliding_windows: tuple[int | None, ...] = ()  # per layer: a query at p sees keys in (p - w, p]; (): none
    local_rope_layers: tuple[bool, ...] = ()  # per layer: rope of the "sliding_attention" type (Gemma 3)
    fused_checkpoint: bool = False  # Phi-3: the checkpoint stores qkv_proj and gate_up_proj fused
    qk_norm_full: bool = False  # OLMoE: q and k RMS-normalised over all their heads at once (not per head)
    o_bias: bool = False  # OLMoE with attention_bias, gpt-oss: o_proj has a bias too
    attention_sinks: bool = False  # gpt-oss: a learned logit per head joins each softmax (`self_attn.sinks`)
    clip_qkv: float | None = None  # OLMoE: q, k and v clamped to [-clip, clip]
    nope_layers: tuple[bool, ...] = ()  # per layer: no rotary embedding at all (SmolLM3: every 4th); (): none
    rotary_dim: int | None = None  # dims of each head rope turns (the first ones); None: all (head_dim)
    rope_pairs: bool = False  # GLM-4: rope turns pairs (0, 1), (2, 3), ... (GPT-J's order), not halves
    glm_norms: bool = False  # GLM-4: the attention's and the MLP's outputs RMS-normalised before their adds
    fused_gate_up: bool = False  # GLM-4: the checkpoint stores gate_up_proj fused (q/k/v apart)
    residual_scale: float | None = None  # Granite: each block's output times this before its residual add
    logit_divisor: float | None = None  # Granite: logits divided by `logits_scaling`
    moe: MoEConfig | None = None  # sparse MLPs (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, DeepSeek); None: dense
    mla: MLAConfig | None = None  # multi-head latent attention (DeepSeek-V2/V3); None: GQA
    # hybrid models (Qwen3-Next): the Gated DeltaNet layers' shapes, and which layers they are
    linear: LinearAttentionConfig | None = None
    offset_norms: bool = False  # Qwen3-Next: RMSNorm scales by (1 + w) in fp32 (Gemma's norm, not its layer)
    attn_output_gate: bool = False  # Qwen3-Next: q_proj also gives a per-head gate, out * sigmoid(gate)

    def is_moe_layer(self, layer_idx: int) -> bool:
        return self.moe is not None and self.moe.is_sparse(layer_idx)

    def is_linear_layer(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx` is a Gated DeltaNet layer (a hybrid model's linear attention)."""
        return self.linear is not None and layer_idx in self.linear.layers

    def window(self, layer_idx: int) -> int | None:
        """Layer `layer_idx`'s sliding window (None: it attends to every earlier key)."""
        return self.sliding_windows[layer_idx] if self.sliding_windows else None

    def llama_layer_differences(self) -> list[str]:
        """What in this model's layers differs from Llama's (empty for Llama, Qwen2, Mistral
        without a window): what the C layer loop and SmoothQuant's folds assume."""
        features = {
            "q/k norms": self.qk_norm, "Gemma norms": self.gemma_norms,
            "embedding scale": self.embedding_scale is not None, f"{self.hidden_act} MLP": self.hidden_act != "silu",
            "query scale": self.query_scale is not None, "attention soft-capping": self.attn_logit_softcap is not None,
            "logit soft-capping": self.final_logit_softcap is not None,
            "sliding windows": any(w is not None for w in self.sliding_windows),
            "local rope": any(self.local_rope_layers), "fused checkpoint projections": self.fused_checkpoint,
            "whole-width q/k norms": self.qk_norm_full, "o_proj bias": self.o_bias,
            "q/k/v clipping": self.clip_qkv is not None, "multi-head latent attention": self.mla is not None,
            "no-rope layers": any(self.nope_layers), "partial rotary": self.rotary_dim is not None, "residual scale": self.residual_scale is not None,
            "rope pairs": self.rope_pairs, "GLM norms": self.glm_norms,
            "fused checkpoint gate_up": self.fused_gate_up, "attention sinks": self.attention_sinks,
            "linear attention": self.linear is not None, "offset norms": self.offset_norms,
            "attention output gate": self.attn_output_gate,
        }
        return [name for name, present in features.items() if present]

    def c_loop_differences(self) -> list[str]:
        """What in this model's layers the C layer loop (`decoder.c`) does not implement: Llama's
        layer plus per-head q/k norms (Qwen3, Qwen3-MoE), MoE blocks and multi-head latent
        attention (DeepSeek-V2/V3, whose query scale the loop takes too)."""
        taken = {"q/k norms"} | ({"multi-head latent attention", "query scale"} if self.mla is not None else set())
        return [d for d in self.llama_layer_differences() if d not in taken]

    def unquantized_reason(self) -> str | None:
        """Why this family runs unquantized by default (`family_quant`); None where the quantized
        path implements its layers."""
        blocking = [d for d in self.llama_layer_differences()
                    if d in ("Gemma norms", "GLM norms", "fused checkpoint projections", "fused checkpoint gate_up",
                             "linear attention", "offset norms", "attention output gate")]
        if not blocking:
            return None
        return f"its {' and '.join(blocking)} differ from the Llama layers SmoothQuant and the fused kernels assume"

    @classmethod
    def from_hf(cls, hf_config: Any) -> "ModelConfig":
        """Read a transformers `PretrainedConfig`; raise `UnsupportedModelError` for other families.
        A multimodal Gemma 3 config (`Gemma3ForConditionalGeneration`: 4B, 12B, 27B) is read as its
        text model (`text_config`); its vision tower is not loaded."""
        if getattr(hf_config, "model_type", "") in TEXT_OF_MULTIMODAL and getattr(hf_config, "text_config", None):
            text = hf_config.text_config
            text.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", text.tie_word_embeddings))
            if getattr(hf_config, "eos_token_id", None) is not None:
                text.eos_token_id = hf_config.eos_token_id
            return cls.from_hf(text)
        model_type = _model_type(hf_config)
        heads = hf_config.num_attention_heads
        mla = _mla_config(hf_config, model_type)
        num_layers = hf_config.num_hidden_layers
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
        if mla is not None:  # the rotary tables' width; the attention's shapes are in `mla`
            head_dim = mla.qk_rope_head_dim
        eos = hf_config.eos_token_id
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        attention_bias = bool(getattr(hf_config, "attention_bias", False)) or model_type == "qwen2"
        if model_type == "qwen2_moe":
            attention_bias = bool(getattr(hf_config, "qkv_bias", True))
        olmoe = model_type == "olmoe"
        granite = model_type == "granite"
        glm = model_type == "glm4"
        gpt_oss = model_type == "gpt_oss"
        gemma = model_type in GEMMA_TYPES
        hidden_act = getattr(hf_config, "hidden_activation", None) if gemma else None
        hidden_act = hidden_act or getattr(hf_config, "hidden_act", "silu")
        if hidden_act not in ACTIVATIONS:
            raise UnsupportedModelError(f"activation {hidden_act!r} is not supported; specdec runs {ACTIVATIONS}")
        rotary_dim = head_dim if mla is not None else _rotary_dim(hf_config, head_dim)
        if getattr(hf_config, "use_bidirectional_attention", False):
            raise UnsupportedModelError("bidirectional attention (an encoder configuration) is not supported")
        linear = _linear_config(hf_config, model_type, num_layers)
        windows = _sliding_windows(hf_config, num_layers)
        hybrid = model_type in HYBRID_TYPES
        return cls(
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            rms_norm_eps=hf_config.rms_norm_eps,
            attention_bias=attention_bias,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            max_position_embeddings=_max_positions(hf_config),
            eos_token_ids=eos_ids,
            bos_token_id=getattr(hf_config, "bos_token_id", None),
            hf_config=hf_config,
            qk_norm=model_type in ("qwen3", "gemma3_text", "qwen3_moe", *HYBRID_TYPES),
            gemma_norms=gemma,
            embedding_scale=hf_config.hidden_size**0.5 if gemma else (hf_config.embedding_multiplier if granite else None),
            hidden_act=hidden_act,
            query_scale=(hf_config.query_pre_attn_scalar**-0.5 if gemma else
                         hf_config.attention_multiplier if granite else _mla_scale(hf_config, mla)),
            attn_logit_softcap=getattr(hf_config, "attn_logit_softcapping", None) if gemma else None,
            final_logit_softcap=getattr(hf_config, "final_logit_softcapping", None) if gemma else None,
            sliding_windows=windows,
            local_rope_layers=_local_rope_layers(hf_config, num_layers),
            fused_checkpoint=model_type == "phi3",
            qk_norm_full=olmoe,
            o_bias=(olmoe or gpt_oss) and attention_bias,
            attention_sinks=gpt_oss,
            clip_qkv=getattr(hf_config, "clip_qkv", None) if olmoe else None,
            nope_layers=tuple(not use for use in hf_config.no_rope_layers) if model_type == "smollm3" else (),
            rotary_dim=rotary_dim if rotary_dim < head_dim else None,
            rope_pairs=glm,
            glm_norms=glm,
            fused_gate_up=glm,
            residual_scale=hf_config.residual_multiplier if granite else None,
            logit_divisor=hf_config.logits_scaling if granite else None,
            moe=_moe_config(hf_config, model_type, num_layers),
            mla=mla,
            linear=linear,
            offset_norms=hybrid,
            attn_output_gate=hybrid,
        )


def _model_type(hf_config: Any) -> str:
    """The config's model_type when we implement it; `UnsupportedModelError` naming what we do."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    model_type = getattr(hf_config, "model_type", "")
    if model_type in SUPPORTED_ARCHITECTURES.values():
        return model_type
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return SUPPORTED_ARCHITECTURES[arch]
    hint = ""
    if model_type == "gemma3" or "Gemma3ForConditionalGeneration" in archs:
        hint = " (a multimodal Gemma 3 config needs its text_config)"
    raise UnsupportedModelError(
        f"unsupported architecture {archs or model_type!r}{hint}; specdec supports "
        f"{', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _moe_config(hf_config: Any, model_type: str, num_layers: int) -> MoEConfig | None:
    """The sparse MLP of an MoE family, with its dense layers (Qwen's `decoder_sparse_step`,
    `mlp_only_layers`); None for a dense family."""
    if model_type not in MOE_TYPES:
        return None
    num_experts = getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", None)
    if model_type in HYBRID_TYPES and not num_experts:
        return None  # a dense hybrid
    top_k = hf_config.num_experts_per_tok
    if not num_experts or not 0 < top_k <= num_experts:
        raise UnsupportedModelError(f"{model_type}: {top_k} experts a token out of {num_experts} is not a mixture")
    sparse: tuple[bool, ...] = ()
    if model_type in ("qwen3_moe", "qwen2_moe", "qwen3_next"):
        step, dense = hf_config.decoder_sparse_step or 1, set(hf_config.mlp_only_layers or ())
        sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
    if model_type in MLA_TYPES:
        return _deepseek_moe(hf_config, model_type, num_experts, top_k, num_layers)
    gpt_oss = model_type == "gpt_oss"  # top k of the biased logits, softmax over them: renormalized
    return MoEConfig(
        num_experts=num_experts,
        top_k=top_k,
        expert_size=getattr(hf_config, "moe_intermediate_size", None) or hf_config.intermediate_size,
        norm_topk=(model_type in ("mixtral", "qwen3_5_moe_text") or gpt_oss
                   or bool(getattr(hf_config, "norm_topk_prob", False))),
        router_bias=gpt_oss, expert_bias=gpt_oss,
        swiglu_limit=float(hf_config.swiglu_limit) if gpt_oss else None,
        swiglu_alpha=float(getattr(hf_config, "swiglu_alpha", 1.702)),
        shared_expert_size=(getattr(hf_config, "shared_expert_intermediate_size", 0) or 0) if model_type in ("qwen2_moe", *HYBRID_TYPES) else 0,
        sparse_layers=sparse,
    )


def _deepseek_moe(hf_config: Any, model_type: str, num_experts: int, top_k: int, num_layers: int) -> MoEConfig:
    """DeepSeek's sparse MLP as transformers runs it: the first `first_k_dense_replace` layers
    dense; V2 softmax scores ("greedy", or "group_limited_greedy": groups by their best expert), no
    renormalization; V3 sigmoid scores with a choosing bias, groups by their best two experts."""
    v3 = model_type == "deepseek_v3"
    method = getattr(hf_config, "topk_method", None) or "greedy"
    if not v3 and method not in ("greedy", "group_limited_greedy"):
        raise UnsupportedModelError(f"deepseek_v2: topk_method {method!r} is not supported (greedy, group_limited_greedy)")
    grouped = v3 or method == "group_limited_greedy"
    groups = (getattr(hf_config, "n_group", None) or 1) if grouped else 1
    topk_groups = (getattr(hf_config, "topk_group", None) or 1) if grouped else 1
    if num_experts % groups or not 0 < topk_groups <= groups or topk_groups * (num_experts // groups) < top_k:
        raise UnsupportedModelError(
            f"{model_type}: {num_experts} experts in {groups} groups, the best {topk_groups} kept, cannot give "
            f"{top_k} experts a token")
    first_dense = getattr(hf_config, "first_k_dense_replace", 0) or 0
    shared = (getattr(hf_config, "n_shared_experts", 0) or 0) * hf_config.moe_intermediate_size
    return MoEConfig(
        num_experts=num_experts, top_k=top_k, expert_size=hf_config.moe_intermediate_size,
        norm_topk=v3 and bool(getattr(hf_config, "norm_topk_prob", False)),
        shared_expert_size=shared, shared_expert_gated=False,
        sparse_layers=tuple(i >= first_dense for i in range(num_layers)),
        scoring="sigmoid" if v3 else "softmax", score_bias=v3, num_groups=groups, topk_groups=topk_groups,
        group_score="top2" if v3 else "max", routed_scaling=float(getattr(hf_config, "routed_scaling_factor", 1.0)),
        fp32_router=True,
    )


def _mla_config(hf_config: Any, model_type: str) -> MLAConfig | None:
    if model_type not in MLA_TYPES:
        return None
    mla = MLAConfig(
        kv_lora_rank=hf_config.kv_lora_rank, qk_nope_head_dim=hf_config.qk_nope_head_dim,
        qk_rope_head_dim=hf_config.qk_rope_head_dim, v_head_dim=hf_config.v_head_dim,
        q_lora_rank=getattr(hf_config, "q_lora_rank", None) or None,
        rope_interleave=model_type == "deepseek_v2" or bool(getattr(hf_config, "rope_interleave", True)),
    )
    if mla.qk_rope_head_dim % 2:
        raise UnsupportedModelError(f"{model_type}: the rope part must have an even width, got {mla.qk_rope_head_dim}")
    return mla


def _mla_scale(hf_config: Any, mla: MLAConfig | None) -> float | None:
    """MLA's softmax scale: `qk_head_dim ** -0.5`, times YaRN's `mscale(factor, mscale_all_dim) ** 2`
    where the rope is scaled (DeepSeek's long-context checkpoints)."""
    if mla is None:
        return None
    scale = mla.qk_head_dim**-0.5
    params = rope_parameters(hf_config)
    if params["rope_type"] != "default" and (mscale_all_dim := params.get("mscale_all_dim")):
        factor = params["factor"]
        if factor > 1:
            mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0
            scale *= mscale * mscale
    return scale


def _sliding_windows(hf_config: Any, num_layers: int) -> tuple[int | None, ...]:
    """Per layer window, from `layer_types` (Gemma, Qwen2/3 with `use_sliding_window`) or, without
    it, `sliding_window` on every layer (Mistral, Phi-3). () when no layer has one."""
    window = getattr(hf_config, "sliding_window", None)
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None:
        unknown = sorted(set(layer_types) - set(LAYER_TYPES) - ({"linear_attention"} if _hybrid(hf_config) else set()))
        if unknown:
            raise UnsupportedModelError(f"layer types {unknown} are not supported; specdec runs {LAYER_TYPES}")
    if not window:
        return ()
    if layer_types is None:
        return (int(window),) * num_layers
    windows = tuple(int(window) if t == "sliding_attention" else None for t in layer_types[:num_layers])
    return windows if any(w is not None for w in windows) else ()


def _hybrid(hf_config: Any) -> bool:
    return getattr(hf_config, "model_type", "") in HYBRID_TYPES or any(
        SUPPORTED_ARCHITECTURES.get(a) in HYBRID_TYPES for a in getattr(hf_config, "architectures", None) or [])


def _linear_config(hf_config: Any, model_type: str, num_layers: int) -> LinearAttentionConfig | None:
    """A hybrid model's Gated DeltaNet layers (`layer_types` "linear_attention"); None otherwise."""
    if model_type not in HYBRID_TYPES:
        return None
    types = list(hf_config.layer_types)[:num_layers]
    return LinearAttentionConfig(
        num_key_heads=hf_config.linear_num_key_heads,
        num_value_heads=hf_config.linear_num_value_heads,
        key_head_dim=hf_config.linear_key_head_dim,
        value_head_dim=hf_config.linear_value_head_dim,
        conv_kernel=hf_config.linear_conv_kernel_dim,
        layers=tuple(i for i, t in enumerate(types) if t == "linear_attention"),
        split_projections=model_type in QWEN35_TYPES or bool(getattr(hf_config, "linear_split_projections", False)),
        tiled_value_heads=bool(getattr(hf_config, "linear_value_heads_tiled", False)),
    )


def _local_rope_layers(hf_config: Any, num_layers: int) -> tuple[bool, ...]:
    """Gemma 3 names rope parameters per layer type; its sliding layers take the local ones."""
    if not layer_typed(hf_config):
        return ()
    layer_types = hf_config.layer_types[:num_layers]
    return tuple(t == "sliding_attention" for t in layer_types)


def _rotary_dim(hf_config: Any, head_dim: int) -> int:
    """The dims of each head rope turns: all, or the share `partial_rotary_factor` names (Phi-4-mini
    0.75), the same for every layer type; a share of no even width is refused."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    factors = {p.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None)) or 1.0
               for p in (params.values() if layer_typed(hf_config) else [params])}
    if len(factors) > 1:
        raise UnsupportedModelError(f"partial rotary factors that differ by layer type ({sorted(factors)}) are not supported")
    rotary = int(head_dim * float(factors.pop()))
    if not 0 < rotary <= head_dim or rotary % 2:
        raise UnsupportedModelError(f"a rotary width of {rotary} of a {head_dim}-wide head is not supported")
    return rotary


def _max_positions(hf_config: Any) -> int:
    """`max_position_embeddings`, capped for "longrope" (Phi-3 128k) at the original length: its
    short factors, the ones transformers uses up to that length, are exact there; the long ones
    would change the keys already cached, so longer contexts are not offered."""
    max_pos = getattr(hf_config, "max_position_embeddings", 4096)
    params = getattr(hf_config, "rope_parameters", None) or {}
    if params.get("rope_type") == "longrope":
        original = params.get("original_max_position_embeddings") or hf_config.original_max_position_embeddings
        if original < max_pos:
            log.info(
                "longrope: context limited to %d positions (of %d): beyond that transformers switches every "
                "position to the long factors, which cached keys cannot follow", original, max_pos,
            )
            return int(original)
    return max_pos
