"""`specdec models`: the default pair's state, the cache by model with sizes, and its removal."""

from __future__ import annotations

import pytest

from specdec.api import models_cmd
from specdec.api.cli import main
from specdec.target import default_pair
from specdec.target.default_pair import DEFAULT_DRAFT, DEFAULT_TARGET, ModelsNotInstalledError

TARGET = "Qwen2.5-Coder-1.5B-Instruct-Q4_K_M"
DRAFT = "Qwen2.5-Coder-0.5B-Instruct-Q4_K_M"
QUANTIZED = f"{TARGET}-cc324af070c2-w4a8-auto-bfloat16-0123456789abcdef.safetensors"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A cache folder as the default pair leaves it, plus a kernel and a folder specdec never writes."""
    root = tmp_path / "cache"
    monkeypatch.setenv("SPECDEC_CACHE", str(root))
    monkeypatch.setenv("COLUMNS", "240")  # rich: no folding of long names in the assertions
    gguf = default_pair.gguf_path(DEFAULT_TARGET)
    gguf.parent.mkdir(parents=True)
    gguf.write_bytes(b"G" * 50_000)
    default_pair._write_marker(gguf, DEFAULT_TARGET)  # "assembled and checked"
    converted = root / "converted" / f"{TARGET}-cc324af070c2"
    converted.mkdir(parents=True)
    (converted / "model.safetensors").write_bytes(b"C" * 200_000)
    (converted / "config.json").write_text("{}")
    (root / "quantized").mkdir()
    (root / "quantized" / QUANTIZED).write_bytes(b"Q" * 70_000)
    (root / "converted" / f"{DRAFT}-1d9614638d18").mkdir()
    (root / "kernels").mkdir()
    (root / "kernels" / "qgemm-0123456789abcdef.so").write_bytes(b"K" * 1000)
    (root / "notes").mkdir()
    (root / "notes" / "mine.txt").write_text("not specdec's")
    return root


def test_lists_the_cache_by_model_with_sizes_and_a_total(cache, capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    entries = models_cmd.scan_cache(cache)
    by_name = {e.path.name: e for e in entries}
    assert by_name[QUANTIZED].model == TARGET and by_name[QUANTIZED].detail == "w4a8-auto, bfloat16"
    assert by_name[f"{TARGET}-cc324af070c2"].bytes_on_disk >= 200_000  # the folder's files, like du
    assert by_name["mine.txt"].folder == "notes" and "kept" in by_name["mine.txt"].detail
    for name in (TARGET, DRAFT, f"gguf/{TARGET}.gguf", f"quantized/{QUANTIZED}", "kernels/qgemm-"):
        assert name in out
    total = sum(e.bytes_on_disk for e in entries)
    assert total >= 321_000 and models_cmd.human(total) in out
    target_total = sum(e.bytes_on_disk for e in entries if e.model == TARGET)
    assert models_cmd.human(target_total) in out


def test_shows_the_pair_and_how_to_remove_it(cache, capsys, monkeypatch):
    def missing(packed):
        raise ModelsNotInstalledError(f"package of {packed.name} missing")

    monkeypatch.setattr(models_cmd, "find_parts", missing)
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "not installed" in out and default_pair.INSTALL_COMMAND in out
    assert f"assembled copy {default_pair.gguf_path(DEFAULT_TARGET)} (sha256 checked)" in out
    assert str(default_pair.gguf_path(DEFAULT_DRAFT)) not in out  # never assembled
    paths = " ".join(str(cache / name) for name in ("gguf", "converted", "quantized", "kernels"))
    assert f"rm -rf {paths}\n" in out  # specdec's own folders only: notes/ is not in it
    assert "specdec models --remove-cache" in out
    assert f"pip uninstall -y {DEFAULT_TARGET.dist_prefix}{{1..{DEFAULT_TARGET.num_parts}}}" in out


def test_remove_cache_deletes_only_specdecs_folders(cache, capsys):
    assert main(["models", "--remove-cache", "--yes"]) == 0
    assert sorted(p.name for p in cache.iterdir()) == ["notes"]
    assert (cache / "notes" / "mine.txt").is_file()
    assert "Removed" in capsys.readouterr().out


def test_remove_cache_asks_first(cache, monkeypatch):
    monkeypatch.setattr("builtins.input", lambda prompt="": "n")
    assert main(["models", "--remove-cache"]) == 1
    assert (cache / "quantized" / QUANTIZED).is_file()
    monkeypatch.setattr("builtins.input", lambda prompt="": "y")
    assert main(["models", "--remove-cache"]) == 0
    assert not (cache / "quantized").exists()


def test_remove_cache_without_an_answer_removes_nothing(cache, monkeypatch):
    def closed(prompt=""):
        raise EOFError

    monkeypatch.setattr("builtins.input", closed)  # stdin not a terminal, no --yes
    assert main(["models", "--remove-cache"]) == 1
    assert (cache / "gguf").is_dir()


def test_empty_cache(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "nothing"))
    assert main(["models", "--remove-cache", "--yes"]) == 0
    out = capsys.readouterr().out
    assert "empty" in out and "Nothing to remove" in out


def test_lists_every_family_it_runs_mixtures_of_experts_included(cache, capsys):
    from specdec.target.config import SUPPORTED_ARCHITECTURES

    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert set(models_cmd.FAMILIES) == set(SUPPORTED_ARCHITECTURES)  # the table cannot go stale
    for arch in ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM", "OlmoeForCausalLM", "qwen3moe"):
        assert arch in out
