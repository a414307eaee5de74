"""A model's weights, one tensor at a time, by Hugging Face parameter name, from safetensors or GGUF.

The loaders (`model_weights`, `quantized_stream`) never hold more of a checkpoint than the tensors
they are converting: `read(name)` reads one tensor from the mapped file.

- a folder of `*.safetensors`: `safe_open` on each file;
- a folder whose weights are a GGUF file (`model_files` puts `model.gguf` beside config.json and
  the tokenizer): GGUF names map to HF names as transformers maps them
  (`get_gguf_hf_weights_map`), and each tensor goes through transformers' per-architecture
  processor (llama.cpp permutes Llama's q/k rows: undone), so values equal transformers' own
  GGUF loading.

    >>> with open_checkpoint(folder) as reader:        # doctest: +SKIP
    ...     reader.read("model.layers.0.self_attn.q_proj.weight").shape
    torch.Size([1536, 1536])
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from safetensors import safe_open

from specdec.target.default_pair import PARTS_NAME, read_parts_manifest, verified_sha256
from specdec.target.gguf_file import GGUFFile

GGUF_NAME = "model.gguf"  # the weights of a folder made from a GGUF file (a link to it)
GGUF_NAMES = "gguf_names.json"  # beside it: which GGUF tensor is which HF parameter


class CheckpointReader(Protocol):
    def names(self) -> list[str]:
        """Every tensor of the checkpoint, by Hugging Face parameter name."""

    def read(self, name: str) -> torch.Tensor:
        """Tensor `name` (float32 from GGUF blocks; the stored dtype from safetensors)."""

    def rows_in_place(self, name: str) -> str | None:
        """The GGUF name of tensor `name` where its rows can be looked up as stored, else None."""

    def blocks(self, name: str) -> tuple[np.ndarray, int] | None:
        """Tensor `name` as the file stores it, `(raw [out, row bytes] uint8, ggml type)`, where
        those bytes are its values (a GGUF tensor no processor changes, or one expert of a stacked
        one), else None."""

    def release_pages(self) -> None:
        """Stop holding the file pages read so far as this process's memory (they stay cached)."""


def weight_files(folder: Path) -> list[Path]:
    """The files that say where a folder's weights are (what a cache of its conversion is keyed
    on): the GGUF link, the manifest of a GGUF's parts, or the safetensors."""
    for name in (GGUF_NAME, PARTS_NAME):
        if (Path(folder) / name).exists():
            return [Path(folder) / name]
    return sorted(Path(folder).glob("*.safetensors"))


def checkpoint_sha256(folder: Path) -> str | None:
    """The sha256 of a folder's weights where something already vouched for it (the default
    pair's GGUF files, checked once when installed: `default_pair`); None otherwise."""
    listed = read_parts_manifest(folder)
    if listed is not None:
        return listed[1]
    gguf = Path(folder) / GGUF_NAME
    return verified_sha256(gguf.resolve()) if gguf.exists() else None


def gguf_paths(folder: Path) -> list[Path] | None:
    """The GGUF file of a folder (its parts, in order, for the default pair's); None if it has none."""
    folder = Path(folder)
    if (folder / GGUF_NAME).exists():
        return [(folder / GGUF_NAME).resolve()]
    if (folder / PARTS_NAME).exists():
        listed = read_parts_manifest(folder)
        if listed is None:
            raise ValueError(f"the GGUF parts listed in {folder / PARTS_NAME} changed since they were "
                             f"checked; resolve the model again (specdec checks them once more)")
        return listed[0]
    return None


@contextlib.contextmanager
def open_checkpoint(folder: Path):
    """A `CheckpointReader` over the weights of `folder` (see the module docstring)."""
    folder = Path(folder)
    paths = gguf_paths(folder)
    if paths is not None:
        yield GGUFCheckpoint(paths, folder)
        return
    files = weight_files(folder)
    if not files:
        raise ValueError(f"{folder} has no *.safetensors files (nor a {GGUF_NAME})")
    with contextlib.ExitStack() as stack:
        yield SafetensorsCheckpoint([stack.enter_context(safe_open(str(f), "pt", "cpu")) for f in files])


