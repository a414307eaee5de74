"""Build specdec's C kernels for this CPU once, and load them with ctypes.

A kernel is a library of plain C sources with AVX-512 intrinsics (`target/quant/qgemm.c`,
`cache/paged_attention.c`, `target/quant/decoder.c` with both), sharing the helpers of
`avx512_common.h` and the declarations of `kernel_abi.h`; `kernel_abi.c` (plain C) is built into
each. It is compiled with the system C compiler into `<cache>/kernels` (~2 s, once), keyed on the
sources, the headers, the flags and the compiler version, then loaded with ctypes, which releases
the GIL during calls, and checked against `kernel_abi.py` (prototypes, struct layouts, constants).
OpenMP resolves to the runtime torch already loaded, so kernels and torch share one thread pool.
Where there is no compiler, the CPU lacks the instructions, the build fails (the compiler's
message is kept) or `SPECDEC_NO_KERNELS=1` is set, `load()` returns None, `unavailable_reason()`
says why, and callers keep their torch path.
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
import threading
from dataclasses import dataclass
from pathlib import Path

from specdec import kernel_abi
from specdec.paths import cache_dir

HERE = Path(__file__).parent
HEADERS = (HERE / "avx512_common.h", HERE / "kernel_abi.h")  # on the include path, in every key
ABI_SOURCE = HERE / "kernel_abi.c"  # built into every library: its layout table
BASE_FLAGS = ("-O3", "-std=c11", "-fopenmp", "-fPIC", "-shared", f"-I{HERE}")


class KernelBuildError(RuntimeError):
    """The compiler refused a kernel: the message holds its command and the compiler's output."""


@dataclass(frozen=True)
class NativeKernel:
    """C sources built into one library, the compiler flags they need, the CPU flags
    (`/proc/cpuinfo`) they run on and the functions it exports (`kernel_abi.PROTOTYPES`)."""

    sources: tuple[Path, ...]
    flags: tuple[str, ...]
    cpu_flags: tuple[str, ...]
    functions: tuple[str, ...] = ()

    def unavailable_reason(self) -> str | None:
        """Why the kernel cannot be used on this machine, or None when it can (the environment
        is read on every call, the machine once; where the machine fits, this builds and loads
        the library once, and a failure's reason carries the compiler's message)."""
        if os.environ.get("SPECDEC_NO_KERNELS") == "1":
            return "SPECDEC_NO_KERNELS=1 is set"
        return _machine_reason(self.cpu_flags) or _load(self)[1]

    def load(self) -> ctypes.CDLL | None:
        """The loaded, checked library, building it on first use; None where it cannot run."""
        return None if self.unavailable_reason() is not None else _load(self)[0]

    def command(self, out: str) -> list[str]:
        """The build command."""
        return [compiler() or "cc", *BASE_FLAGS, *self.flags, *map(str, (*self.sources, ABI_SOURCE)), "-o", out]

    def build(self) -> Path:
        """Compile into the cache folder unless these sources, flags and compiler are already
        there; `KernelBuildError` with the compiler's message where it fails."""
        cc = compiler()
        if cc is None:
            raise KernelBuildError("no C compiler (cc/gcc) on PATH")
        version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
        texts = [p.read_text() for p in (*self.sources, ABI_SOURCE, *HEADERS)]
        key = hashlib.sha256("|".join([*texts, " ".join([*BASE_FLAGS, *self.flags]), version]).encode())
        path = cache_dir() / "kernels" / f"{self.sources[0].stem}-{key.hexdigest()[:16]}.so"
        if path.is_file():
            return path
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".so")
        os.close(fd)
        try:
            command = self.command(tmp)
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                raise KernelBuildError(
                    f"building {self.sources[0].name} failed ({' '.join(command)}):\n{done.stderr.strip()}"
                )
            os.chmod(tmp, 0o755)
            os.replace(tmp, path)  # atomic: concurrent builders race harmlessly
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return path


def open_library(path: Path, functions: tuple[str, ...]) -> ctypes.CDLL:
    """`path` loaded with ctypes, `functions` declared and its layout checked (`kernel_abi.bind`).
    Loading runs no kernel code, so this works on any x86-64 CPU."""
    return kernel_abi.bind(ctypes.CDLL(str(path)), functions)


_prebuilds: dict[NativeKernel, threading.Thread] = {}


def prebuild(kernels: list[NativeKernel]) -> None:
    """Compile those of `kernels` that can run here in the background, one compiler each, so that
    their first use finds them built (their first `load()` waits for its build). On an empty cache
    the AVX-512 kernels compiled one after another at first use: ~3.7 s of a first load, which
    this overlaps with reading the models. A failed build is reported by `load()` as ever."""
    if os.environ.get("SPECDEC_NO_KERNELS") == "1":
        return
    for kernel in kernels:
        if kernel not in _prebuilds and _machine_reason(kernel.cpu_flags) is None:
            _prebuilds[kernel] = threading.Thread(target=_build_quietly, args=(kernel,), daemon=True)
            _prebuilds[kernel].start()


def _build_quietly(kernel: NativeKernel) -> None:
    try:
        kernel.build()
    except (OSError, KernelBuildError):
        pass  # load() builds again and keeps the message


@functools.cache
def _load(kernel: NativeKernel) -> tuple[ctypes.CDLL | None, str | None]:
    """(library, None) or (None, why not), once per kernel."""
    if kernel in _prebuilds:
        _prebuilds[kernel].join()
    try:
        return open_library(kernel.build(), kernel.functions), None
    except (OSError, KernelBuildError, kernel_abi.KernelABIError) as e:
        return None, str(e)


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
