"""qgemm at this checkout against qgemm built from another commit's sources, on the same tiles:
one linear of the default target's shapes (random valid Q4_K / Q6_K blocks), 2 threads, old and
new alternated 7 times, median ms (the matrices fit in L3: the compute-bound side, as prefill
chunks and verify windows are). Usage: python kernel_ab.py GIT_REF [rows ...]; KINDS=q50 (or
q4k,q6k,q50: the default's first two) picks the tensors, q50 the draft's Q5_0 gate|up."""
import copy, ctypes, os, pathlib, statistics, subprocess, sys, tempfile, time
import torch
from specdec import kernel_abi, native
from specdec.target.quant.qlinear import QLinear
from tests.target.test_kquant import k_blocks

torch.set_num_threads(2)
ref, rows = sys.argv[1], [int(r) for r in sys.argv[2:]] or [1, 3, 5, 8, 64, 512]
root = pathlib.Path(subprocess.check_output(["git", "rev-parse", "--show-toplevel"], text=True).strip())
old_dir = pathlib.Path(tempfile.mkdtemp())
for name in subprocess.check_output(["git", "ls-tree", "--name-only", ref, "target/quant/", "specdec/"], text=True,
                                    cwd=root).split():
    if name.endswith((".c", ".h")):
        (old_dir / pathlib.Path(name).name).write_bytes(subprocess.check_output(["git", "show", f"{ref}:{name}"], cwd=root))
level = native.simd_level()
subprocess.check_call([native.compiler() or "cc", "-O3", "-std=c11", "-fopenmp", "-fPIC", "-shared", f"-I{old_dir}",
                       *level.flags, str(old_dir / "qgemm.c"), str(old_dir / "kernel_abi.c"), "-o", str(old_dir / "q.so")])
old_lib = ctypes.CDLL(str(old_dir / "q.so"))
restype, argtypes = kernel_abi.PROTOTYPES["qgemm"]
old_lib.qgemm.restype, old_lib.qgemm.argtypes = restype, argtypes


def once(f, reps):
    t = time.perf_counter()
    for _ in range(reps):
        f()
    return (time.perf_counter() - t) / reps * 1e3


print(f"level {level.name}; old: {ref}")
print(f"| tensor | rows | this checkout ms | {ref} ms | {ref} / this |\n|---|---|---|---|---|")
SHAPES = {"q4k": (12, 17920, 1536, "Q4_K gate|up 17920x1536"), "q6k": (14, 1536, 8960, "Q6_K down 1536x8960"),
          "q50": (6, 9728, 896, "Q5_0 draft gate|up 9728x896")}
for kind, n, k, name in (SHAPES[s] for s in os.environ.get("KINDS", "q4k,q6k").split(",")):
    new = QLinear.from_gguf(k_blocks(kind, n, k, seed=1), kind, k, None)
    old = copy.copy(new)
    old._lib = old_lib
    for m in rows:
        x = torch.randn(m, k, dtype=torch.bfloat16)
        reps = max(2, 60 // m)
        assert torch.equal(new(x), old(x)), "the two builds disagree"
        tn, to = [], []
        for _ in range(7):
            tn.append(once(lambda: new(x), reps)), to.append(once(lambda: old(x), reps))
        tn, to = statistics.median(tn), statistics.median(to)
        print(f"| {name} | {m} | {tn:.2f} | {to:.2f} | {to / tn:.2f} |", flush=True)
