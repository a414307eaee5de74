"""The C boundary (`specdec/kernel_abi.h`, `.c`, `.py`): every kernel library builds, loads and
agrees with its ctypes twin on every descriptor, constant and status; a disagreement or a
compiler failure is an error that says what went wrong.

These run on any x86-64 machine with gcc: the libraries are compiled for every instruction-set
level (AVX-512 VNNI, AVX-VNNI, AVX2) but only `kernel_abi.c` (built without AVX-512) runs, so they
do not need the kernels' CPU.
"""

import ctypes
import dataclasses
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from specdec import kernel_abi, native
from specdec.cache import cpu_attention
from specdec.config import EngineConfig
from specdec.engine_parts import resolve_config
from specdec.eval import roofline
from specdec.target.quant import decoder_stack, int4, qgemm, qlinear

KERNELS = {
    **{f"{name}-{level.name}": module.kernel(level) for level in native.SIMD_LEVELS
       for name, module in (("qgemm", qgemm), ("attention", cpu_attention), ("decoder", decoder_stack),
                            ("roofline", roofline))},
    "int4_quant": int4.QUANTIZER,
}
needs_gcc = pytest.mark.skipif(native.compiler() is None, reason="no C compiler")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.delenv("SPECDEC_NO_KERNELS", raising=False)
    return tmp_path


@pytest.fixture(scope="module")
def kernel_cache(tmp_path_factory):
    """This module's own cache folder: every library is compiled here, once."""
    return tmp_path_factory.mktemp("kernels")


@pytest.fixture(scope="module")
def libraries(kernel_cache):
    """Every kernel library, built here (one compiler per core: builds are atomic) and opened
    (declared and layout-checked)."""
    with pytest.MonkeyPatch.context() as mp, ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        mp.setenv("SPECDEC_CACHE", str(kernel_cache))
        paths = dict(zip(KERNELS, pool.map(lambda k: k.build(), KERNELS.values())))
        return {name: native.open_library(paths[name], k.functions) for name, k in KERNELS.items()}


@needs_gcc
@pytest.mark.parametrize("name", KERNELS)
def test_every_library_agrees_with_the_ctypes_descriptors(libraries, name):
    lib = libraries[name]
    assert lib.specdec_abi_version() == kernel_abi.ABI_VERSION
    kernel_abi.check_layout(lib)  # again, explicitly: raises on any difference
    entries = {(e.type.decode(), e.field.decode()) for e in kernel_abi._layout(lib)}
    for structure in kernel_abi.STRUCTURES:  # the table covers every field of every descriptor
        assert {(structure.c_name, f) for f, _ in structure._fields_} <= entries
    for function in KERNELS[name].functions:
        assert getattr(lib, function).argtypes == kernel_abi.PROTOTYPES[function][1]


@needs_gcc
def test_the_decoder_library_links_its_callees(libraries):
    """decoder.c calls qgemm and rope_write_attend built into its own library: no function
    pointer crosses between two libraries."""
    for level in native.SIMD_LEVELS:
        assert {qgemm.SOURCE, cpu_attention.SOURCE} <= set(decoder_stack.kernel(level).sources)
        assert all(hasattr(libraries[f"decoder-{level.name}"], f) for f in ("qgemm", "rope_write_attend"))


# Calls each kernel through its declared prototype with an argument it refuses: the refusal is the
# first thing each does, in scalar code, so this runs on any x86-64 CPU. In a child process, in
# case a compiler puts AVX-512 code before the checks (SIGILL: skipped, said so).
REFUSALS = """
import ctypes
from specdec import kernel_abi, native
from specdec.target.quant import decoder_stack
lib = native.open_library(decoder_stack.kernel().build(), ("decoder_layers", "qgemm", "rope_write_attend", "moe_block"))
buf = (ctypes.c_uint16 * 64)()
a = kernel_abi.Attention(slots=ctypes.addressof(buf), block_tables=ctypes.addressof(buf),
                         seq_lens=ctypes.addressof(buf), query_start_loc=ctypes.addressof(buf),
                         hq=4, hkv=2, d=48, block_size=4)  # head_dim 48: not a multiple of 32
layers = (kernel_abi.Layer * 1)()
print(lib.qgemm(buf, 1, 1, 48, 0, buf, buf, buf, 16, None, None, buf, 1, None, 0, 0.0, 1),  # k % 32
      lib.rope_write_attend(ctypes.byref(a), buf, 256, buf, buf, 1.0, buf, 1),
      lib.decoder_layers(None, 1, layers, 1, 0, 0.0, ctypes.byref(a), buf, 1.0, buf, buf, buf, None, 0, None, None, 1),
      lib.moe_block(buf, 1, 1, ctypes.byref(kernel_abi.Moe(top_k=3, num_experts=2, hidden=64)), None, 0, 0.0,
                    None, buf, None, 1))  # more experts a token than there are
"""