class SafetensorsCheckpoint:
    def __init__(self, handles: list) -> None:
        self._where = {name: h for h in handles for name in h.keys()}

    def names(self) -> list[str]:
        return list(self._where)

    def rows_in_place(self, name: str) -> None:
        return None  # safetensors tables are read whole

    def blocks(self, name: str) -> None:
        return None  # no quantized blocks

    def read(self, name: str) -> torch.Tensor:
        return self._where[name].get_tensor(name)

    def release_pages(self) -> None:
        pass  # the mapping is safetensors' own, and its tensors may view it


# llama.cpp architectures whose tensors are written as another's (llama's q/k row order)
_PROCESSED_AS = {"smollm3": "llama", "granite": "llama"}

# GGUF tensors that are read into config.json, not weights: name -> where (`model_files.gguf_config`)
FOLDED_INTO_CONFIG = {"rope_freqs.weight": "rope_parameters (llama3 scaling)",
                      "rope_factors_short.weight": "rope_parameters (longrope)",
                      "rope_factors_long.weight": "rope_parameters (longrope)"}


class GGUFCheckpoint:
    """The tensors of a GGUF file (one file, or its parts in order) under their Hugging Face
    names (config.json of `folder`)."""

    def __init__(self, paths: list[Path], folder: Path) -> None:
        from transformers import AutoConfig
        from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

        self.file = GGUFFile.open(paths)
        hf_config = AutoConfig.from_pretrained(str(folder))
        architecture = self.file.metadata["general.architecture"]
        processor = TENSOR_PROCESSORS.get(_PROCESSED_AS.get(architecture, architecture), TensorProcessor)
        self._processor = processor(config=hf_config.to_dict())
        self._transform: dict[str, Any] = {}  # HF name -> what turns the stored tensor into it (hybrids)
        if architecture in HYBRID_ARCHS:  # not in transformers' GGUF tables
            to_hf, self._transform = hybrid_names(self.file.tensors)
        else:
            to_hf = _saved_names(folder, lambda: gguf_to_hf_names(hf_config, self._processor))
        self._gguf_name = {to_hf[g]: g for g in self.file.tensors if g in to_hf}
        self._split: dict[str, tuple[str, int]] = {}  # HF name -> (stored tensor, which half of its rows)
        for gguf_name in self.file.tensors:
            if architecture == "qwen3next" and (m := _SSM_BA.fullmatch(gguf_name)):  # b and a, grouped by key head
                for half, proj in enumerate(("b", "a")):
                    self._split[f"model.layers.{m['layer']}.linear_attn.in_proj_{proj}.weight"] = (gguf_name, half)
        self._expert: dict[str, tuple[str, int]] = {}  # per-expert name -> (stacked tensor, expert)
        self._kv_b: dict[str, tuple[str, str]] = {}  # kv_b_proj -> (attn_k_b, attn_v_b) where split
        for gguf_name in self.file.tensors:
            if m := _DEEPSEEK2.fullmatch(gguf_name):  # what gguf-py's name table does not map
                layer = f"model.layers.{m['layer']}"
                if m["kind"] == "exp_probs_b.bias":
                    self._gguf_name[f"{layer}.mlp.gate.e_score_correction_bias"] = gguf_name
                elif m["kind"] == "attn_k_b.weight":
                    self._kv_b[f"{layer}.self_attn.kv_b_proj.weight"] = (gguf_name, f"blk.{m['layer']}.attn_v_b.weight")
            if architecture == "gpt-oss" and (m := _SINKS.fullmatch(gguf_name)):  # HF's name has no `.weight`
                self._gguf_name[f"model.layers.{m['layer']}.self_attn.sinks"] = gguf_name
            if gguf_name not in to_hf and (m := _DENSE_FFN.fullmatch(gguf_name)):  # a dense layer of an MoE arch
                self._gguf_name[f"model.layers.{m['layer']}.mlp.{m['proj']}_proj.weight"] = gguf_name
            if m := _STACKED_EXPERTS.fullmatch(gguf_name):
                self._gguf_name.pop(to_hf.get(gguf_name), None)  # transformers' name for the whole stack
                for e in range(self.file.tensors[gguf_name].shape[0]):
                    name = f"model.layers.{m['layer']}.mlp.experts.{e}.{m['proj']}_proj.{m['kind']}"
                    self._gguf_name[name] = gguf_name
                    self._expert[name] = (gguf_name, e)
        self._check_every_tensor_read()

    def _check_every_tensor_read(self) -> None:
        """Refuse a file with a tensor that nothing reads: run without it, the model would be
        another one (Llama 3.1's rope_freqs once was). Tensors folded into config.json are read."""
        read = {*self._gguf_name.values(), *(n for pair in self._kv_b.values() for n in pair), *FOLDED_INTO_CONFIG,
                *(n for n, _ in self._split.values())}
        unread = [name for name in self.file.tensors if name not in read]
        if unread:
            from specdec.target.config import UnsupportedModelError

            shown = ", ".join(unread[:4]) + (f" and {len(unread) - 4} more" if len(unread) > 4 else "")
            raise UnsupportedModelError(f"{self.file.path.name}: specdec reads no tensor {shown} "
                                        f"({self.file.metadata.get('general.architecture')!r} files)")

    def names(self) -> list[str]:
        return [*self._gguf_name, *self._kv_b, *self._split]

    def rows_in_place(self, name: str) -> str | None:
        """The GGUF name of tensor `name` when its rows can be used as stored (an embedding left
        in the file: `gguf_embedding`), else None."""
        from specdec.target.gguf_embedding import plain_rows

        gguf_name = self._gguf_name.get(name)
        if gguf_name is None or name in self._transform:
            return None
        return gguf_name if plain_rows(self._processor, self.file, gguf_name) else None

    def blocks(self, name: str) -> tuple[np.ndarray, int] | None:
        if name in self._expert:
            gguf_name, e = self._expert[name]
            return self.file.raw(gguf_name)[e], self.file.tensors[gguf_name].ggml_type
        gguf_name = self._gguf_name.get(name)
        if gguf_name is None or self.rows_in_place(name) is None:
            return None
        return self.file.raw(gguf_name), self.file.tensors[gguf_name].ggml_type

    def release_pages(self) -> None:
        self.file.data.release_pages()

    def read(self, name: str) -> torch.Tensor:
        if name in self._kv_b:  # W_UK [H, rank, nope] and W_UV [H, v, rank] back into kv_b_proj
            k_b, v_b = (torch.from_numpy(np.array(self.file.dequantize(n))).float() for n in self._kv_b[name])
            return torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(-1, k_b.shape[1])
        if name in self._expert:  # one expert of a stacked tensor: only its blocks are dequantized
            gguf_name, e = self._expert[name]
            return torch.from_numpy(self.file.dequantize_slice(gguf_name, e)).float()
        if name in self._split:  # Qwen3-Next's ssm_ba: per key head, its value heads' b rows, then their a rows
            gguf_name, half = self._split[name]
            ba = torch.from_numpy(np.array(self.file.dequantize(gguf_name))).float()
            groups = self._key_heads(gguf_name)
            return ba.view(groups, 2, -1, ba.shape[-1])[:, half].reshape(-1, ba.shape[-1])
        gguf_name = self._gguf_name[name]
        if name in self._transform:
            return self._transform[name](torch.from_numpy(np.array(self.file.dequantize(gguf_name))).float())
        weights = self._processor.process(weights=self.file.dequantize(gguf_name), name=gguf_name).weights
        if not (weights.flags.writeable and weights.flags.c_contiguous):  # a view of the mapped file
            weights = np.array(weights)
        return torch.from_numpy(weights).float()


    def _key_heads(self, gguf_name: str) -> int:
        return int(self.file.metadata[f"{self.file.metadata['general.architecture']}.ssm.group_count"])


