"""`specdec eval perplexity`: llama-perplexity's method (whole chunks, BOS first, second halves
scored) on the engine's target, checked against transformers scoring the same chunks."""

from __future__ import annotations

import json
import math

import pytest
import torch

from specdec.api.cli import main
from specdec.eval import perplexity

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

TEXT = ("The quick brown fox jumps over the lazy dog. def add(a, b):\n    return a + b\n"
        "Speculative decoding: the draft proposes, the target verifies. ") * 12


def test_chunks_are_whole_each_led_by_bos():
    ids = list(range(10, 33))  # 23 tokens: two chunks of 10, the last 3 dropped
    assert perplexity.chunk_tokens(ids, 10, bos=1, max_chunks=None) == [[1, *range(11, 20)], [1, *range(21, 30)]]
    assert perplexity.chunk_tokens(ids, 10, bos=None, max_chunks=1) == [list(range(10, 20))]
    with pytest.raises(ValueError, match="fewer than one chunk"):
        perplexity.chunk_tokens(ids[:9], 10, bos=1, max_chunks=None)


def test_perplexity_is_transformers_on_the_same_chunks(tiny_dirs):
    from transformers import AutoModelForCausalLM

    from specdec import Engine, EngineConfig

    target, _ = tiny_dirs
    engine = Engine(EngineConfig(target=str(target), proposer="none", dtype="float32", target_quant="none",
                                 kv_cache_memory_gib=0.05))
    ours = perplexity.perplexity(engine, TEXT, ctx=32, max_chunks=3, progress=False)
    assert engine.target.pool.num_used == 0  # every chunk's table freed

    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    ids = engine.encode(TEXT)
    nlls = []
    for i in range(3):
        chunk = torch.tensor([ids[32 * i:32 * (i + 1)]])
        with torch.no_grad():
            logits = hf(chunk).logits[0]
        nlls += torch.nn.functional.cross_entropy(logits[16:31], chunk[0, 17:], reduction="none").tolist()
    assert ours.chunks == 3 and ours.scored_tokens == len(nlls) == 45
    assert ours.nll == pytest.approx(sum(nlls) / len(nlls), rel=1e-4)
    assert ours.ppl == pytest.approx(math.exp(ours.nll))
    assert ours.chunk_ppl[-1] == pytest.approx(ours.ppl)


def test_command_writes_the_table_and_the_text_it_scored(tmp_path, tiny_dirs):
    target, _ = tiny_dirs
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    out = tmp_path / "ppl"
    flags = ["--target", str(target), "--dtype", "float32", "--kv-cache-memory", "0.05", "--no-progress"]
    assert main(["eval", "perplexity", *flags, "--text", str(text), "--ctx", "16", "--chunks", "2",
                 "--out", str(out)]) == 0
    data = json.loads((out / "perplexity.json").read_text())
    assert data["specdec"]["chunks"] == 2 and data["specdec"]["scored_tokens"] == 14
    assert data["llama_cpp"] is None
    assert (out / "text.txt").read_text() == TEXT
    assert "| specdec |" in (out / "perplexity.md").read_text()


def test_command_refuses_llama_cpp_without_a_gguf(tmp_path, tiny_dirs, capsys):
    target, _ = tiny_dirs
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    argv = ["eval", "perplexity", "--target", str(target), "--text", str(text), "--llama-bin", str(tmp_path),
            "--out", str(tmp_path / "o")]
    assert main(argv) == 2
    assert "--llama-bin needs a GGUF" in capsys.readouterr().err
