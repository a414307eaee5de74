"""A target given alone (no `--draft`) whose tokenizer is not the default draft's (Qwen2.5's)
decodes with prompt lookup instead of failing, and the load line says why; a draft the user names
is still checked, and a target the default draft fits keeps it."""

from __future__ import annotations

import pytest

from specdec import engine_parts
from specdec.config import EngineConfig
from specdec.engine import Engine
from specdec.engine_parts import TokenizerMismatchError
from specdec.sampling_params import SamplingParams
from specdec.target.default_pair import ModelsNotInstalledError
from specdec.target.model_files import DEFAULT_DRAFT_SPEC
from specdec.testing import write_tiny_pair
from tests.target.conftest import build_tiny_tokenizer

PROMPTS = ["def fib(n):", "the the the the"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(target, draft sharing its tokenizer, a model of another tokenizer)."""
    root = tmp_path_factory.mktemp("pairs")
    target, draft = write_tiny_pair(root / "same")
    _, other = write_tiny_pair(root / "other")
    build_tiny_tokenizer().save_pretrained(other)  # other specials, other ids
    return target, draft, other


def _default_draft_is(monkeypatch, folder):
    """The default draft resolves to `folder` (None: its packages are not installed)."""
    real = engine_parts.resolve_model

    def resolve(spec, **kw):
        if spec != DEFAULT_DRAFT_SPEC:
            return real(spec, **kw)
        if folder is None:
            raise ModelsNotInstalledError("the default pair is not installed")
        return folder

    monkeypatch.setattr(engine_parts, "resolve_model", resolve)


def _engine(**kw) -> Engine:
    return Engine(EngineConfig(dtype="float32", kv_cache_memory_gib=0.05, **kw))


@pytest.mark.parametrize("default_draft, why", [("other", "another tokenizer"), (None, "not installed")])
def test_a_target_alone_decodes_with_prompt_lookup(folders, monkeypatch, default_draft, why):
    target, _, other = folders
    _default_draft_is(monkeypatch, other if default_draft else None)
    engine = _engine(target=str(target))  # draft: the default
    assert engine.config.proposer == "ngram" and engine.config.draft is None
    assert why in engine.proposer_note and "--draft" in engine.proposer_note
    alone = _engine(target=str(target), proposer="none")
    assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == [o.token_ids for o in alone.generate(PROMPTS, GREEDY)]


def test_a_default_draft_of_the_same_tokenizer_is_kept(folders, monkeypatch):
    target, draft, _ = folders
    _default_draft_is(monkeypatch, draft)
    engine = _engine(target=str(target))
    assert engine.config.proposer == "hybrid" and engine.proposer_note is None


def test_a_named_draft_of_another_tokenizer_is_refused(folders):
    target, _, other = folders
    with pytest.raises(TokenizerMismatchError, match="token ids differ"):
        _engine(target=str(target), draft=str(other))


def test_the_load_line_says_prompt_lookup_and_why(folders, monkeypatch, capsys):
    from specdec.api.cli import main

    target, _, other = folders
    _default_draft_is(monkeypatch, other)
    assert main(["generate", "def fib(n):", "--target", str(target), "--dtype", "float32", "--kv-cache-memory",
                 "0.05", "--max-tokens", "4", "--no-warmup"]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert "ngram proposer, k=" in err and "prompt lookup: the default draft (Qwen2.5) has another tokenizer" in err
