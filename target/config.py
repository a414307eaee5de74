"""Model configuration: the Llama-family fields our transformer needs, read from an HF config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "MistralForCausalLM",
)


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture is not one our Llama-family transformer implements."""


@dataclass
class ModelConfig:
    """Shapes and hyper-parameters of a Llama-family decoder (Llama, Qwen2, Mistral, SmolLM2)."""

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

    @classmethod
    def from_hf(cls, hf_config: Any) -> "ModelConfig":
        """Read a transformers `PretrainedConfig`; raise `UnsupportedModelError` for other families."""
        archs = list(getattr(hf_config, "architectures", None) or [])
        model_type = getattr(hf_config, "model_type", "")
        if not any(a in SUPPORTED_ARCHITECTURES for a in archs) and model_type not in (
            "llama",
            "qwen2",
            "mistral",
        ):
            raise UnsupportedModelError(
                f"unsupported architecture {archs or model_type!r}; specdec supports "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
        eos = hf_config.eos_token_id
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        attention_bias = bool(getattr(hf_config, "attention_bias", False)) or model_type == "qwen2"
        if getattr(hf_config, "sliding_window", None) and getattr(hf_config, "use_sliding_window", False):
            raise UnsupportedModelError("sliding-window attention is not supported yet")
        return cls(
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            rms_norm_eps=hf_config.rms_norm_eps,
            attention_bias=attention_bias,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            max_position_embeddings=getattr(hf_config, "max_position_embeddings", 4096),
            eos_token_ids=eos_ids,
            bos_token_id=getattr(hf_config, "bos_token_id", None),
            hf_config=hf_config,
        )
