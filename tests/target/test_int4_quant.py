"""`int4_quant.c`, the one-pass int4 quantizer, gives bitwise what the torch path gives: the same
codes, steps and zeros (so a cache file written with or without a compiler is the same file)."""

from __future__ import annotations

import pytest
import torch

from specdec import kernel_abi
from specdec.target.quant import int4

pytestmark = pytest.mark.skipif(int4.quantizer() is None, reason=f"int4_quant.c unavailable: "
                                f"{int4.QUANTIZER.unavailable_reason()}")


def _torch_path(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = weight.shape
    q = torch.empty(n, k, dtype=torch.int32)
    sz = torch.empty(k // group, n, 2, dtype=torch.bfloat16)
    rows = 7  # several chunks, one of them short
    for r in range(0, n, rows):
        q[r : r + rows], sz[:, r : r + rows] = int4._quantize_int4_rows(weight[r : r + rows], group)
    return q, sz


def _groups(rng: torch.Generator) -> torch.Tensor:
    """[40, 256]: random rows and every kind of group the decision logic tells apart."""
    w = torch.randn(40, 256, generator=rng) * 0.05
    grid = torch.randint(0, 16, (8, 256), generator=rng).float()  # 16-level grids (Q4_K-like)
    w[:8] = grid * 0.0123 - 0.07
    w[8:12] = (torch.randint(0, 32, (4, 256), generator=rng).float() - 16) * 0.004  # 32 levels (Q5_0-like)
    w[12, :32] = 0.25  # a constant group
    w[13, :32] = torch.arange(32) % 4 * 0.5  # 4 levels, far apart
    w[14, :32] = grid[0, :32] * 0.0123 + 1e-7 * torch.randn(32, generator=rng)  # a grid, jittered
    w[15, :32] = torch.arange(32) * 1e-9  # gaps below the 1e-4 threshold of a tiny range
    w[16] = -w[16].abs() * 1000  # large negative values
    w[17, :32] = grid[1, :32] * 0.0123 * 1.5 / 1.5  # rounding of the grid step itself
    return w


@pytest.mark.parametrize("group", [32, 64])
def test_the_kernel_is_bitwise_the_torch_path(group):
    rng = torch.Generator().manual_seed(0)
    for w in (_groups(rng), torch.randn(33, 128, generator=rng), torch.randn(1, 64, generator=rng).double()):
        q, sz = int4.quantize_int4(w, group)
        q_ref, sz_ref = _torch_path(w.float(), group)
        assert torch.equal(q, q_ref)
        assert torch.equal(sz.view(torch.int16), sz_ref.view(torch.int16))  # bitwise, signed zeros too
        assert sz.is_contiguous()  # torch's int4 kernel reads it as laid out


def test_the_kernel_refuses_bad_arguments():
    lib = int4.quantizer()
    w, q, s = torch.zeros(64), torch.zeros(64, dtype=torch.int32), torch.zeros(2)
    for group in (1, kernel_abi.MAX_INT4_GROUP + 1):
        status = lib.quantize_int4_groups(w.data_ptr(), 1, group, q.data_ptr(), s.data_ptr(), s.data_ptr(), 1)
        with pytest.raises(ValueError):
            kernel_abi.raise_for_status(status, "quantize_int4_groups")
