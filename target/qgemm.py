"""Build and load the group-quantized GEMM kernel (`qgemm.c`) for this CPU.

The kernel is plain C with AVX-512 VNNI intrinsics: compiled once with the system C compiler into
the cache folder (~2 s), keyed on the source, the flags and the compiler, then loaded with ctypes
(the call releases the GIL). OpenMP resolves to the runtime torch already loaded, so the kernel and
torch share one thread pool. Where there is no compiler, no AVX-512 VNNI, or `SPECDEC_NO_KERNELS=1`
is set, `load_qgemm()` returns None and the engine keeps torch's kernels (`"w8a8"`).
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
from pathlib import Path

SOURCE = Path(__file__).with_name("qgemm.c")
CPU_FLAGS = ("avx512f", "avx512bw", "avx512_vnni")
COMPILE_FLAGS = ["-O3", "-std=c11", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni",
                 "-fopenmp", "-fPIC", "-shared"]


class KernelUnavailableError(RuntimeError):
    """The quantized CPU kernel cannot run here (why is in the message)."""


def unavailable_reason() -> str | None:
    """Why the kernel cannot be used on this machine, or None when it can."""
    if os.environ.get("SPECDEC_NO_KERNELS") == "1":
        return "SPECDEC_NO_KERNELS=1 is set"
    if not sys.platform.startswith("linux"):
        return f"the kernel is built for Linux, not {sys.platform}"
    flags = _cpu_flags()
    if flags is None:
        return "/proc/cpuinfo is unreadable"
    missing = [f for f in CPU_FLAGS if f not in flags]
    if missing:
        return f"this CPU lacks {', '.join(missing)}"
    if _compiler() is None:
        return "no C compiler (cc/gcc) on PATH"
    return None


@functools.cache
def _cpu_flags() -> frozenset[str] | None:
    try:
        return frozenset(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return None


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def load_qgemm() -> ctypes.CDLL | None:
    """The loaded kernel library, building it on first use; None where it cannot run."""
    return None if unavailable_reason() is not None else _load()


@functools.cache
def _load() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL(str(_build()))
    except (OSError, subprocess.CalledProcessError):
        return None
    lib.qgemm.restype = ctypes.c_int
    lib.qgemm.argtypes = [
        ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
        ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_int,
    ]
    return lib


def require_qgemm() -> ctypes.CDLL:
    """The kernel, or `KernelUnavailableError` saying why not."""
    lib = load_qgemm()
    if lib is None:
        reason = unavailable_reason() or f"building {SOURCE.name} failed (run it by hand: {_command('x.so')})"
        raise KernelUnavailableError(
            f"quantization 'w4a8' needs the AVX-512 VNNI kernel, which cannot run here: {reason}. "
            "Use 'w8a8' instead."
        )
    return lib


def _command(out: str) -> str:
    return " ".join([_compiler() or "cc", *COMPILE_FLAGS, str(SOURCE), "-o", out])


def _build() -> Path:
    from specdec.target.default_pair import cache_dir

    cc = _compiler()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("|".join([SOURCE.read_text(), " ".join(COMPILE_FLAGS), version]).encode())
    path = cache_dir() / "kernels" / f"qgemm-{key.hexdigest()[:16]}.so"
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".so")
    os.close(fd)
    try:
        subprocess.run([cc, *COMPILE_FLAGS, str(SOURCE), "-o", tmp], check=True, capture_output=True)
        os.chmod(tmp, 0o755)
        os.replace(tmp, path)  # atomic: concurrent builders race harmlessly
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path