@needs_gcc
def test_each_kernel_refuses_bad_arguments_with_a_status(libraries, kernel_cache, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(kernel_cache))  # the libraries built above, not again
    monkeypatch.delenv("SPECDEC_NO_KERNELS", raising=False)
    done = subprocess.run([sys.executable, "-c", REFUSALS], capture_output=True, text=True, timeout=300)
    if done.returncode == -signal.SIGILL:
        pytest.skip("this compiler put AVX-512 instructions before the kernels' argument checks")
    assert done.returncode == 0, done.stderr
    codes = [int(c) for c in done.stdout.split()]
    assert codes == [kernel_abi.Status.ERR_INVALID_ARGUMENT] * 4
    with pytest.raises(ValueError, match="^qgemm: refused its arguments"):
        kernel_abi.raise_for_status(codes[0], "qgemm")


class Linear(ctypes.Structure):  # struct specdec_linear with in_features as a 32-bit int
    c_name = "specdec_linear"
    _fields_ = [(n, ctypes.c_int32 if n == "in_features" else t) for n, t in kernel_abi.Linear._fields_]


class Attention(ctypes.Structure):  # struct specdec_attention without its last field
    c_name = "specdec_attention"
    _fields_ = kernel_abi.Attention._fields_[:-1]


@needs_gcc
@pytest.mark.parametrize(
    "structures, constants, expected",
    [
        ((Linear,), kernel_abi.CONSTANTS, r"specdec_linear\.in_features: C \(24, 8\), Python \(24, 4\)"),
        ((Attention,), kernel_abi.CONSTANTS, r"specdec_attention\.tree_masks: C \(128, 8\), Python missing"),
        ((), {**kernel_abi.CONSTANTS, "SPECDEC_ERR_SLOT": 9}, r"constant\.SPECDEC_ERR_SLOT: C \(4, 0\), Python \(9, 0\)"),
    ],
    ids=["field-type", "missing-field", "status-code"],
)
def test_a_mismatched_description_is_caught(libraries, structures, constants, expected):
    mismatched = {s.c_name: s for s in structures}
    structures = tuple(mismatched.get(s.c_name, s) for s in kernel_abi.STRUCTURES)
    with pytest.raises(kernel_abi.KernelABIError, match=expected):
        kernel_abi.check_layout(libraries["qgemm-avx2"], structures, constants)


@needs_gcc
def test_a_version_mismatch_is_caught(libraries, monkeypatch):
    monkeypatch.setattr(kernel_abi, "ABI_VERSION", kernel_abi.ABI_VERSION + 1)
    with pytest.raises(kernel_abi.KernelABIError, match=f"ABI version {kernel_abi.ABI_VERSION - 1}"):
        kernel_abi.check_layout(libraries["qgemm-avx2"])


@pytest.mark.parametrize(
    "status, error, message",
    [
        (kernel_abi.Status.ERR_NO_MEMORY, MemoryError, "could not allocate"),
        (kernel_abi.Status.ERR_INVALID_ARGUMENT, ValueError, "refused its arguments"),
        (kernel_abi.Status.ERR_POSITION, ValueError, "outside the rotary table"),
        (kernel_abi.Status.ERR_SLOT, ValueError, "slot is outside the KV cache"),
        (kernel_abi.Status.ERR_BLOCK, ValueError, "block table entry is outside"),
        (kernel_abi.Status.ERR_LENGTHS, ValueError, "disagree"),
        (77, RuntimeError, "77, which is no specdec_status"),
    ],
)
def test_each_status_raises_its_exception(status, error, message):
    with pytest.raises(error, match=f"^qgemm.*{message}"):
        kernel_abi.raise_for_status(status, "qgemm")


def test_the_packers_tile_sizes_are_the_kernels():
    """qlinear.py spells GROUP and TILE itself (it keys the quantized cache); the kernel's are
    kernel_abi's, checked against kernel_abi.h at load."""
    assert (qlinear.GROUP, qlinear.TILE) == (kernel_abi.GROUP, kernel_abi.TILE)


def test_ok_raises_nothing_and_every_error_status_is_mapped():
    kernel_abi.raise_for_status(0, "qgemm")
    assert set(kernel_abi.ERRORS) == set(kernel_abi.Status) - {kernel_abi.Status.OK}


def _kernel(tmp_path, source: str, flags=()) -> native.NativeKernel:
    path = tmp_path / "broken.c"
    path.write_text(source)
    return native.NativeKernel((path,), flags=flags, cpu_flags=())


