"""`python -m specdec.eval.roofline`: the ceilings' arithmetic, the measuring kernels at every level,
what a model and a GGUF file read per token, and the command on the tiny pair."""

from __future__ import annotations

import argparse
import ctypes

import numpy as np
import pytest
import torch

from specdec import native
from specdec.eval import roofline
from specdec.eval.roofline import Machine, ModelCost, Workload

GB = 1e9
MACHINE = Machine(threads=2, read_bytes_per_s=40 * GB, int8_macs_per_s={"avx2": 400 * GB, "avx512-vnni": 800 * GB})
# 1 GB and 1 G multiply-adds a token, 0.2 G of them in the LM head: 25 ms memory floor, 2.5 ms a row at avx2
TARGET = ModelCost("target", bytes_per_token=int(1 * GB), macs_per_token=int(1 * GB), head_macs=int(0.2 * GB))
DRAFT = ModelCost("draft", bytes_per_token=int(0.2 * GB), macs_per_token=int(0.2 * GB), head_macs=int(0.1 * GB))


def test_expected_tokens_is_the_geometric_sum():
    assert roofline.expected_tokens(0.5, 0) == 1.0
    assert roofline.expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert roofline.expected_tokens(0.0, 5) == 1.0


def test_a_forward_is_bound_by_memory_until_its_rows_make_it_compute_bound():
    assert TARGET.forward_s(MACHINE, "avx2", 1) == pytest.approx(0.025)  # 1 GB at 40 GB/s
    assert TARGET.forward_s(MACHINE, "avx2", 10) == pytest.approx(0.025)  # 10 x 2.5 ms of compute
    assert TARGET.forward_s(MACHINE, "avx2", 20) == pytest.approx(0.05)
    assert TARGET.forward_s(MACHINE, "avx512-vnni", 20) == pytest.approx(0.025)
    # a prompt needs the LM head for its last row only: 100 x 0.8 G + 0.2 G multiply-adds
    assert TARGET.forward_s(MACHINE, "avx2", 100, 1) == pytest.approx(80.2 / 400)


def test_target_only_request_is_the_prompt_then_memory_bound_steps():
    work = Workload("w", prompt_tokens=100, acceptance=0.8)
    expected = 80.2 / 400 + 127 * 0.025
    assert roofline.request_s(TARGET, DRAFT, MACHINE, "avx2", work, 128, 0) == pytest.approx(expected)
    assert roofline.request_s(TARGET, None, MACHINE, "avx2", work, 128, 3) == pytest.approx(expected)


def test_speculative_request_counts_drafts_verify_rows_and_both_prefills():
    work = Workload("w", prompt_tokens=100, acceptance=0.8)
    prefill = 80.2 / 400 + (100 * 0.1 + 0.1) / 400  # target, then draft (0.1 G a row without its head)
    step = 3 * 0.005 + 0.025  # 3 drafts at 5 ms (memory), 4 verify rows still memory-bound
    expected = prefill + 127 * step / roofline.expected_tokens(0.8, 3)
    assert roofline.request_s(TARGET, DRAFT, MACHINE, "avx2", work, 128, 3) == pytest.approx(expected)


def test_best_speculative_k_grows_with_acceptance():
    low, high = Workload("low", 100, 0.3), Workload("high", 100, 0.95)
    k_low, rate_low = roofline.best_speculative(TARGET, DRAFT, MACHINE, "avx2", low, 128, 8)
    k_high, rate_high = roofline.best_speculative(TARGET, DRAFT, MACHINE, "avx2", high, 128, 8)
    assert k_low < k_high and rate_low < rate_high
    for k in range(1, 9):  # the best k is the fastest of them all
        assert 128 / roofline.request_s(TARGET, DRAFT, MACHINE, "avx2", high, 128, k) <= rate_high + 1e-9


def test_the_oracle_drafts_each_right_run_up_to_the_cap_and_nothing_before_a_wrong_guess():
    prefills = 80.2 / 400 + (100 * 0.1 + 0.1) / 400  # target, then draft, as in the i.i.d. model
    # 10 answer tokens, every guess right, runs of at most 4: two steps of 4 drafts and a 5-row verify
    right = roofline.oracle_request_s(TARGET, DRAFT, MACHINE, "avx2", 100, [True] * 9, cap=4)
    assert right == pytest.approx(prefills + 2 * (4 * 0.005 + 0.025))
    # every guess wrong: no draft forward at all, 9 one-row steps
    wrong = roofline.oracle_request_s(TARGET, DRAFT, MACHINE, "avx2", 100, [False] * 9, cap=4)
    assert wrong == pytest.approx(prefills + 9 * 0.025)
    # right, wrong, right right: a 1-draft step emits tokens 1-2, a plain step token 3, a 2-draft step 4-5
    mixed = roofline.oracle_request_s(TARGET, DRAFT, MACHINE, "avx2", 100, [True, False, False, True, True], cap=4)
    assert mixed == pytest.approx(prefills + (0.005 + 0.025) + 0.025 + (2 * 0.005 + 0.025))


