"""`specdec generate` end to end on a tiny pair: it warms the engine up before its first token
unless told not to, says how long loading and warm-up took, and prints logprobs when asked."""

import math
import re

import pytest

from specdec.api.cli import main
from specdec.testing import write_tiny_pair


ROW = re.compile(r"^\s*(\d+)\s+(?:'.*?'|\".*?\")\s+(-?\d+\.\d{4})\s+(\d\.\d{3})\s")  # #, token, logprob, p


@pytest.fixture(scope="module")
def flags(tmp_path_factory):
    target, draft = write_tiny_pair(tmp_path_factory.mktemp("pair"))
    return ["--target", str(target), "--draft", str(draft), "--dtype", "float32",
            "--kv-cache-memory", "0.05", "--max-tokens", "6", "--ignore-eos", "--temperature", "0"]


def test_generate_warms_up_before_its_first_token(flags, capsys):
    assert main(["generate", "def fib(n):", *flags]) == 0
    err = capsys.readouterr().err
    assert "loaded in" in err and "warmed up in" in err
    # what the models take, both together: a float32 tiny pair's weights and the pools' 0.05 GiB
    weights, kv = map(float, re.search(r"weights ([\d.]+) MB · KV pools up to ([\d.]+) MB", err.replace("\n", " ")).groups())
    assert 0 < weights < 50 and abs(kv - 0.05 * 1073.7) < 1


def test_no_warmup_skips_it(flags, capsys, monkeypatch):
    import specdec.warmup

    monkeypatch.setattr(specdec.warmup, "warm_up", lambda engine: pytest.fail("warm-up ran"))
    assert main(["generate", "def fib(n):", "--no-warmup", *flags]) == 0
    err = capsys.readouterr().err
    assert "loaded in" in err and "warmed up" not in err


def test_logprobs_table_after_the_answer(flags, capsys):
    assert main(["generate", "def fib(n):", "--no-warmup", "--quiet-stats", "--logprobs", "2", *flags]) == 0
    out = capsys.readouterr().out
    assert "logprob" in out and "most likely at this position" in out
    rows = [m.groups() for m in map(ROW.match, out.splitlines()) if m]
    assert [int(row[0]) for row in rows] == list(range(6))  # one row per token (--max-tokens 6)
    for _, logprob, p in rows:
        assert float(logprob) <= 0 and abs(math.exp(float(logprob)) - float(p)) < 1e-3


def test_sampling_control_flags_reach_the_params():
    from specdec.api.args import sampling_params_from_args
    from specdec.api.cli import build_parser

    args = build_parser().parse_args(["generate", "x", "--min-p", "0.1", "--presence-penalty", "0.5",
                                      "--frequency-penalty", "1.5", "--repetition-penalty", "1.2"])
    params = sampling_params_from_args(args)
    assert (params.min_p, params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (
        0.1, 0.5, 1.5, 1.2)
