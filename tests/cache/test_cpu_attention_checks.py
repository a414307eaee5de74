"""`cpu_attention.rope_write_attend` checks every tensor and size before a pointer reaches the C
kernel (`ValueError` naming it, before it even asks for the library), and hands the kernel a typed
`struct specdec_attention`. Runs without the kernel: a stand-in library records the call."""

import ctypes
import dataclasses

import pytest
import torch

from specdec.cache import cpu_attention
from specdec.kernel_abi import Attention, Status
from tests.cache.test_paged_attention import DECODE, FP8, HEAD_DIM, build_case

HQ, HKV = 4, 2


class FakeLibrary:
    """Records the descriptor `rope_write_attend` receives and returns `status`."""

    def __init__(self, status: int = Status.OK) -> None:
        self.status, self.descriptors = status, []

    def rope_write_attend(self, a, qkv, row_stride, k_cache, v_cache, scale, out, threads) -> int:
        self.descriptors.append(Attention.from_buffer_copy(ctypes.cast(a, ctypes.POINTER(Attention)).contents))
        return self.status


@pytest.fixture
def lib(monkeypatch) -> FakeLibrary:
    fake = FakeLibrary()
    monkeypatch.setattr(cpu_attention, "load_attention", lambda: fake)
    return fake


@pytest.fixture
def case():
    """(qkv, positions, cos, signed_sin, k_cache, v_cache, meta) of a decode/verify batch."""
    _, cache, meta, _ = build_case(4, HQ // HKV, torch.bfloat16, windows=DECODE)
    qkv = torch.randn(meta.num_tokens, (HQ + 2 * HKV) * HEAD_DIM).bfloat16()
    positions = torch.arange(meta.num_tokens, dtype=torch.int64)
    cos = torch.randn(200, HEAD_DIM)
    return [qkv, positions, cos, cos.clone(), *cache.layer(0), meta]


def _call(qkv, positions, cos, signed_sin, k_cache, v_cache, meta, hq=HQ, hkv=HKV):
    return cpu_attention.rope_write_attend(qkv, hq, hkv, positions, cos, signed_sin, k_cache, v_cache, meta, 0.1)


def test_a_good_call_passes_the_steps_descriptor(lib, case):
    out = _call(*case)
    qkv, positions, cos, _, k_cache, _, meta = case
    assert out.shape == (meta.num_tokens, HQ * HEAD_DIM)
    (a,) = lib.descriptors
    num_blocks, block_size = k_cache.shape[:2]
    assert (a.hq, a.hkv, a.d, a.block_size, a.num_blocks) == (HQ, HKV, HEAD_DIM, block_size, num_blocks)
    assert (a.num_slots, a.num_seqs, a.num_positions) == (num_blocks * block_size, meta.num_seqs, 200)
    assert (a.positions, a.cos, a.slots) == (positions.data_ptr(), cos.data_ptr(), meta.slot_mapping.data_ptr())
    assert a.max_blocks == meta.block_tables.shape[1]


def _replace(case, i, value):
    case = list(case)
    case[i] = value
    return case


def _meta(case, **changes):
    return _replace(case, 6, dataclasses.replace(case[6], **changes))


BAD = {
    "qkv on another device": (lambda c: _replace(c, 0, c[0].to("meta")), "qkv must be on the CPU"),
    "qkv fp32": (lambda c: _replace(c, 0, c[0].float()), "qkv must be torch.bfloat16"),
    "qkv strided": (lambda c: _replace(c, 0, c[0].repeat(1, 2)[:, ::2]), "qkv must be contiguous"),
    "qkv too narrow": (lambda c: _replace(c, 0, c[0][:, :-32].contiguous()), r"qkv must have shape \[31, 256\]"),
    "k_cache fp8": (lambda c: _replace(c, 4, c[4].to(FP8)), "k_cache must be torch.bfloat16"),
    "v_cache other shape": (lambda c: _replace(c, 5, c[5][:-1]), "v_cache must have shape"),
    "head_dim 48": (lambda c: _replace(c, 4, torch.zeros(*c[4].shape[:3], 48, dtype=torch.bfloat16)),
                    "head_dim must be a multiple of 32 up to 512"),
    "head_dim 544": (lambda c: _replace(c, 4, torch.zeros(*c[4].shape[:3], 544, dtype=torch.bfloat16)),
                     "head_dim must be a multiple of 32 up to 512"),
    "positions int32": (lambda c: _replace(c, 1, c[1].int()), "positions must be torch.int64"),
    "cos fp16": (lambda c: _replace(c, 2, c[2].half()), "cos must be torch.float32"),
    "signed_sin shorter": (lambda c: _replace(c, 3, c[3][:10]), r"signed_sin must have shape \[200, 32\]"),
    "no cos": (lambda c: _replace(c, 2, None), "rope needs the cos and signed_sin tables"),
    "seq_lens int64": (lambda c: _meta(c, seq_lens=c[6].seq_lens.long()), "meta.seq_lens must be torch.int32"),
    "slots on another device": (lambda c: _meta(c, slot_mapping=c[6].slot_mapping.to("meta")),
                                "meta.slot_mapping must be on the CPU"),
    "block tables strided": (lambda c: _meta(c, block_tables=c[6].block_tables.t().contiguous().t()),
                             "meta.block_tables must be contiguous"),
}


@pytest.mark.parametrize("name", BAD)
def test_bad_input_is_a_value_error_naming_it(lib, case, name):
    change, message = BAD[name]
    with pytest.raises(ValueError, match=message):
        _call(*change(case))
    assert not lib.descriptors


def test_heads_that_do_not_group_are_refused(lib, case):
    with pytest.raises(ValueError, match="num_q_heads \\(3\\) must be a multiple of num_kv_heads \\(2\\)"):
        _call(*case, hq=3)


def test_bad_input_is_reported_before_a_missing_library(case, monkeypatch):
    monkeypatch.setenv("SPECDEC_NO_KERNELS", "1")
    with pytest.raises(ValueError, match="qkv must be torch.bfloat16"):
        _call(*BAD["qkv fp32"][0](case))
    with pytest.raises(RuntimeError, match="SPECDEC_NO_KERNELS=1"):
        _call(*case)


@pytest.mark.parametrize("status, message", [(Status.ERR_SLOT, "slot is outside"), (Status.ERR_LENGTHS, "disagree")])
def test_the_kernels_status_becomes_a_value_error(lib, case, status, message):
    lib.status = status
    with pytest.raises(ValueError, match=f"^rope_write_attend: .*{message}"):
        _call(*case)