def test_a_draft_that_is_the_target_guesses_every_token(tiny_dirs, prompts_file):
    """Teacher-forced over the target's own greedy answers, the same model guesses each next token:
    an off-by-one between guesses and answer tokens would not."""
    from specdec import Engine, EngineConfig
    from specdec.eval.runner import encode_prompts

    target, _ = tiny_dirs
    engine = Engine(EngineConfig(target=str(target), draft=str(target), proposer="draft", dtype="float32",
                                 target_quant="none", draft_quant="none", kv_cache_memory_gib=0.05))
    prompts = [p.token_ids for p in encode_prompts(engine, str(prompts_file), 3, 0, 64, 12)]
    runs = roofline.draft_agreement(engine, prompts, 12)
    assert [n for n, _ in runs] == [len(p) for p in prompts]
    assert all(len(agrees) >= 1 and all(agrees) for _, agrees in runs)
    assert engine.proposer.pool.num_used == 0  # the teacher-forcing table freed


@pytest.mark.parametrize("text", ["humaneval", "x:0:0.5", "x:10:1.0", "x:ten:0.5", "x:10:-0.1"])
def test_workload_refuses_malformed_text(text):
    with pytest.raises(argparse.ArgumentTypeError):
        Workload.parse(text)


def test_report_names_the_ceilings_and_llama_cpp_floor():
    text = roofline.report(MACHINE, TARGET, DRAFT, int(0.8 * GB), [Workload("he", 100, 0.87)], 128, 8)
    assert "40.0 GB/s" in text and "avx2 400 GMAC/s" in text
    assert "tg128 at most 50.0 tok/s" in text  # 0.8 GB at 40 GB/s
    assert "| avx2 |" in text and "| avx512-vnni |" in text and "he speculative tok/s (a = 0.87)" in text
    without = roofline.report(MACHINE, TARGET, None, None, [Workload("he", 100, 0.87)], 128, 8)
    assert "speculative" not in without and "llama" not in without


def test_measuring_kernels_run_at_each_level(simd_level):
    lib = roofline._library(simd_level)
    out = ctypes.c_double()
    assert lib.roofline_read_bandwidth(8 << 20, 1, 1, ctypes.byref(out)) == 0 and out.value > 1e8
    assert lib.roofline_int8_peak(10_000, 1, ctypes.byref(out)) == 0 and out.value > 1e9
    assert lib.roofline_read_bandwidth(100, 1, 1, ctypes.byref(out)) == 2  # invalid argument
    assert lib.roofline_int8_peak(0, 1, ctypes.byref(out)) == 2


def test_every_level_is_measured_whatever_specdec_isa_holds(monkeypatch):
    levels = [level.name for level in native.machine_levels()]
    if not levels:
        pytest.skip("no SIMD level runs here")
    monkeypatch.setenv(native.ISA_ENV, levels[-1])  # held to the lowest
    for level in levels:
        assert roofline._library(level) is not None
    assert native.simd_level().name == levels[-1]  # and still held there afterwards


def test_model_cost_counts_tiles_as_stored_and_the_lm_head_apart(simd_level):
    from specdec.target.quant.qlinear import QLinear

    torch.manual_seed(0)
    model = torch.nn.Module()
    model.layer = QLinear.from_weight(torch.randn(32, 64) * 0.02, None, int4_max_error=0.0)  # int8 tiles
    model.lm_head = torch.nn.Linear(64, 100, bias=False)
    cost = roofline.model_cost(model, "m")
    assert cost.macs_per_token == 32 * 64 + 100 * 64 and cost.head_macs == 100 * 64
    assert cost.bytes_per_token == model.layer.tiles.numel() + 100 * 64 * 4
    assert model.layer.tiles.numel() == 32 * 64 + 2 * 2 * 16 * 2  # int8 bytes, then a bf16 step per group and output
    with pytest.raises(ValueError, match="no linear"):
        roofline.model_cost(torch.nn.Sequential(torch.nn.ReLU()), "empty")


