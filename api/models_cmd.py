"""`specdec models`: the embedded default pair, what specdec has cached, and how to remove it.

    $ specdec models                        # the pair's packages and GGUF files, the cache by model
    $ specdec models --remove-cache         # delete the cache folders, after a y/N question
    $ specdec models --remove-cache --yes   # ... without asking

Only the folders specdec itself writes under the cache (`$SPECDEC_CACHE`, else `~/.cache/specdec`)
are removed; everything in them is rebuilt on the next run. Anything else found there is listed,
never deleted.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from specdec.paths import cache_dir
from specdec.target.default_pair import (
    DEFAULT_DRAFT,
    DEFAULT_TARGET,
    INSTALL_COMMAND,
    ModelsNotInstalledError,
    PackedModel,
    find_parts,
    gguf_path,
    parts_checked,
    read_parts_manifest,
    verified_sha256,
)
from specdec.target.model_files import packed_model_dir

if TYPE_CHECKING:
    from rich.console import Console

# The folders specdec writes under its cache, and what each holds (the only ones --remove-cache
# deletes).
CACHE_FOLDERS = (
    ("gguf", "GGUF assembled from the models packages, for eval's llama.cpp / transformers baselines"),
    ("models", "a GGUF's config, tokenizer and where its weights are"),
    ("converted", "GGUF converted to safetensors (before v0.8.0; deleted on the next load)"),
    ("quantized", "quantized weights"),
    ("kernels", "compiled C kernels"),
)
_CONVERTED = re.compile(r"(?P<model>.+)-[0-9a-f]{12}")  # <gguf stem>-<12 hex of its sha256>
_QUANTIZED = re.compile(  # <model dir>-<mode>-<dtype>-<16 hex>.safetensors (target/quant/cache_file.py)
    r"(?P<model>.+?)-(?P<mode>w4a8-auto|[^-]+)-(?P<dtype>bfloat16|float16|float32)-[0-9a-f]{16}\.safetensors"
)


@dataclass
class CacheEntry:
    """One file or folder directly inside a cache folder."""

    folder: str
    path: Path
    model: str  # the model it belongs to ("" for kernels and what cannot be told)
    detail: str
    bytes_on_disk: int


@dataclass
class PairModel:
    """One model of the embedded pair: its packages (read in place) and an assembled GGUF copy."""

    role: str
    packed: PackedModel
    parts: list[Path] | None  # None: the packages are not (all) installed
    problem: str  # why not, when parts is None
    checked: bool  # the parts' sha256 was checked and they have not changed since
    gguf: Path
    gguf_ok: bool  # assembled and its sha256 marker matches


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("models", help="list the default model pair and specdec's cache (and its size); "
                                      "--remove-cache deletes the cache")
    p.add_argument("--remove-cache", action="store_true",
                   help="delete specdec's cache folders (gguf, models, converted, quantized, kernels); "
                        "rebuilt on the next run")
    p.add_argument("--yes", "-y", action="store_true", help="with --remove-cache: do not ask")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console(highlight=False)
    root = cache_dir()
    entries = scan_cache(root)
    show_pair(console, pair_status())
    show_families(console)
    show_cache(console, root, entries)
    if args.remove_cache:
        return remove_cache(console, root, entries, assume_yes=args.yes)
    show_removal(console, root, entries)
    return 0


# architecture -> (family, what it adds, the GGUF architecture llama.cpp writes, or "" where specdec
# reads only its HF folder)
FAMILIES = {
    "LlamaForCausalLM": ("Llama 2 / 3.x (rope scaling), 3.2 tied", "dense", "llama (rope_freqs read)"),
    "Qwen2ForCausalLM": ("Qwen2 / Qwen2.5", "dense, q/k/v bias", "qwen2"),
    "MistralForCausalLM": ("Mistral", "dense, sliding window", "llama"),
    "Qwen3ForCausalLM": ("Qwen3", "dense, q/k norms", "qwen3"),
    "Gemma2ForCausalLM": ("Gemma 2", "dense, soft-capping, sliding window", "gemma2"),
    "Gemma3ForCausalLM": ("Gemma 3", "dense, local / global rope", "gemma3 (its text decoder)"),
    "Phi3ForCausalLM": ("Phi-3 / 3.5 / 4 / 4-mini", "dense, fused projections, partial rotary", "phi3"),
    "SmolLM3ForCausalLM": ("SmolLM3", "dense, no rope every 4th layer", "smollm3"),
    "GraniteForCausalLM": ("Granite 3.x", "dense, multipliers", "granite"),
    "Glm4ForCausalLM": ("GLM-4 (0414)", "dense, partial rotary in pairs, sandwich norms", "glm4"),
    "Qwen3MoeForCausalLM": ("Qwen3-MoE (30B-A3B, 235B-A22B)", "MoE: softmax, top k, renormalized", "qwen3moe"),
    "Qwen2MoeForCausalLM": ("Qwen2-MoE / Qwen1.5-MoE", "MoE + a shared expert (sigmoid gate)", "qwen2moe"),
    "MixtralForCausalLM": ("Mixtral", "MoE: top 2 of 8, renormalized", "llama (with experts)"),
    "GptOssForCausalLM": ("gpt-oss (20b, 120b)", "MoE with biases, clamped SwiGLU; sinks, alternating windows", "gpt-oss (MXFP4 read)"),
    "OlmoeForCausalLM": ("OLMoE", "MoE, whole-width q/k norms, qkv clipping", "olmoe"),
    "DeepseekV2ForCausalLM": ("DeepSeek-V2 / V2-Lite", "MLA (latent KV cache) + MoE with shared experts", "deepseek2"),
    "DeepseekV3ForCausalLM": ("DeepSeek-V3 / R1 / Kimi-K2-style", "MLA + MoE: sigmoid, grouped, bias-chosen", "deepseek2"),
    "Qwen3NextForCausalLM": ("Qwen3-Next (80B-A3B)", "hybrid: Gated DeltaNet + gated attention, MoE", "qwen3next"),
    "Qwen3_5ForCausalLM": ("Qwen3.5 (dense; the text model of the multimodal checkpoints)", "hybrid: Gated DeltaNet + gated attention", "qwen35"),
    "Qwen3_5MoeForCausalLM": ("Qwen3.5-MoE", "hybrid: Gated DeltaNet + gated attention, MoE", "qwen35moe"),
}


def show_families(console: Console) -> None:
    """The model families specdec runs, dense and mixtures of experts, and where each loads from."""
    from rich.table import Table

    table = Table(title="Model families (HF folders, hub ids; GGUF where named)", title_justify="left")
    for column in ("architecture", "family", "layers", "GGUF"):
        table.add_column(column)
    for arch, (family, layers, gguf) in FAMILIES.items():
        table.add_row(arch, family, layers, gguf or "-")
    console.print()
    console.print(table)


def pair_status() -> list[PairModel]:
    """The default pair's packages (installed? where?) and assembled GGUF files."""
    out = []
    for role, packed in (("target", DEFAULT_TARGET), ("draft", DEFAULT_DRAFT)):
        try:
            parts, problem = find_parts(packed), ""
        except ModelsNotInstalledError as exc:
            parts, problem = None, str(exc)
        folder = packed_model_dir(packed)
        listed = read_parts_manifest(folder)
        checked = parts is not None and listed is not None and listed[0] == parts and parts_checked(folder)
        path = gguf_path(packed)
        ok = path.is_file() and verified_sha256(path) == packed.sha256
        out.append(PairModel(role, packed, parts, problem, checked, path, ok))
    return out


