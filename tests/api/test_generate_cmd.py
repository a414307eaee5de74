"""`specdec generate` end to end on a tiny pair: it warms the engine up before its first token
unless told not to, and says how long loading and warm-up took."""

import pytest

from specdec.api.cli import main
from specdec.testing import write_tiny_pair


@pytest.fixture(scope="module")
def flags(tmp_path_factory):
    target, draft = write_tiny_pair(tmp_path_factory.mktemp("pair"))
    return ["--target", str(target), "--draft", str(draft), "--dtype", "float32",
            "--kv-cache-memory", "0.05", "--max-tokens", "6", "--ignore-eos", "--temperature", "0"]


def test_generate_warms_up_before_its_first_token(flags, capsys):
    assert main(["generate", "def fib(n):", *flags]) == 0
    err = capsys.readouterr().err
    assert "loaded in" in err and "warmed up in" in err


def test_no_warmup_skips_it(flags, capsys, monkeypatch):
    import specdec.warmup

    monkeypatch.setattr(specdec.warmup, "warm_up", lambda engine: pytest.fail("warm-up ran"))
    assert main(["generate", "def fib(n):", "--no-warmup", *flags]) == 0
    err = capsys.readouterr().err
    assert "loaded in" in err and "warmed up" not in err