@pytest.mark.parametrize("tied", [True, False])
def test_gguf_bytes_per_token_reads_the_embedding_only_as_the_output(tmp_path, tied):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_tensor("token_embd.weight", np.zeros((100, 64), np.float32))
    writer.add_tensor("blk.0.ffn_up.weight", np.zeros((32, 64), np.float16))
    if not tied:
        writer.add_tensor("output.weight", np.zeros((100, 64), np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    expected = 32 * 64 * 2 + (100 * 64 * 4 if tied else 100 * 64 * 2)
    assert roofline.gguf_bytes_per_token([path]) == expected


def test_command_on_the_tiny_pair(tiny_dirs, monkeypatch, capsys):
    monkeypatch.setattr(roofline, "BANDWIDTH_BYTES", 16 << 20)
    monkeypatch.setattr(roofline, "PEAK_ROUNDS", 10_000)
    monkeypatch.setattr(roofline, "TRIES", 1)
    target, draft = tiny_dirs
    roofline.main(["--target", str(target), "--draft", str(draft), "--threads", "1", "--workload", "t:16:0.8"])
    out = capsys.readouterr().out
    for level in native.machine_levels():
        assert f"| {level.name} |" in out
    assert "t speculative tok/s (a = 0.8)" in out and "llama.cpp" not in out  # HF folders: no GGUF
    roofline.main(["--target", str(target), "--draft", "none", "--threads", "1", "--workload", "t:16:0.8"])
    out = capsys.readouterr().out
    assert "t target-only tok/s" in out and "speculative" not in out and "| draft (" not in out
    with pytest.raises(SystemExit):
        roofline.main(["--target", str(target), "--draft", "none", "--oracle", "humaneval"])
    with pytest.raises(SystemExit):
        roofline.main(["--target", str(target), "--draft", str(draft), "--oracle", "humaneval:0"])


def test_oracle_command_on_the_tiny_pair(tiny_dirs, prompts_file, monkeypatch, capsys):
    monkeypatch.setattr(roofline, "BANDWIDTH_BYTES", 16 << 20)
    monkeypatch.setattr(roofline, "PEAK_ROUNDS", 10_000)
    monkeypatch.setattr(roofline, "TRIES", 1)
    target, draft = tiny_dirs
    roofline.main(["--target", str(target), "--draft", str(draft), "--threads", "1", "--workload", "t:16:0.8",
                   "--max-tokens", "8", "--oracle", f"{prompts_file}:2"])
    out = capsys.readouterr().out
    assert "Oracle ceilings" in out
    for level in native.machine_levels():
        assert f"| {level.name} | {prompts_file} | 2 |" in out
    with pytest.raises(SystemExit, match="unknown dataset"):
        roofline.main(["--target", str(target), "--draft", str(draft), "--threads", "1", "--oracle", "nosuch"])


def test_an_moe_counts_the_experts_a_token_reads(tmp_path):
    """Top 2 of 8 experts: a token reads a quarter of each expert's bytes, in specdec's model and in
    the GGUF's stacked `*_exps` alike."""
    from specdec.testing import from_hf
    from tests.target.conftest import build_tiny_tokenizer
    from tests.target.moe_models import moe_hf_model, write_gguf

    hf = moe_hf_model("qwen3_moe")
    model = from_hf(hf)
    experts = sum(p.numel() * 4 for layer in model.model.layers if hasattr(layer.mlp, "experts")
                  for p in layer.mlp.experts.parameters())
    everything = sum(p.numel() * 4 for n, p in model.named_parameters() if "embed_tokens" not in n and "norm" not in n)
    assert roofline.model_cost(model, "moe").bytes_per_token == everything - experts + experts // 4
    tokenizer = build_tiny_tokenizer()
    path = tmp_path / "moe.gguf"
    write_gguf(moe_hf_model("qwen3_moe", vocab_size=len(tokenizer)), path, tokenizer)
    from specdec.target.gguf_file import GGUFFile

    tensors = GGUFFile.open(path).tensors
    stacked = sum(t.nbytes for n, t in tensors.items() if "_exps." in n)
    rest = sum(t.nbytes for n, t in tensors.items() if "_exps." not in n and n != "token_embd.weight")
    assert roofline.gguf_bytes_per_token([path]) == rest + stacked // 4
