"""Run Triton kernels through the interpreter on CPU-only machines.

Set at import time, before anything imports ``specdec.cache.triton_kernel`` (triton reads the
variable when a kernel is decorated). On a CUDA machine the kernel runs natively instead.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
