"""Our Llama-family forward matches transformers on the same weights (fp32, tiny random configs)."""

import pytest
import torch

from specdec.target.runner import ModelRunner, Window
from specdec.testing import from_hf, tiny_hf_model

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [3, 4], [20, 21, 22, 23, 24, 25]]
TOL = 1e-4


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]  # [T, V]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_prefill_batch_matches_transformers(arch, block_size):
    assert_prefill_matches(tiny_hf_model(arch), block_size, PROMPTS)


def assert_prefill_matches(hf, block_size: int, prompts: list[list[int]]) -> None:
    """One batched prefill of `prompts` through our paged model, each row within TOL of `hf`'s."""
    runner = ModelRunner.build(from_hf(hf), block_size=block_size, num_blocks=128)
    tables = [runner.new_table() for _ in prompts]
    for table, p in zip(tables, prompts):
        assert table.ensure_slots(len(p))
    logits = runner.forward([Window(t, p, len(p)) for t, p in zip(tables, prompts)])
    rows = torch.split(logits, [len(p) for p in prompts])
    for p, ours in zip(prompts, rows):
        assert (ours - _hf_logits(hf, p)).abs().max().item() < TOL


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_step_by_step_decode_matches_transformers(arch):
    """Prefill, then feed windows of 1..3 tokens per sequence, as verification does."""
    hf = tiny_hf_model(arch, tie_word_embeddings=(arch == "qwen2"))
    runner = ModelRunner.build(from_hf(hf), block_size=4, num_blocks=128)
    continuations = [[30, 31, 32, 33, 34, 35], [40, 41, 42, 43, 44, 45], [50, 51, 52, 53, 54, 55]]
    tables = [runner.new_table() for _ in PROMPTS]
    seqs = [list(p) for p in PROMPTS]
    windows = [Window(t, list(s), 1) for t, s in zip(tables, seqs)]
    for w, s in zip(windows, seqs):
        w.table.ensure_slots(len(s))
    runner.forward(windows)
    for step, width in enumerate([1, 3, 2]):
        windows = []
        for t, s, cont in zip(tables, seqs, continuations):
            new = cont[: width]
            del cont[: width]
            s.extend(new)
            t.ensure_slots(len(s))
            windows.append(Window(t, new, len(new)))
        logits = runner.forward(windows)
        rows = torch.split(logits, [len(w.token_ids) for w in windows])
        for s, w, ours in zip(seqs, windows, rows):
            ref = _hf_logits(hf, s)[-len(w.token_ids):]
            assert (ours - ref).abs().max().item() < TOL, f"step {step}"


def test_rollback_then_rewrite_gives_fresh_logits():
    """Truncating a table and feeding different tokens overwrites the stale slots."""
    hf = tiny_hf_model("llama")
    runner = ModelRunner.build(from_hf(hf), block_size=4, num_blocks=32)
    table = runner.new_table()
    prompt = [5, 6, 7, 8, 9]
    table.ensure_slots(len(prompt) + 4)
    runner.forward([Window(table, prompt + [60, 61, 62], 1)])  # speculative tokens, later rejected
    table.truncate(len(prompt))
    logits = runner.forward([Window(table, [70, 71], 2)])
    ref = _hf_logits(hf, prompt + [70, 71])[-2:]
    assert (logits - ref).abs().max().item() < TOL


def test_unsupported_architecture_is_a_clear_error():
    from transformers import GPT2Config

    from specdec.target.config import ModelConfig, UnsupportedModelError

    config = GPT2Config()
    config.architectures = ["GPT2LMHeadModel"]
    with pytest.raises(UnsupportedModelError, match="supports"):
        ModelConfig.from_hf(config)