def scan_cache(root: Path) -> list[CacheEntry]:
    """Every entry of every folder under `root`, known folders first, with its size on disk."""
    if not root.is_dir():
        return []
    known = [name for name, _ in CACHE_FOLDERS]
    folders = [root / n for n in known if (root / n).is_dir()]
    folders += sorted(p for p in root.iterdir() if p.name not in known)
    entries = []
    for folder in folders:
        name = folder.name if folder.is_dir() else "."  # "." : a file at the top of the cache
        for path in sorted(folder.iterdir()) if folder.is_dir() else [folder]:
            entries.append(CacheEntry(name, path, *describe(name, path), disk_usage(path)))
    return entries


def describe(folder: str, path: Path) -> tuple[str, str]:
    """(model, what it is) of a cache entry, from specdec's naming of its files."""
    name = path.name
    if name.startswith(".") and name.endswith(".tmp"):
        return "", "left by an interrupted run"
    if folder == "gguf":
        if name.endswith(".ok.json"):
            return name.removesuffix(".gguf.ok.json"), "sha256 marker"
        return path.stem, "GGUF file"
    if folder == "converted" and (m := _CONVERTED.fullmatch(name)):
        return m["model"], "fp32 safetensors"
    if folder == "models" and (m := _CONVERTED.fullmatch(name)):
        return m["model"], "config, tokenizer, where the GGUF is"
    if folder == "quantized" and (m := _QUANTIZED.fullmatch(name)):
        model = _CONVERTED.fullmatch(m["model"])
        return (model["model"] if model else m["model"]), f"{m['mode']}, {m['dtype']}"
    if folder == "kernels":
        return "", "C kernel"
    return "", "not specdec's: kept by --remove-cache" if folder not in dict(CACHE_FOLDERS) else ""


def disk_usage(path: Path) -> int:
    """Bytes `path` takes on disk, like `du` (allocated blocks; symlinks not followed)."""
    def size(p: str) -> int:
        st = os.lstat(p)
        return st.st_blocks * 512 if hasattr(st, "st_blocks") else st.st_size

    if path.is_symlink() or not path.is_dir():
        return size(str(path))
    total = size(str(path))
    for dirpath, dirnames, filenames in os.walk(path):
        total += sum(size(os.path.join(dirpath, n)) for n in dirnames + filenames)
    return total