# llama.cpp's hybrid architectures (Gated DeltaNet + attention), read by `hybrid_names`
HYBRID_ARCHS = ("qwen3next", "qwen35", "qwen35moe")
_SSM_BA = re.compile(r"blk\.(?P<layer>\d+)\.ssm_ba\.weight")
_HYBRID_LAYER = re.compile(r"blk\.(?P<layer>\d+)\.(?P<rest>.+)")
# a hybrid layer's tensors -> its HF names (ours), and how llama.cpp's converter changed them
_HYBRID_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight", "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight", "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_alpha.weight": "linear_attn.in_proj_a.weight", "ssm_beta.weight": "linear_attn.in_proj_b.weight",
    "ssm_a": "linear_attn.A_log", "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_dt.bias": "linear_attn.dt_bias", "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight", "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight", "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}
_HYBRID_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight",
                  "output_norm.weight": "model.norm.weight"}


def _minus_one(t: torch.Tensor) -> torch.Tensor:  # llama.cpp stores the (1 + w) norms as 1 + w
    return t - 1


def hybrid_names(tensors) -> tuple[dict[str, str], dict[str, Any]]:
    """`({gguf name: HF name}, {HF name: transform})` of a llama.cpp hybrid GGUF, undoing what its
    converter did: norms stored as 1 + w (all but the gated norm of the linear layers), `A_log`
    stored as A = -exp(A_log), the convolution's kernel squeezed to [C, K] (and a one-row shared
    expert gate to a vector)."""
    names: dict[str, str] = {}
    transforms: dict[str, Any] = {}
    for gguf_name in tensors:
        if gguf_name in _HYBRID_GLOBAL:
            names[gguf_name] = hf = _HYBRID_GLOBAL[gguf_name]
        elif (m := _HYBRID_LAYER.fullmatch(gguf_name)) and m["rest"] in _HYBRID_TENSORS:
            names[gguf_name] = hf = f"model.layers.{m['layer']}.{_HYBRID_TENSORS[m['rest']]}"
        else:
            continue
        if hf.endswith("norm.weight") and not hf.endswith("linear_attn.norm.weight"):
            transforms[hf] = _minus_one
        elif hf.endswith(".A_log"):
            transforms[hf] = lambda a: torch.log(-a)
        elif hf.endswith(".conv1d.weight"):
            transforms[hf] = lambda w: w.reshape(w.shape[0], 1, -1)
        elif hf.endswith(".shared_expert_gate.weight"):  # [1, hidden], which a file may keep as [hidden]
            transforms[hf] = lambda w: w.reshape(1, -1)
    return names, transforms


