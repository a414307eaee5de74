"""A QLinear cut for a tensor-parallel rank: output tiles and input blocks moved as they are, so a
rank's columns are bitwise the whole linear's and its inputs' parts sum to the whole product."""

from __future__ import annotations

import pytest
import torch

from specdec.kernel_abi import TILE_Q4_K, TILE_Q5_0, TILE_Q6_K, TILE_Q8_0
from specdec.target.quant import qgemm
from specdec.target.quant.qlinear import QLinear, fuse_qlinear, input_step, take_inputs, take_output_tiles
from tests.target.test_kquant import k_blocks

pytestmark = pytest.mark.skipif(qgemm.unavailable_reason() is not None, reason="qgemm kernel unavailable")


def linear(kind: int, seed: int = 0) -> QLinear:
    return QLinear.from_gguf(k_blocks(kind, 64, 512, seed=seed), kind, 512, torch.randn(64, generator=torch.Generator().manual_seed(seed)))


@pytest.mark.parametrize("kind", [TILE_Q4_K, TILE_Q6_K, TILE_Q5_0, TILE_Q8_0])
def test_output_tiles_are_the_whole_linears_columns(kind):
    q = linear(kind)
    x = torch.randn(5, 512).bfloat16()
    ranges = [(16, 32), (48, 64)]
    got = take_output_tiles(q, ranges)(x)
    assert torch.equal(got, torch.cat([q(x)[:, a:b] for a, b in ranges], -1))


def test_input_blocks_sum_to_the_whole_product():
    q = fuse_qlinear([linear(TILE_Q4_K, 1), linear(TILE_Q6_K, 2)])  # mixed tiles: cut at 256
    assert input_step(q) == 256
    x = torch.randn(3, 512)
    parts = [take_inputs(q, 0, 256, bias=True)(x[:, :256]), take_inputs(q, 256, 512, bias=False)(x[:, 256:])]
    torch.testing.assert_close(parts[0] + parts[1], q(x), rtol=1e-3, atol=1e-3)  # activations quantized per 256
    with pytest.raises(ValueError, match="blocks of 256"):
        take_inputs(q, 0, 128)
    with pytest.raises(ValueError, match="whole tiles"):
        take_output_tiles(q, [(0, 8)])