def human(num_bytes: int) -> str:
    """1536 -> '1.5 KiB'."""
    size = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def show_pair(console: Console, pair: list[PairModel]) -> None:
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="Embedded default pair (the `models` extra, GGUF Q4_K_M)",
                  title_justify="left", show_lines=True)
    table.add_column("role")
    table.add_column("model")
    table.add_column("packages (GGUF parts, read in place)", overflow="fold")
    for m in pair:
        if m.parts is None:
            why = m.problem.removeprefix("The default model pair is not installed ").split(". Install")[0]
            packages = f"[red]not installed[/red] {escape(why)}"
        else:
            held = sum(p.stat().st_size for p in m.parts)
            packages = (f"[green]installed[/green]: {len(m.parts)} packages, {human(held)}, "
                        f"in {escape(os.path.commonpath(m.parts))}")
        if m.parts is not None:
            packages += ", [green]sha256 checked[/green]" if m.checked else ", sha256 not checked yet (the first run does it)"
        row = packages
        if m.gguf.is_file():
            state = "sha256 checked" if m.gguf_ok else "not checked"
            row += (f"\nassembled copy {escape(str(m.gguf))} ({state}): only eval's llama.cpp and "
                    f"transformers baselines read it; delete it freely")
        table.add_row(m.role, m.packed.name, row)
    console.print(table)
    if any(m.parts is None for m in pair):
        console.print(f"Install the pair with:  {escape(INSTALL_COMMAND)}")


def show_cache(console: Console, root: Path, entries: list[CacheEntry]) -> None:
    """One section per model (its files and their total), then kernels and the rest."""
    from rich.markup import escape
    from rich.table import Table

    if not entries:
        console.print(f"\nspecdec cache {escape(str(root))}: empty")
        return
    total = sum(e.bytes_on_disk for e in entries)
    table = Table(title=f"specdec cache {escape(str(root))}", title_justify="left", show_footer=True)
    table.add_column("model / file", overflow="fold", footer="total")
    table.add_column("what")
    table.add_column("on disk", justify="right", footer=human(total))
    groups: dict[str, list[CacheEntry]] = {}
    for e in entries:
        groups.setdefault(e.model, []).append(e)
    for model in sorted(groups, key=lambda m: (m == "", m)):
        group = sorted(groups[model], key=lambda e: (_folder_rank(e.folder), e.path.name))
        label = escape(model or "other")
        table.add_row(f"[bold]{label}[/bold]", "", f"[bold]{human(sum(e.bytes_on_disk for e in group))}[/bold]")
        for e in group:
            table.add_row(escape(f"  {e.folder}/{e.path.name}"), e.detail, human(e.bytes_on_disk))
        table.add_section()
    console.print()
    console.print(table)


def _folder_rank(folder: str) -> int:
    names = [name for name, _ in CACHE_FOLDERS]
    return names.index(folder) if folder in names else len(names)


def removable(root: Path) -> list[Path]:
    """specdec's own cache folders that exist under `root` (what --remove-cache deletes)."""
    return [root / name for name, _ in CACHE_FOLDERS if (root / name).is_dir()]


def show_removal(console: Console, root: Path, entries: list[CacheEntry]) -> None:
    from rich.markup import escape

    paths = removable(root)
    console.print("\n[bold]To remove[/bold]")
    if paths:
        size = sum(e.bytes_on_disk for e in entries if root / e.folder in paths)
        console.print(f"  the cache ({human(size)}; rebuilt on the next run):  "
                      f"specdec models --remove-cache   or", soft_wrap=True)
        console.print(escape("    rm -rf " + " ".join(shlex.quote(str(p)) for p in paths)), soft_wrap=True)
    else:
        console.print("  the cache: nothing cached")
    names = " ".join(f"{m.dist_prefix}{{1..{m.num_parts}}}" for m in (DEFAULT_TARGET, DEFAULT_DRAFT))
    console.print(f"  the default pair's packages (bash/zsh):  pip uninstall -y {names}", soft_wrap=True)


def remove_cache(console: Console, root: Path, entries: list[CacheEntry], assume_yes: bool) -> int:
    """Delete specdec's cache folders under `root` after a y/N question (none with `assume_yes`)."""
    from rich.markup import escape

    paths = removable(root)
    if not paths:
        console.print("\nNothing to remove.")
        return 0
    size = sum(e.bytes_on_disk for e in entries if root / e.folder in paths)
    console.print(f"\nThis deletes {human(size)}:")
    for p in paths:
        console.print(escape(f"  {p}"), soft_wrap=True)
    if not assume_yes:
        try:
            answer = console.input("Delete these folders? [y/N] ")
        except EOFError:  # no terminal to answer on: pass --yes
            console.print()
            answer = ""
        if answer.strip().lower() not in ("y", "yes"):
            console.print("Nothing removed.")
            return 1
    for p in paths:
        shutil.rmtree(p)
    if root.is_dir() and not any(root.iterdir()):
        root.rmdir()
    console.print(f"Removed {human(size)}.")
    return 0
