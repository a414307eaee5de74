"""Static-shape (bucketed) decode and verify steps, the path CUDA graphs capture, run eagerly on
the CPU: each step padded to its token bucket (padded rows writing to a block no sequence reads,
padded sequences with no rows) gives the plain step's logits bitwise, and leaves the caches as
the plain step does."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # before anything compiles a Triton kernel
    os.environ.setdefault("TRITON_INTERPRET", "1")

from specdec.cache.triton_attention import triton_available  # noqa: E402
from specdec.target.runner import ModelRunner, Window  # noqa: E402
from specdec.target.static_step import TOKEN_BUCKETS, bucket_for  # noqa: E402
from specdec.testing import from_hf, tiny_hf_model  # noqa: E402

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30], [40], [12, 13, 14]]
BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    not triton_available() or (not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"),
    reason="triton is not installed, or TRITON_INTERPRET was unset"))]


def test_buckets_hold_every_step_up_to_the_largest():
    assert [bucket_for(n) for n in (1, 2, 3, 5, 9, 17, 25, 33)] == [1, 2, 4, 8, 16, 24, 32, 48]
    assert bucket_for(TOKEN_BUCKETS[-1]) == TOKEN_BUCKETS[-1] and bucket_for(TOKEN_BUCKETS[-1] + 1) is None


def _runners(arch: str, backend: str):
    """A plain and a bucketed runner over one bf16 model. bf16: the CPU's bf16 matmul gives a row
    the same bits whatever the rows beside it; its fp32 one (MKL) takes other kernels for 3 to 11
    rows, so bucketed fp32 steps of those sizes differ from plain ones in the last bits."""
    model = from_hf(tiny_hf_model(arch)).to(torch.bfloat16)
    return [ModelRunner.build(model, 4, num_blocks=64, attention_backend=backend, static_steps=mode)
            for mode in ("off", "eager")]


def _drive(runner: ModelRunner, schedule) -> list[torch.Tensor]:
    """Prefill PROMPTS, then `schedule`'s steps (lists of (sequence, new tokens, rolled back));
    the logits of every step."""
    tables = [runner.new_table() for _ in PROMPTS]
    seqs = [list(p) for p in PROMPTS]
    for t, s in zip(tables, seqs):
        t.ensure_slots(len(s))
    out = [runner.forward([Window(t, list(s), 1) for t, s in zip(tables, seqs)])]
    for step in schedule:
        windows = []
        for b, new, back in step:
            if back:  # a rejected draft: the table rolls back before the next window
                tables[b].truncate(tables[b].num_computed - back)
                del seqs[b][-back:]
            seqs[b].extend(new)
            tables[b].ensure_slots(len(seqs[b]))
            ids = torch.tensor(new) if b % 2 else list(new)  # draft tokens arrive as device tensors too
            windows.append(Window(tables[b], ids, len(new)))
        out.append(runner.forward(windows))
    for t in tables:
        t.free()
    assert runner.pool.num_free == runner.pool.num_blocks
    return out


SCHEDULE = [
    [(0, [50], 0)],  # one decode row: the 1-token bucket
    [(b, [60 + b], 0) for b in range(5)],  # five decode rows: padded to 8
    [(0, [1, 2, 3, 4], 0), (2, [7, 8, 9, 10], 0), (3, [11, 12, 13, 14], 0)],  # verify windows: 12 -> 16
    [(0, [30, 31], 3), (2, [32], 2), (1, [33, 34, 35], 0)],  # after rollbacks, windows of 2, 1, 3: 6 -> 8
    [(b, [70 + b, 71, 72, 73, 74], 0) for b in range(5)],  # 25 rows: the 32 bucket
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_bucketed_steps_give_the_plain_steps_logits_bitwise(arch, backend):
    plain, bucketed = _runners(arch, backend)
    ours, theirs = _drive(bucketed, SCHEDULE), _drive(plain, SCHEDULE)
    assert bucketed.static_steps.steps == {"bucketed": len(SCHEDULE), "replayed": 0, "plain": 1}
    for step, (a, b) in enumerate(zip(ours, theirs)):
        assert a.shape == b.shape and torch.equal(a, b), step
    assert plain.static_steps is None


def test_padded_rows_write_only_the_pad_block():
    """The cache outside the pool's blocks is the padded rows'; the pool's blocks hold what the plain
    runner's hold."""
    plain, bucketed = _runners("llama", "torch")
    tables = {}
    for runner in (plain, bucketed):
        t = runner.new_table()
        t.ensure_slots(3)
        runner.forward([Window(t, [5, 6, 7], 3)])  # 3 rows: the 4-token bucket, one padded row
        tables[runner] = t
    pad = bucketed.static_steps.pad_block
    assert pad == bucketed.pool.num_blocks == bucketed.kv_cache.num_blocks - 1
    k_plain, _ = plain.kv_cache.layer(0)
    k_ours, _ = bucketed.kv_cache.layer(0)
    assert torch.equal(k_ours[:pad], k_plain[:pad])
    assert k_ours[pad].abs().sum() > 0  # the padded row's key went there


def test_prefill_chunks_and_fills_run_the_plain_path():
    _, bucketed = _runners("llama", "torch")
    t = bucketed.new_table()
    t.ensure_slots(6)
    bucketed.forward([Window(t, [1, 2, 3, 4, 5, 6], 1)])  # a prompt: one row of logits of six
    assert bucketed.static_steps.steps == {"bucketed": 0, "replayed": 0, "plain": 1}
    t.free()


def test_static_steps_is_checked():
    with pytest.raises(ValueError, match="static_steps must be one of"):
        ModelRunner.build(from_hf(tiny_hf_model("llama")), 4, num_blocks=8, static_steps="yes")
