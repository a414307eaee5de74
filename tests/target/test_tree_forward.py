"""A token tree through the model (issue 62): `Window(parents=...)` puts each row at the prefix's
end plus its depth and lets it attend to its ancestors only, so each node's logits are transformers'
after the prompt and its path; after `keep_tree_path` + `copy_slots` keep one path, decoding goes on
as if that path had been fed as a chain. A prompt chunk longer than a tree rides beside it."""

import pytest
import torch

from specdec.cache import cpu_attention
from specdec.target.runner import ModelRunner, Window
from specdec.testing import from_hf, tiny_hf_model

PROMPT = [5, 6, 7, 8, 9, 10, 11]
# rows: 0 the prompt's last token; 1, 2 under it; 3 under 1; 4, 5 under 3; 6 under 2
PARENTS = [-1, 0, 0, 1, 3, 3, 2]
TOKENS = [PROMPT[-1], 40, 41, 42, 43, 44, 45]


def _path(row: int) -> list[int]:
    rows = []
    while row >= 0:
        rows.append(row)
        row = PARENTS[row]
    return rows[::-1]


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]  # [T, V]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("block_size", [1, 4])
def test_each_node_gets_its_paths_logits_and_a_kept_path_decodes_on(arch, block_size):
    hf = tiny_hf_model(arch)
    runner = ModelRunner.build(from_hf(hf), block_size=block_size, num_blocks=256)
    table, other = runner.new_table(), runner.new_table()
    table.ensure_slots(len(PROMPT) + len(TOKENS))
    runner.forward([Window(table, PROMPT[:-1], 0)])
    chunk = [(7 * i) % 90 + 1 for i in range(70)]  # another request's 70-token prompt chunk in the same forward
    other.ensure_slots(len(chunk))
    logits = runner.forward([Window(table, TOKENS, len(TOKENS), parents=PARENTS), Window(other, chunk, 1)])
    for row in range(len(TOKENS)):
        ref = _hf_logits(hf, PROMPT[:-1] + [TOKENS[r] for r in _path(row)])[-1]
        assert (logits[row] - ref).abs().max().item() < 1e-4, row
    assert (logits[-1] - _hf_logits(hf, chunk)[-1]).abs().max().item() < 1e-4

    kept = _path(5)[1:]  # rows 1, 3, 5 accepted
    src, dst = table.keep_tree_path(len(PROMPT) - 1, kept)
    runner.kv_cache.copy_slots(src, dst)
    table.ensure_slots(table.num_computed + 1)
    next_logits = runner.forward([Window(table, [77], 1)])
    ref = _hf_logits(hf, PROMPT + [TOKENS[r] for r in kept] + [77])[-1]
    assert (next_logits[0] - ref).abs().max().item() < 1e-4


@pytest.mark.skipif(cpu_attention.load_attention() is None, reason="CPU attention kernel unavailable")
@pytest.mark.parametrize("prefix", [0, 41])  # 41: the window straddles a 16-key chunk's end (at 48)
def test_the_c_kernel_path_gives_each_node_its_chains_logits(prefix):
    """bf16 on the CPU (the C attention kernel): a node's logits are bitwise those of its path fed
    as a chain (the kernel reads a node's visible keys as one run, in the chain's chunks), so
    greedy tree speculation keeps target-only's tokens even at near ties."""
    hf = tiny_hf_model("qwen2")
    runner = ModelRunner.build(from_hf(hf, torch.bfloat16), block_size=4, num_blocks=256)
    prompt = [(11 * i) % 80 + 3 for i in range(prefix)] + PROMPT
    table = runner.new_table()
    table.ensure_slots(len(prompt) + len(TOKENS))
    runner.forward([Window(table, prompt[:-1], 0)])
    logits = runner.forward([Window(table, TOKENS, len(TOKENS), parents=PARENTS)]).float()
    for row in range(len(TOKENS)):
        chain = runner.new_table()  # the same prefill, then the path verified as a chain
        path = [TOKENS[r] for r in _path(row)]
        chain.ensure_slots(len(prompt) - 1 + len(path))
        runner.forward([Window(chain, prompt[:-1], 0)])
        ref = runner.forward([Window(chain, path, len(path))]).float()[-1]
        chain.free()
        assert torch.equal(logits[row], ref), row


def test_a_bad_tree_is_refused():
    runner = ModelRunner.build(from_hf(tiny_hf_model("llama")), block_size=4, num_blocks=16)
    table = runner.new_table()
    table.ensure_slots(4)
    with pytest.raises(ValueError, match="earlier row"):
        runner.forward([Window(table, [1, 2, 3], 3, parents=[-1, 2, 0])])
