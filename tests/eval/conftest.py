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
