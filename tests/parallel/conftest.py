"""The tiny pair the parallel tests split, one process's logits and tokens to compare with, and
the helpers both test modules use."""

from __future__ import annotations

import pytest
import torch

from specdec import Engine, EngineConfig, SamplingParams
from specdec.target.runner import Window
from specdec.testing import tiny_hf_model, tiny_tokenizer

PROMPTS = ["def quicksort(xs):\n    if len(xs) <= 1:", "hello world, this is a test", "x = [1, 2, 3]\nprint(x"]


def save_pair(root, target: tuple[int, int], draft: tuple[int, int], scale: float = 1.0, **config) -> list[str]:
    """A tiny qwen2 target and draft ((layers, seed) each) saved as HF folders under `root`;
    their weights times `scale`."""
    tokenizer = tiny_tokenizer()
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    paths = []
    for name, (layers, seed) in (("target", target), ("draft", draft)):
        model = tiny_hf_model("qwen2", seed, vocab_size=len(tokenizer), eos_token_id=eos, bos_token_id=None,
                              num_hidden_layers=layers, **config)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(scale)
        model.save_pretrained(root / name, safe_serialization=True)
        tokenizer.save_pretrained(root / name)
        paths.append(str(root / name))
    return paths


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny fp32 target (4 query heads, 2 KV heads, 4 layers) and draft, as HF folders."""
    return save_pair(tmp_path_factory.mktemp("parallel"), (4, 0), (1, 1))


def engine(pair, **kw) -> Engine:
    target, draft = pair
    kw.setdefault("dtype", "float32")
    return Engine(EngineConfig(target=target, draft=draft, num_blocks=64, **kw))


def prompt_logits(e: Engine, ids: list[int], chunks: int = 1) -> torch.Tensor:
    """The target's logits at every position of `ids`, fed in `chunks` windows; the blocks freed."""
    runner = e.target
    table = runner.new_table()
    assert table.ensure_slots(len(ids))
    bounds = [len(ids) * i // chunks for i in range(chunks + 1)]
    out = [runner.forward([Window(table, ids[a:b], num_logits=b - a)]) for a, b in zip(bounds, bounds[1:])]
    table.free()
    return torch.cat(out)


GREEDY = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(pair):
    e = engine(pair)
    ids = e.encode(PROMPTS[0])
    out = {"logits": prompt_logits(e, ids), "tokens": [o.token_ids for o in e.generate(PROMPTS, GREEDY)], "ids": ids}
    e.close()
    return out


