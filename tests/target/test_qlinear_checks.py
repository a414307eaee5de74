"""`QLinear.forward` checks every tensor before a pointer reaches `qgemm`: a tensor on another
device (CUDA), of another dtype, shape or layout is a `ValueError` naming it, never a crash; and
the kernel's status codes become their exceptions. Runs without the kernel (a stand-in library
records the calls), so these hold on every machine."""

import pytest
import torch

from specdec.kernel_abi import Status
from specdec.target.quant import qlinear
from specdec.target.quant.qlinear import QLinear
from tests.target.test_quant import grid_weights

OTHER_DEVICE = "meta"  # stands for CUDA here: not the CPU, and no data behind its pointers


class FakeLibrary:
    """Records `qgemm` calls and returns `status`."""

    def __init__(self, status: int = Status.OK) -> None:
        self.status, self.calls = status, []

    def qgemm(self, *args) -> int:
        self.calls.append(args)
        return self.status


@pytest.fixture
def lib(monkeypatch) -> FakeLibrary:
    fake = FakeLibrary()
    monkeypatch.setattr(qlinear, "require_qgemm", lambda: fake)
    return fake


def _linear(n: int = 32, k: int = 64) -> QLinear:
    return QLinear.from_weight(grid_weights(n, k), torch.zeros(n), int4_max_error=0.02)


def test_good_input_reaches_the_kernel(lib):
    q = _linear()
    y = q(torch.randn(3, 64), norm_weight=torch.ones(64), eps=1e-6, residual=torch.randn(3, 32))
    assert y.shape == (3, 32) and len(lib.calls) == 1
    q(torch.randn(2, 128, dtype=torch.bfloat16), glu=True)
    assert len(lib.calls) == 2


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda q: q(torch.randn(2, 64, device=OTHER_DEVICE)), "x must be on the CPU"),
        (lambda q: q(torch.randn(2, 48)), "x must have 64 features"),
        (lambda q: q(torch.randn(2, 64), glu=True), r"x must have 128 features \(gate \| up\)"),
        (lambda q: q(torch.randn(2, 64), residual=torch.randn(2, 31)), "residual must be a CPU tensor of 64"),
        (lambda q: q(torch.randn(2, 64), residual=torch.randn(2, 32, device=OTHER_DEVICE)), "residual must be a CPU"),
        (lambda q: q(torch.randn(2, 64), torch.ones(64, dtype=torch.float16)), "norm_weight must be torch.bfloat16 or"),
        (lambda q: q(torch.randn(2, 64), torch.ones(32)), r"norm_weight must have shape \[64\]"),
        (lambda q: q(torch.randn(2, 64), torch.ones(128)[::2]), "norm_weight must be contiguous"),
        (lambda q: q(torch.randn(2, 64), torch.ones(64, device=OTHER_DEVICE)), "norm_weight must be on the CPU"),
        (lambda q: q(torch.randn(2, 64), torch.ones(64), glu=True), "either an RMSNorm or a SiLU-GLU"),
    ],
)
def test_bad_input_is_a_value_error_naming_it(lib, call, message):
    with pytest.raises(ValueError, match=message):
        call(_linear())
    assert not lib.calls


def test_a_module_moved_off_the_cpu_is_refused(lib):
    q = _linear()
    q(torch.randn(1, 64))
    q.to(OTHER_DEVICE)  # e.g. .cuda(): the buffers move, the kernel cannot follow
    with pytest.raises(ValueError, match="tiles must be on the CPU"):
        q(torch.randn(1, 64))
    assert len(lib.calls) == 1


def test_replaced_buffers_are_checked_again(lib):
    q = _linear()
    q(torch.randn(1, 64))
    q.tile_offsets = q.tile_offsets.int()
    with pytest.raises(ValueError, match="tile_offsets must be torch.int64"):
        q(torch.randn(1, 64))
    q = _linear()
    q.bias = torch.nn.Parameter(torch.zeros(32, dtype=torch.bfloat16), False)
    with pytest.raises(ValueError, match="bias must be torch.float32"):
        q(torch.randn(1, 64))


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda q: q.tile_offsets.add_(1), r"tile_offsets point outside tiles \(1280 bytes\)"),
        (lambda q: q.tile_offsets.sub_(1), "tile_offsets point outside tiles"),
        (lambda q: q.tile_bits.fill_(5), "tile_bits must all be one of"),
        (lambda q: setattr(q, "tiles", q.tiles[:-1]), "tile_offsets point outside tiles"),
    ],
)
def test_tiles_the_kernel_would_read_past_are_refused(lib, change, message):
    q = _linear()  # 2 int4 tiles of 2 groups: 2 * 2 * 320 bytes
    change(q)
    with pytest.raises(ValueError, match=message):
        q(torch.randn(1, 64))
    assert not lib.calls


@pytest.mark.parametrize(
    "status, error", [(Status.ERR_NO_MEMORY, MemoryError), (Status.ERR_INVALID_ARGUMENT, ValueError)]
)
def test_the_kernels_status_becomes_its_exception(lib, status, error):
    lib.status = status
    with pytest.raises(error, match="^qgemm: "):
        _linear()(torch.randn(2, 64))
