"""Model specs -> a local folder with `config.json`, `*.safetensors` and tokenizer files.

A spec is one of:

- a local Hugging Face folder: returned as it is, once checked;
- a `.gguf` file: dequantized ONCE into `<cache>/converted/<stem>-<key>/` (fp32 safetensors, shards
  of at most 2 GB, + config.json + tokenizer files). The key is the file's sha256 when
  `default_pair` vouched for it, else a hash of its path, size and mtime, so a warm resolve never
  reads the weights;
- `"default-target"` / `"default-draft"`: the embedded Qwen2.5-Coder pair (`default_pair`);
- a hub id such as `Qwen/Qwen2.5-0.5B`: fetched with `huggingface_hub.snapshot_download`.

    >>> resolve_model("default-draft")   # doctest: +SKIP
    PosixPath('/root/.cache/specdec/converted/Qwen2.5-Coder-0.5B-Instruct-Q4_K_M-1d9614638d18')
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

from specdec.paths import cache_dir
from specdec.target.config import SUPPORTED_ARCHITECTURES, UnsupportedModelError
from specdec.target.default_pair import default_draft_gguf, default_target_gguf, verified_sha256

DEFAULT_TARGET_SPEC = "default-target"
DEFAULT_DRAFT_SPEC = "default-draft"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
_MAX_SHARD_SIZE = "2GB"


def resolve_model(spec: str, progress: bool = True) -> Path:
    """Turn a model spec into a local folder holding config.json, safetensors and tokenizer files.

    Raises `ValueError` with a clear message when the spec names nothing usable, and
    `default_pair.ModelsNotInstalledError` for the default specs without the `models` extra.
    """
    if spec == DEFAULT_TARGET_SPEC:
        return convert_gguf(default_target_gguf(progress=progress), progress=progress)
    if spec == DEFAULT_DRAFT_SPEC:
        return convert_gguf(default_draft_gguf(progress=progress), progress=progress)
    path = Path(spec).expanduser()
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ValueError(f"GGUF file {spec!r} does not exist.")
        return convert_gguf(path, progress=progress)
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
    """Return `folder` if it holds config.json and safetensors weights; ValueError otherwise."""
    if not folder.is_dir():
        raise ValueError(f"Model folder {str(folder)!r} does not exist.")
    if not (folder / "config.json").is_file():
        raise ValueError(
            f"Model folder {str(folder)!r} has no config.json; is it a Hugging Face model?"
        )
    if not any(folder.glob("*.safetensors")):
        hint = " (it only has PyTorch .bin weights; re-save them as safetensors)" if any(
            folder.glob("*.bin")
        ) else ""
        raise ValueError(f"Model folder {str(folder)!r} has no *.safetensors weights{hint}.")
    return folder


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


def converted_dir(gguf_file: Path) -> Path:
    """Where the conversion of `gguf_file` lives: `<cache>/converted/<stem>-<12 hex key>`."""
    sha = verified_sha256(gguf_file)
    if sha is None:
        st = gguf_file.stat()
        identity = f"{gguf_file.resolve()}\0{st.st_size}\0{st.st_mtime_ns}"
        sha = hashlib.sha256(identity.encode()).hexdigest()
    return cache_dir() / "converted" / f"{gguf_file.stem}-{sha[:12]}"


def convert_gguf(gguf_file: Path, progress: bool = True) -> Path:
    """Convert `gguf_file` once into an fp32 safetensors folder; later calls return at once.

    The conversion is written into a temporary sibling folder and renamed at the end, so an
    interrupted run never leaves a folder that looks complete; concurrent runs both finish and
    the first rename wins.
    """
    out = converted_dir(gguf_file)
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp"))
    try:
        _convert_into(gguf_file, tmp, progress)
        try:
            os.rename(tmp, out)
        except OSError:
            if not (out / "config.json").is_file():
                raise
            shutil.rmtree(tmp)  # another process finished the same conversion first
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _convert_into(gguf_file: Path, folder: Path, progress: bool) -> None:
    """Dequantize `gguf_file` with transformers' GGUF support and save it as an HF folder."""
    import torch
    from huggingface_hub import save_torch_state_dict
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

    start = time.perf_counter()
    say = _reporter(progress)
    say(f"converting {gguf_file.name} once into {folder.parent} (a minute or two; later loads "
        "take seconds)")
    with _transformers_progress(progress):
        say("reading GGUF metadata (config, tokenizer)")
        src = {"pretrained_model_name_or_path": gguf_file.parent, "gguf_file": gguf_file.name}
        config = AutoConfig.from_pretrained(**src, local_files_only=True)
        # A known tokenizer_type skips a second slow parse of the metadata (~10 s for Qwen2.5).
        known = config.model_type in TOKENIZER_MAPPING_NAMES
        tokenizer_type = config.model_type if known else None
        tokenizer = AutoTokenizer.from_pretrained(**src, tokenizer_type=tokenizer_type)
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
        _check_supported(type(skeleton).__name__, gguf_file)
        say("dequantizing tensors to float32")
        tensors = load_gguf_checkpoint(
            str(gguf_file), return_tensors=True, model_to_load=skeleton, torch_dtype=torch.float32
        )["tensors"]
    _check_complete(tensors, skeleton, config, gguf_file)
    say("writing safetensors")
    save_torch_state_dict(
        tensors, folder, max_shard_size=_MAX_SHARD_SIZE, metadata={"format": "pt"}
    )
    del tensors
    config.architectures = [type(skeleton).__name__]
    config.dtype = torch.float32
    config.save_pretrained(folder)
    GenerationConfig.from_model_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    _make_readable(folder)
    say(f"converted {gguf_file.name} in {time.perf_counter() - start:.0f} s")


def _make_readable(folder: Path) -> None:
    """mkdtemp makes the folder 0700 (some writers make 0600 files); share it like a download."""
    folder.chmod(0o755)
    for file in folder.iterdir():
        file.chmod(0o644)


def _check_supported(architecture: str, gguf_file: Path) -> None:
    """Fail before minutes of dequantizing when our transformer cannot run the model anyway."""
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{gguf_file.name} holds a {architecture}; specdec supports "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}."
        )


def _check_complete(tensors: dict, skeleton, config, gguf_file: Path) -> None:
    """Every parameter of the model must have come out of the file (lm_head may be tied)."""
    expected = set(skeleton.state_dict())
    if getattr(config, "tie_word_embeddings", False):
        expected.discard("lm_head.weight")
    missing = sorted(expected - set(tensors))
    if missing:
        raise ValueError(
            f"{gguf_file.name}: {len(missing)} parameters are missing from the GGUF file "
            f"(e.g. {missing[:3]}); is its architecture ({config.model_type}) fully supported?"
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