def gguf_to_hf_names(hf_config, processor) -> dict[str, str]:
    """`{gguf name: HF name}` for the model `hf_config` describes.

    transformers walks a model built on the meta device; ours has the Hugging Face names and
    builds without importing transformers' model classes (~5 s). transformers also builds
    gguf-py's name table (every architecture's patterns for every block) once per submodule it
    walks: 371 times, 8.5 s for Qwen2.5-1.5B. One table per call serves them all.
    """
    import gguf
    from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

    from specdec.target.config import ModelConfig
    from specdec.target.model import LlamaForCausalLM

    with torch.device("meta"):
        skeleton = LlamaForCausalLM(ModelConfig.from_hf(hf_config))
    build = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.cache(build)  # the function imports it from gguf per call
    model_type = _GGUF_ARCH.get(hf_config.model_type, hf_config.model_type)  # llama.cpp's arch
    try:
        return get_gguf_hf_weights_map(skeleton, processor, model_type, hf_config.num_hidden_layers)
    finally:
        gguf.get_tensor_name_map = build


# transformers' model types llama.cpp writes under another architecture name
_GGUF_ARCH = {"mixtral": "llama", "deepseek_v2": "deepseek2", "deepseek_v3": "deepseek2"}


def _saved_names(folder: Path, compute) -> dict[str, str]:
    """The `{gguf name: HF name}` map kept beside a GGUF folder's config (`GGUF_NAMES`): building
    it takes ~2.5 s in a fresh process (gguf-py's name tables, a skeleton model), so it is built
    once per folder and saved."""
    saved = folder / GGUF_NAMES
    with contextlib.suppress(OSError, ValueError):
        names = json.loads(saved.read_text())
        if isinstance(names, dict):
            return names
    names = compute()
    with contextlib.suppress(OSError):  # a read-only cache still loads, a little slower
        tmp = saved.with_name(f".{saved.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(names, sort_keys=True))
        os.replace(tmp, saved)
    return names


def param_sources(reader: CheckpointReader, param_names: list[str], config) -> dict[str, str]:
    """`{parameter name: checkpoint tensor name}` for every parameter of a model (`config`: its
    `ModelConfig`); a tied LM head the checkpoint leaves out reads the embedding. ValueError
    naming what is missing."""
    available = set(reader.names())
    sources = {}
    for name in param_names:
        found = [n for n in _candidates(name) if n in available]
        if found:
            sources[name] = found[0]
    if "lm_head.weight" in param_names and "lm_head.weight" not in sources and config.tie_word_embeddings:
        sources["lm_head.weight"] = sources.get("model.embed_tokens.weight", "model.embed_tokens.weight")
    missing = sorted(set(param_names) - set(sources))
    if missing:
        raise ValueError(f"the checkpoint lacks {len(missing)} weights of the model, e.g. {missing[:3]}")
    return sources


# A multimodal checkpoint keeps its text model under a prefix (Gemma 3 4B+: transformers >= 4.52
# writes `model.language_model.*`, the published checkpoints `language_model.model.*`); its image
# tower and projector are not part of the text model.
_TEXT_PREFIXES = (("model.", "model.language_model."), ("model.", "language_model.model."),
                  ("lm_head.", "language_model.lm_head."))
_IMAGE_PARTS = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


# llama.cpp stacks an MoE layer's experts: `blk.{i}.ffn_{gate,up,down}_exps.weight [E, out, in]`
# (gpt-oss: their biases too, `.bias [E, out]`)
_STACKED_EXPERTS = re.compile(r"blk\.(?P<layer>\d+)\.ffn_(?P<proj>gate|up|down)_exps\.(?P<kind>weight|bias)")
# DeepSeek's router bias, and the per-head halves of a split kv_b (llama.cpp #12801)
_DEEPSEEK2 = re.compile(r"blk\.(?P<layer>\d+)\.(?P<kind>exp_probs_b\.bias|attn_k_b\.weight)")
# gpt-oss's attention sinks (transformers: `self_attn.sinks`, which its name table does not find)
_SINKS = re.compile(r"blk\.(?P<layer>\d+)\.attn_sinks\.weight")
# ... and DeepSeek's dense layers' MLP as in dense models (gguf-py's MoE tables do not list them)
_DENSE_FFN = re.compile(r"blk\.(?P<layer>\d+)\.ffn_(?P<proj>gate|up|down)\.weight")
# Mixtral's checkpoints name its sparse MLP `block_sparse_moe` and an expert's gate / up / down
# projections w1 / w3 / w2.
_MIXTRAL = re.compile(r"(?P<layer>.*)\.mlp\.(?P<rest>gate\.weight|experts\.\d+\.(?P<proj>gate|up|down)_proj\.weight)$")
_MIXTRAL_W = {"gate": "w1", "up": "w3", "down": "w2"}


def _candidates(name: str) -> list[str]:
    """Where a parameter of the text model may sit in a checkpoint, most likely first."""
    names = [name] + [new + name[len(old):] for old, new in _TEXT_PREFIXES if name.startswith(old)]
    if m := _MIXTRAL.fullmatch(name):
        rest = m["rest"] if m["proj"] is None else m["rest"].replace(f"{m['proj']}_proj", _MIXTRAL_W[m["proj"]])
        names.append(f"{m['layer']}.block_sparse_moe.{rest}")
    if ".mlp.shared_expert." in name:  # DeepSeek's checkpoints: `shared_experts` (all of them as one MLP)
        names.append(name.replace(".mlp.shared_expert.", ".mlp.shared_experts."))
    return names


def is_image_part(name: str) -> bool:
    """A tensor of a multimodal checkpoint's image side, which the text model does not load."""
    return name.startswith(_IMAGE_PARTS)


def layer_index(name: str) -> int | None:
    """The decoder layer a parameter's name is under (`model.layers.<i>.`), or None."""
    if not name.startswith("model.layers."):
        return None
    return int(name.split(".", 3)[2])