@needs_gcc
def test_a_syntax_error_keeps_the_compilers_message(cache):
    kernel = _kernel(cache, "int broken(void) { return 0 }\n")
    with pytest.raises(native.KernelBuildError, match="(?s)building broken.c failed.*error: expected .;."):
        kernel.build()
    assert "error: expected" in kernel.unavailable_reason()
    assert kernel.load() is None


@needs_gcc
def test_a_bogus_flag_keeps_the_compilers_message_up_to_require_qgemm(cache, monkeypatch):
    real = qgemm.kernel()
    broken = dataclasses.replace(real, flags=(*real.flags, "-fno-such-flag"), cpu_flags=())
    monkeypatch.setattr(qgemm, "kernel", lambda level=None: broken)
    assert resolve_config(EngineConfig(dtype="bfloat16", device="cpu")).target_quant == "w8a8"
    with pytest.raises(qgemm.KernelUnavailableError, match="(?s)building qgemm.c failed.*unrecognized command.line option.*w8a8"):
        qgemm.require_qgemm()


def test_no_compiler_is_a_reason_not_a_crash(cache, monkeypatch):
    monkeypatch.setattr(native, "compiler", lambda: None)
    with pytest.raises(native.KernelBuildError, match="no C compiler"):
        native.NativeKernel((qgemm.SOURCE,), (), ()).build()



@needs_gcc
def test_a_prebuilt_kernel_is_compiled_once_and_a_failed_one_keeps_its_message(cache, monkeypatch):
    """`prebuild` compiles in the background; the first `load()` waits for it and compiles nothing
    more; a build that fails there fails again in `load()`, with the compiler's message."""
    compiles = []
    run = subprocess.run
    monkeypatch.setattr(native.subprocess, "run", lambda cmd, **kw: compiles.append(cmd[-1]) or run(cmd, **kw))
    good = _kernel(cache, "int answer(void) { return 42; }\n")
    broken = native.NativeKernel((cache / "broken2.c",), (), ())
    (cache / "broken2.c").write_text("int broken(void) { return 0 }\n")
    native.prebuild([good, broken])
    assert good.load() is not None
    assert "error: expected" in broken.unavailable_reason()
    assert len([c for c in compiles if c.endswith(".so")]) == 3  # good once, broken twice


@needs_gcc
def test_the_int4_quantizer_refuses_what_it_does_not_take(libraries):
    """Groups other than 32 or not dividing K, a step/zero tensor with fewer rows than asked for,
    an error asked for with nowhere to put it: a status, nothing written."""
    import torch

    w, q = torch.randn(4, 256), torch.zeros(4, 256, dtype=torch.int32)
    sz = torch.zeros(8, 4, 2, dtype=torch.bfloat16)
    lib, err = libraries["int4_quant"], ctypes.c_double()

    def call(n=4, k=256, group=32, sz_rows=4, err_sq=ctypes.byref(err)):
        return lib.int4_quantize_rows(w.data_ptr(), n, k, group, q.data_ptr(), sz.data_ptr(), sz_rows, 1, err_sq, 1)

    if int4.QUANTIZER.load() is not None:  # the valid call runs AVX2 code
        assert call() == kernel_abi.Status.OK and err.value > 0
    for bad in (dict(group=64), dict(k=100), dict(sz_rows=3), dict(err_sq=None)):
        assert call(**bad) == kernel_abi.Status.ERR_INVALID_ARGUMENT, bad


def test_specdec_isa_holds_the_kernels_at_or_below_a_level(cache, monkeypatch):
    """What a user on an AVX-512 machine does to run (and time) what an AVX2 machine runs."""
    monkeypatch.setenv("SPECDEC_ISA", "avx2")
    assert native.allowed_levels() == ("avx2",)
    if "avx2" in [level.name for level in native.machine_levels()]:
        assert native.simd_level().name == "avx2"
        assert qgemm.kernel().level == decoder_stack.kernel().level == cpu_attention.kernel().level == "avx2"
        assert native.describe_simd().startswith("kernels: avx2")
    assert "holds the kernels below avx512-vnni" in qgemm.kernel("avx512-vnni").unavailable_reason()
    monkeypatch.setenv("SPECDEC_ISA", " AVX-VNNI ")  # names are read loosely
    assert native.allowed_levels() == ("avx-vnni", "avx2")


def test_specdec_isa_none_keeps_torch_and_a_bad_name_says_which_exist(cache, monkeypatch):
    monkeypatch.setenv("SPECDEC_ISA", "none")
    assert native.simd_level() is None and qgemm.load_qgemm() is None
    assert "SPECDEC_ISA=none" in native.describe_simd()
    assert resolve_config(EngineConfig(dtype="bfloat16", device="cpu")).target_quant == "w8a8"
    monkeypatch.setenv("SPECDEC_ISA", "avx3")
    with pytest.raises(ValueError, match="avx512-vnni, avx-vnni, avx2 or none"):
        native.simd_level()
