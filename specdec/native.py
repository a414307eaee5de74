"""Build specdec's C kernels for this CPU once, and load them with ctypes.

A kernel is a library of plain C sources with SIMD intrinsics (`target/quant/qgemm.c`,
`cache/paged_attention.c`, `target/quant/decoder.c` with both), sharing the 16-lane vectors of
`simd.h` and the declarations of `kernel_abi.h`; `kernel_abi.c` (plain C) is built into each. The
SIMD kernels are built once per instruction-set level (`SimdLevel`: AVX-512 VNNI, AVX-VNNI, AVX2)
and the best level this CPU runs is used (`simd_level`); `SPECDEC_ISA=avx2` (or `avx-vnni`)
holds them lower, so that any machine can run and time a lower level, and `SPECDEC_ISA=none`
keeps torch's ops. A library is compiled with the system C compiler into `<cache>/kernels` (~2 s,
once), keyed on the sources, the headers, the flags and the compiler version, then loaded with
ctypes, which releases the GIL during calls, and checked against `kernel_abi.py` (prototypes,
struct layouts, constants).
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
HEADERS = (HERE / "simd.h", HERE / "kernel_abi.h")  # on the include path, in every key
ABI_SOURCE = HERE / "kernel_abi.c"  # built into every library: its layout table
BASE_FLAGS = ("-O3", "-std=c11", "-fopenmp", "-fPIC", "-shared", f"-I{HERE}")


ISA_ENV = "SPECDEC_ISA"


@dataclass(frozen=True)
class SimdLevel:
    """An instruction-set level the SIMD kernels are built for: its compiler flags and the CPU
    flags (`/proc/cpuinfo`) it runs on."""

    name: str
    flags: tuple[str, ...]
    cpu_flags: tuple[str, ...]


# Best first. AVX-VNNI is the 256-bit VNNI of Intel's hybrid cores and Zen 5 (CPUID 7.1 EAX bit 4).
SIMD_LEVELS = (
    SimdLevel("avx512-vnni", ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mfma", "-mf16c"),
              ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "f16c")),
    SimdLevel("avx-vnni", ("-mavx2", "-mfma", "-mf16c", "-mavxvnni"), ("avx2", "fma", "f16c", "avx_vnni")),
    SimdLevel("avx2", ("-mavx2", "-mfma", "-mf16c"), ("avx2", "fma", "f16c")),
)


def allowed_levels() -> tuple[str, ...]:
    """The level names `SPECDEC_ISA` allows: all of them unset, the named one and those below
    it, none for `none`; `ValueError` for a name that is no level."""
    names = tuple(level.name for level in SIMD_LEVELS)
    cap = os.environ.get(ISA_ENV, "").strip().lower()
    if not cap:
        return names
    if cap == "none":
        return ()
    if cap not in names:
        raise ValueError(f"{ISA_ENV}={cap!r} is no instruction-set level: use one of {', '.join(names)} or none")
    return names[names.index(cap):]


def machine_levels() -> tuple[SimdLevel, ...]:
    """The levels this machine can run (CPU flags and a compiler), whatever `SPECDEC_ISA` says."""
    return tuple(level for level in SIMD_LEVELS if _machine_reason(level.cpu_flags) is None)


def simd_level() -> SimdLevel | None:
    """The best level this machine runs that `SPECDEC_ISA` allows (read on every call), or None."""
    allowed = allowed_levels()
    return next((level for level in machine_levels() if level.name in allowed), None)


def level_named(name: str) -> SimdLevel:
    """The `SimdLevel` called `name` (`ValueError` naming the levels otherwise)."""
    for level in SIMD_LEVELS:
        if level.name == name:
            return level
    raise ValueError(f"no instruction-set level {name!r}: one of {', '.join(l.name for l in SIMD_LEVELS)}")


def simd_kernel(sources: tuple[Path, ...], functions: tuple[str, ...], level: SimdLevel | str | None = None,
                headers: tuple[Path, ...] = ()) -> NativeKernel:
    """`sources` built for `level` (a name or a level; None: `simd_level()`, or the lowest level
    where none runs, whose `unavailable_reason` then says why)."""
    if isinstance(level, str):
        level = level_named(level)
    level = level or simd_level() or SIMD_LEVELS[-1]
    return NativeKernel(sources, level.flags, level.cpu_flags, functions, headers, level.name)


def describe_simd() -> str:
    """One line naming what runs the SIMD kernels here, e.g. "kernels: avx2 (SPECDEC_ISA=avx2;
    this CPU: avx512-vnni)"."""
    if os.environ.get("SPECDEC_NO_KERNELS") == "1":
        return "kernels: none, torch ops (SPECDEC_NO_KERNELS=1)"
    best = next((level.name for level in machine_levels()), None)
    level = simd_level()
    held = os.environ.get(ISA_ENV, "").strip()
    if level is None:
        why = f"{ISA_ENV}={held}" if best and held else f"no level runs here ({_machine_reason(SIMD_LEVELS[-1].cpu_flags)})"
        return f"kernels: none, torch ops ({why})"
    return f"kernels: {level.name}" + (f" ({ISA_ENV}={held}; this CPU: {best})" if best != level.name else "")


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
    headers: tuple[Path, ...] = ()  # included by the sources beside them: in the build key
    level: str = ""  # the `SimdLevel` it is built for ("": none); SPECDEC_ISA may hold it off

    def unavailable_reason(self) -> str | None:
        """Why the kernel cannot be used on this machine, or None when it can (the environment
        is read on every call, the machine once; where the machine fits, this builds and loads
        the library once, and a failure's reason carries the compiler's message)."""
        if os.environ.get("SPECDEC_NO_KERNELS") == "1":
            return "SPECDEC_NO_KERNELS=1 is set"
        if self.level and self.level not in (allowed := allowed_levels()):
            held = os.environ.get(ISA_ENV, "").strip()
            if not allowed:
                return f"{ISA_ENV}={held} keeps torch's ops"
            return f"{ISA_ENV}={held} holds the kernels below {self.level}"
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
        texts = [p.read_text() for p in (*self.sources, ABI_SOURCE, *HEADERS, *self.headers)]
        key = hashlib.sha256("|".join([*texts, " ".join([*BASE_FLAGS, *self.flags]), version]).encode())
        name = "-".join(filter(None, (self.sources[0].stem, self.level, key.hexdigest()[:16])))
        path = cache_dir() / "kernels" / f"{name}.so"
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
