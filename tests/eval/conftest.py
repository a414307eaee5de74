"""Tiny random model folders for the eval smoke runs (written once per session)."""

from __future__ import annotations

import pytest

from specdec.testing import write_tiny_pair


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """(target_dir, draft_dir): HF folders with the tiny tokenizer, usable as --target / --draft."""
    return write_tiny_pair(tmp_path_factory.mktemp("tiny_pair"))


@pytest.fixture
def engine_flags(tiny_dirs):
    """Engine flags for a tiny run where the draft IS the target, so greedy drafts are all accepted."""
    target, _ = tiny_dirs
    return ["--target", str(target), "--draft", str(target), "--dtype", "float32", "--kv-cache-memory", "0.05"]


_PROMPTS = [
    {"id": "fib", "prompt": "def fib(n):\n    "},
    {"id": "sort", "prompt": "def quicksort(xs):\n    if len(xs) <= 1:\n"},
    {"id": "chat", "prompt": "The quick brown fox", "chat": True},
]


@pytest.fixture(scope="session")
def prompts_file(tmp_path_factory):
    """A JSON-lines prompt file (`--datasets FILE`), so smoke runs need no dataset package."""
    import json

    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in _PROMPTS))
    return path


@pytest.fixture(scope="session")
def sharegpt_file(tmp_path_factory):
    """A small file in ShareGPT's format (`bench serve --dataset-path`)."""
    import json

    lines = ["for i in range(10):", "print(i * i)", "The quick brown fox jumps over the lazy dog."]
    entries = [
        {"id": f"c{i}", "conversations": [
            {"from": "human", "value": f"{lines[i % 3]} {lines[(i + 1) % 3]}"},
            {"from": "gpt", "value": " ".join(lines)},
        ]}
        for i in range(12)
    ]
    path = tmp_path_factory.mktemp("sharegpt") / "sharegpt.json"
    path.write_text(json.dumps(entries))
    return path


@pytest.fixture(scope="session")
def sharegpt_multi_turn_file(tmp_path_factory):
    """ShareGPT-format conversations of 1 to 4 (human, gpt) turns (`bench serve --multi-turn`)."""
    import json

    lines = ["for i in range(10):", "print(i * i)", "The quick brown fox jumps over the lazy dog.",
             "def quicksort(xs):", "Speculative decoding: a draft proposes, the target verifies."]
    entries = []
    for i in range(8):
        turns = 1 + i % 4  # 1, 2, 3, 4 turns: a quarter of them single-turn
        conversation = []
        for t in range(turns):
            conversation += [
                {"from": "human", "value": f"{lines[(i + t) % 5]} {lines[(i + t + 1) % 5]}"},
                {"from": "gpt", "value": " ".join(lines[:3])},
            ]
        entries.append({"id": f"m{i}", "conversations": conversation})
    path = tmp_path_factory.mktemp("sharegpt_multi") / "sharegpt_multi.json"
    path.write_text(json.dumps(entries))
    return path
