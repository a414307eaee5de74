"""W8A8 linears (fbgemm int8 GEMM): close to the float linear, batch-invariant per row; smoothing
is an exact rewrite that shrinks the int8 error; cached like the other modes; the engine stays
greedy-exact on a W8A8 target."""

import copy

import torch

from specdec.config import EngineConfig
from specdec.engine import Engine
from specdec.sampling_params import SamplingParams
from specdec.target.quant.convert import quantize_model
from specdec.target.quant.int8 import Int8Linear
from specdec.target.quant.smoothing import smooth_model
from specdec.target.runner import ModelRunner, Window
from specdec.target.model_weights import calibration_forward, load_model
from specdec.testing import from_hf, tiny_hf_model, write_tiny_pair


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_int8_linear_is_close_to_the_float_linear():
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 96)
    x = torch.randn(7, 256)
    assert _rel(Int8Linear.from_float(linear)(x), linear(x)) < 0.02


def test_a_rows_result_does_not_depend_on_the_rest_of_the_batch():
    torch.manual_seed(1)
    q = Int8Linear.from_float(torch.nn.Linear(128, 64))
    x = torch.randn(9, 128)
    x[4] *= 100  # a row with a far larger range must not change the others' quantization
    batched = q(x)
    alone = torch.cat([q(x[i : i + 1]) for i in range(9)])
    assert torch.equal(batched, alone)


def prompt_logits(model, ids: list[int]) -> torch.Tensor:
    """Logits `[len(ids), V]` of one prefill of `ids` (also used by test_qlinear)."""
    runner = ModelRunner.build(model, 4, None, num_blocks=32)
    table = runner.new_table()
    table.ensure_slots(len(ids))
    return runner.forward([Window(table, ids, len(ids))])


def speculative_and_plain_greedy(target, draft, dtype="float32") -> tuple[list[list[int]], list[list[int]]]:
    """Greedy outputs of three prompts, with a draft at fixed k = 4 and without one."""
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9], [30, 31], [100, 101, 102, 103, 104, 105, 106]]

    def run(**kw):
        config = EngineConfig(dtype=dtype, num_blocks=64, block_size=4, adaptive_k=False, **kw)
        return [o.token_ids for o in Engine.from_models(config, target, draft).generate(prompts, greedy)]

    return run(proposer="draft", num_speculative_tokens=4), run(proposer="none")


def _outlier_model():
    """A tiny Qwen2 (attention bias, GQA) with two hidden channels ~40x the rest, like real LLMs."""
    model = from_hf(tiny_hf_model("qwen2", seed=3))
    model.lm_head = torch.nn.Linear(model.lm_head.in_features, model.lm_head.out_features, bias=False)
    model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.detach().clone(), False)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.input_layernorm.weight[:2] *= 40
            layer.post_attention_layernorm.weight[:2] *= 40
    return model


IDS = [(i * 37) % 90 + 3 for i in range(40)]


def test_smoothing_is_an_exact_rewrite_in_fp32():
    model = _outlier_model()
    before = prompt_logits(model, IDS)
    smooth_model(model, calibration_forward(model, IDS[:20]))
    assert _rel(prompt_logits(model, IDS), before) < 1e-4


def test_smoothing_shrinks_the_w8a8_error():
    model = _outlier_model()
    reference = prompt_logits(model, IDS)
    plain, smoothed = copy.deepcopy(model), copy.deepcopy(model)
    plain.parameters = smoothed.parameters = lambda: iter([torch.zeros(1)])  # CPU check only
    quantize_model(plain, "w8a8", progress=False, calibrate=None)
    quantize_model(smoothed, "w8a8", progress=False, calibrate=calibration_forward(smoothed, IDS[:20]))
    del plain.parameters, smoothed.parameters
    err_plain, err_smoothed = _rel(prompt_logits(plain, IDS), reference), _rel(prompt_logits(smoothed, IDS), reference)
    assert err_smoothed < 0.7 * err_plain, (err_plain, err_smoothed)


def test_w8a8_model_is_cached_and_the_engine_stays_greedy_exact(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    target_dir, draft_dir = write_tiny_pair(tmp_path)
    first = load_model(target_dir, torch.float32, quant="w8a8")
    assert len(list((tmp_path / "cache" / "quantized").glob("*.safetensors"))) == 1
    second = load_model(target_dir, torch.float32, quant="w8a8")
    assert isinstance(second.model.layers[0].mlp.down_proj, Int8Linear)
    assert torch.equal(prompt_logits(first, IDS), prompt_logits(second, IDS))

    speculative, plain = speculative_and_plain_greedy(second, load_model(draft_dir, torch.float32, quant="w8a8"))
    assert speculative == plain
