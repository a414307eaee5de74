"""Build specdec's C kernels for this CPU once, and load them with ctypes.

A kernel is a library of plain C sources with AVX-512 intrinsics (`target/qgemm.c` with
`target/decoder.c`, `cache/paged_attention.c`), sharing the helpers of `avx512_common.h`.
It is compiled with the system C compiler into `<cache>/kernels` (~2 s, once), keyed on the source,
the flags and the compiler version, then loaded with ctypes, which releases the GIL during calls.
OpenMP resolves to the runtime torch already loaded, so kernels and torch share one thread pool.
Where there is no compiler, the CPU lacks the instructions, or `SPECDEC_NO_KERNELS=1` is set,
`load()` returns None and callers keep their torch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from specdec.paths import cache_dir

COMMON_HEADER = Path(__file__).with_name("avx512_common.h")  # included by every kernel
BASE_FLAGS = ("-O3", "-std=c11", "-fopenmp", "-fPIC", "-shared", f"-I{COMMON_HEADER.parent}")


@dataclass(frozen=True)
class NativeKernel:
    """C sources built into one library, the compiler flags they need and the CPU flags
    (`/proc/cpuinfo`) they run on."""

    sources: tuple[Path, ...]
    flags: tuple[str, ...]
    cpu_flags: tuple[str, ...]

    def unavailable_reason(self) -> str | None:
        """Why the kernel cannot be used on this machine, or None when it can (the environment
        is read on every call, the machine once)."""
        if os.environ.get("SPECDEC_NO_KERNELS") == "1":
            return "SPECDEC_NO_KERNELS=1 is set"
        return _machine_reason(self.cpu_flags)

    def command(self, out: str) -> str:
        """The build command, for error messages."""
        return " ".join([compiler() or "cc", *BASE_FLAGS, *self.flags, *map(str, self.sources), "-o", out])

    def build(self) -> Path:
        """Compile into the cache folder unless this source, flags and compiler are already there."""
        cc = compiler()
        version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
        flags = [*BASE_FLAGS, *self.flags]
        texts = [p.read_text() for p in (*self.sources, COMMON_HEADER)]
        key = hashlib.sha256("|".join([*texts, " ".join(flags), version]).encode())
        path = cache_dir() / "kernels" / f"{self.sources[0].stem}-{key.hexdigest()[:16]}.so"
        if path.is_file():
            return path
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".so")
        os.close(fd)
        try:
            subprocess.run([cc, *flags, *map(str, self.sources), "-o", tmp], check=True, capture_output=True)
            os.chmod(tmp, 0o755)
            os.replace(tmp, path)  # atomic: concurrent builders race harmlessly
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return path


def load(kernel: NativeKernel, signatures: dict[str, list]) -> ctypes.CDLL | None:
    """The loaded library with `signatures` (name -> ctypes argtypes; every function returns int),
    building it on first use; None where it cannot run or its build failed."""
    if kernel.unavailable_reason() is not None:
        return None
    return _load(kernel, tuple((name, tuple(argtypes)) for name, argtypes in signatures.items()))


@functools.cache
def _load(kernel: NativeKernel, signatures: tuple) -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL(str(kernel.build()))
    except (OSError, subprocess.CalledProcessError):
        return None
    for name, argtypes in signatures:
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = ctypes.c_int, list(argtypes)
    return lib


@functools.cache
def _machine_reason(cpu_flags: tuple[str, ...]) -> str | None:
    if not sys.platform.startswith("linux"):
        return f"the kernels are built for Linux, not {sys.platform}"
    flags = _cpu_flags()
    if flags is None:
        return "/proc/cpuinfo is unreadable"
    missing = [f for f in cpu_flags if f not in flags]
    if missing:
        return f"this CPU lacks {', '.join(missing)}"
    if compiler() is None:
        return "no C compiler (cc/gcc) on PATH"
    return None


@functools.cache
def cpu_has(flag: str) -> bool:
    """Whether /proc/cpuinfo lists `flag` (False where it is unreadable)."""
    flags = _cpu_flags()
    return flags is not None and flag in flags


@functools.cache
def _cpu_flags() -> frozenset[str] | None:
    try:
        return frozenset(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return None


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
