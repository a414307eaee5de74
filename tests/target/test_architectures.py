"""Qwen3, Llama 3.x (3.2: tied), SmolLM3 (no-rope layers), Granite (its multipliers), GLM-4 (pairwise partial rope, sandwich norms), Gemma 2 / 3,
Phi-3 / Phi-4 (Phi-4-mini: partial rotary) and Mistral with its sliding window against transformers
on tiny random configs (fp32): prefill and step-by-step decode through the paged cache within
1e-4 of transformers' logits, and speculative greedy output equal to transformers' `generate`.

The configs make every feature bite: windows of 4-5 tokens under prompts of up to 15, soft caps
near the logits' scale, norm weights away from their identity, distinct local and global rope.
"""

import logging

import pytest
import torch

from specdec.cache import cpu_attention
from specdec.config import EngineConfig
from specdec.engine import Engine
from specdec.sampling_params import SamplingParams
from specdec.target.config import ModelConfig, UnsupportedModelError
from specdec.target.runner import ModelRunner, Window
from specdec.testing import from_hf
from tests.target.test_model_parity import TOL, _hf_logits, assert_prefill_matches

VOCAB = 96
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [3, 4], [20, 21, 22, 23, 24, 25]]
SHAPE = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
    pad_token_id=0,
)
LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=16, rope_theta=500000.0)


def _longrope(head_dim: int) -> dict:
    half = head_dim // 2
    return dict(rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=64,
                short_factor=[1.0 + 0.1 * i for i in range(half)], long_factor=[2.0 + i for i in range(half)])


def hf_config(arch: str):
    """A tiny transformers config of `arch` with every feature of the family switched on."""
    import transformers as tf

    shape = dict(SHAPE)
    if arch == "qwen3":
        return tf.Qwen3Config(**shape, head_dim=32)
    if arch == "qwen2":  # the default target's family (q/k/v biases); heads of 32 (the C attention's)
        return tf.Qwen2Config(**{**shape, "hidden_size": 128})
    if arch == "llama3":
        return tf.LlamaConfig(**shape, rope_parameters=LLAMA3_ROPE)
    if arch == "gemma2":
        return tf.Gemma2Config(**shape, head_dim=16, query_pre_attn_scalar=24, sliding_window=4,
                               attn_logit_softcapping=2.0, final_logit_softcapping=3.0)
    if arch == "gemma3":
        rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}}
        return tf.Gemma3TextConfig(**shape, head_dim=32, query_pre_attn_scalar=20, sliding_window=5,
                                   layer_types=["sliding_attention", "full_attention"], rope_parameters=rope)
    if arch == "llama32":  # Llama 3.2 1B / 3B: tied embeddings under llama3 rope scaling
        return tf.LlamaConfig(**shape, rope_parameters={**LLAMA3_ROPE, "factor": 32.0}, tie_word_embeddings=True)
    if arch == "smollm3":  # a layer without rope every 3rd here (every 4th in SmolLM3-3B)
        return tf.SmolLM3Config(**{**shape, "num_hidden_layers": 3}, no_rope_layer_interval=3, tie_word_embeddings=True)
    if arch == "granite":  # multipliers away from 1, as Granite 3.x's are
        return tf.GraniteConfig(**shape, embedding_multiplier=12.0, residual_multiplier=0.22,
                                attention_multiplier=0.03, logits_scaling=3.0)
    if arch == "glm4":  # rope on pairs of the first half of each head, q/k/v biases, sandwich norms
        return tf.Glm4Config(**shape, head_dim=16)
    if arch == "phi3":
        return tf.Phi3Config(**shape, sliding_window=5)
    if arch == "phi4-mini":  # partial rotary (3/4 of each head) under longrope, tied embeddings
        return tf.Phi3Config(**shape, partial_rotary_factor=0.75, tie_word_embeddings=True,
                             original_max_position_embeddings=64, rope_parameters=_longrope(12))
    if arch == "phi3-longrope":
        return tf.Phi3Config(**shape, original_max_position_embeddings=64, rope_parameters=_longrope(16))
    if arch == "mistral-window":
        return tf.MistralConfig(**shape, sliding_window=4)
    if arch == "qwen2-window":  # layers from max_window_layers on slide
        return tf.Qwen2Config(**shape, use_sliding_window=True, sliding_window=4, max_window_layers=1)
    raise AssertionError(arch)


ARCHS = ["qwen3", "llama3", "llama32", "smollm3", "granite", "glm4", "gemma2", "gemma3", "phi3", "phi3-longrope", "phi4-mini",
         "mistral-window", "qwen2-window"]
_MODELS: dict = {}


def hf_model(arch: str, seed: int = 0, num_hidden_layers: int | None = None):
    """A random transformers model of `arch` in fp32 (cached: tests only read it)."""
    from transformers import AutoModelForCausalLM

    key = (arch, seed, num_hidden_layers)
    if key not in _MODELS:
        torch.manual_seed(seed)
        config = hf_config(arch)
        if num_hidden_layers is not None:
            config.num_hidden_layers = num_hidden_layers
            if getattr(config, "layer_types", None):
                config.layer_types = config.layer_types[:num_hidden_layers]
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():  # sharp logits, and norms (q/k norms too) away from their identity
            for p in model.parameters():
                p.normal_(0, 0.2) if p.dim() == 2 else p.add_(torch.randn_like(p) * 0.2)
        _MODELS[key] = model.eval()
    return _MODELS[key]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_prefill_batch_matches_transformers(arch, block_size):
    assert_prefill_matches(hf_model(arch), block_size, PROMPTS)


@pytest.mark.parametrize("arch", ARCHS)
def test_step_by_step_decode_matches_transformers(arch):
    """Prefill, then windows of 1..3 tokens per sequence (as verification feeds them), with a
    rollback: past the windows, so the sliding layers see only part of the cache."""
    hf = hf_model(arch)
    runner = ModelRunner.build(from_hf(hf), block_size=4, num_blocks=128)
    continuations = [list(range(30 + 10 * i, 40 + 10 * i)) for i in range(len(PROMPTS))]
    tables = [runner.new_table() for _ in PROMPTS]
    seqs = [list(p) for p in PROMPTS]
    for t, s in zip(tables, seqs):
        t.ensure_slots(len(s))
    runner.forward([Window(t, list(s), 1) for t, s in zip(tables, seqs)])
    for step, width in enumerate([1, 3, 2, 3, 1]):
        if step == 2:  # speculative tokens, then rejected: written to the cache, then rolled back
            for t, s in zip(tables, seqs):
                t.ensure_slots(len(s) + 2)
            runner.forward([Window(t, [90, 91], 1) for t in tables])
            for t, s in zip(tables, seqs):
                t.truncate(len(s))
        windows = []
        for t, s, cont in zip(tables, seqs, continuations):
            new = cont[:width]
            del cont[:width]
            s.extend(new)
            t.ensure_slots(len(s))
            windows.append(Window(t, new, len(new)))
        logits = runner.forward(windows)
        for s, w, ours in zip(seqs, windows, torch.split(logits, [len(w.token_ids) for w in windows])):
            ref = _hf_logits(hf, s)[-len(w.token_ids):]
            assert (ours - ref).abs().max().item() < TOL, f"step {step}"


@pytest.mark.parametrize("arch", ARCHS)
def test_speculative_greedy_equals_transformers_generate(arch):
    """A draft of the same family (another random net, one layer) at k = 3 through the engine:
    the output is transformers' greedy `generate`, token for token."""
    hf = hf_model(arch)
    target, draft = from_hf(hf), from_hf(hf_model(arch, seed=1, num_hidden_layers=1))
    new_tokens = 16
    config = EngineConfig(dtype="float32", num_blocks=64, block_size=4, proposer="draft",
                          num_speculative_tokens=3, adaptive_k=False)
    greedy = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    ours = [o.token_ids for o in Engine.from_models(config, target, draft).generate(PROMPTS, greedy)]
    for prompt, out in zip(PROMPTS, ours):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert out == ref


@pytest.mark.parametrize("arch", ["qwen3", "gemma2", "gemma3", "phi3", "glm4"])
def test_hf_folder_loads_as_transformers_saved_it(tmp_path, arch):
    """`save_pretrained` and our safetensors loader: names as they are (Phi-3's fused ones too),
    tied Gemma heads, both of Gemma 3's rope tables rebuilt off the meta device (GLM-4's of its
    rotary width, not the head's)."""
    from specdec.target.model_weights import load_model

    hf = hf_model(arch)
    hf.save_pretrained(tmp_path)
    ids = PROMPTS[0]
    runner = ModelRunner.build(load_model(tmp_path, torch.float32), block_size=4, num_blocks=16)
    table = runner.new_table()
    table.ensure_slots(len(ids))
    assert (runner.forward([Window(table, ids, len(ids))]) - _hf_logits(hf, ids)).abs().max().item() < TOL


def test_longrope_limits_the_context_to_its_original_length(caplog):
    with caplog.at_level(logging.INFO, logger="specdec"):
        config = ModelConfig.from_hf(hf_config("phi3-longrope"))
    assert config.max_position_embeddings == 64
    assert "longrope" in caplog.text


@pytest.mark.parametrize("change, match", [
    (dict(model_type="gemma3", architectures=["Gemma3ForConditionalGeneration"]), "multimodal"),
    (dict(layer_types=["chunked_attention", "full_attention"]), "layer types"),
    (dict(use_bidirectional_attention=True), "bidirectional"),
    (dict(hidden_activation="relu2"), "activation"),
])
def test_what_we_do_not_run_is_refused_by_name(change, match):
    config = hf_config("gemma3")
    for name, value in change.items():
        setattr(config, name, value)
    with pytest.raises(UnsupportedModelError, match=match):
        ModelConfig.from_hf(config)


def test_a_partial_rotary_of_no_even_width_is_refused():
    config = hf_config("phi3")  # heads of 16: 0.7 of them is 11 dims, no whole pairs
    config.rope_parameters["partial_rotary_factor"] = 0.7
    with pytest.raises(UnsupportedModelError, match="rotary width of 11"):
        ModelConfig.from_hf(config)


def test_partial_rotary_leaves_the_c_attention():
    """The C attention turns whole heads: a Phi-4-mini layer takes the reference path."""
    from specdec.target.model import Attention

    config = ModelConfig.from_hf(hf_config("phi4-mini"))
    assert config.rotary_dim == 12 and "partial rotary" in config.c_loop_differences()
    assert not Attention(config).c_kernel_fits


def test_llama_qwen2_and_plain_mistral_have_no_new_features():
    from specdec.testing import tiny_hf_config

    for arch in ("llama", "qwen2", "mistral"):
        config = ModelConfig.from_hf(tiny_hf_config(arch))
        assert config.llama_layer_differences() == [] and config.unquantized_reason() is None
    assert ModelConfig.from_hf(hf_config("mistral-window")).sliding_windows == (4, 4)
    assert ModelConfig.from_hf(hf_config("gemma2")).sliding_windows == (4, None)
    assert ModelConfig.from_hf(hf_config("qwen2-window")).sliding_windows == (None, 4)


def test_models_whose_layers_differ_keep_the_python_layer_loop(caplog):
    """The C layer loop runs Llama's layer (and Qwen3's per-head q/k norms): a stack handed to a
    Gemma 2 is dropped, with the reason; a Qwen3 keeps it."""
    model = from_hf(hf_model("gemma2"))
    with caplog.at_level(logging.INFO, logger="specdec"):
        model.use_layer_stack(object())
    assert model._layer_stack is None and "Gemma norms" in caplog.text
    qwen3 = from_hf(hf_model("qwen3"))
    qwen3.use_layer_stack(stack := object())
    assert qwen3._layer_stack is stack


def test_windowed_layers_never_reach_the_c_attention(monkeypatch, caplog):
    """Where the C attention runs, a windowed model's layers still take the reference path (they
    would fail here, where the kernel is absent), and the model says so once."""
    from specdec.cache import cpu_attention

    def kernel_runs(meta, *args):
        meta.scratch["cpu_attention"] = True
        return True

    monkeypatch.setattr(cpu_attention, "supports", kernel_runs)
    hf = hf_model("mistral-window")
    with caplog.at_level(logging.INFO, logger="specdec"):
        assert_prefill_matches(hf, 4, PROMPTS)
    assert caplog.text.count("reference attention") == 1


def test_gemma_and_phi3_default_to_unquantized_and_refuse_smoothing(tmp_path, caplog):
    from specdec.target.family_quant import family_quant

    for arch in ("gemma2", "phi3", "qwen3"):
        hf_model(arch).save_pretrained(tmp_path / arch)
    with caplog.at_level(logging.INFO, logger="specdec"):
        assert family_quant(str(tmp_path / "gemma2"), "w4a8-auto", None) == "none"
        assert family_quant(str(tmp_path / "phi3"), "w8a8", None) == "none"
    assert "Gemma norms" in caplog.text and "fused checkpoint projections" in caplog.text
    assert family_quant(str(tmp_path / "qwen3"), "w8a8", None) == "w8a8"
    assert family_quant(str(tmp_path / "gemma2"), "none", "int4") == "int4"
    with pytest.raises(ValueError, match="smooths"):
        family_quant(str(tmp_path / "phi3"), "none", "w8a8")
    assert family_quant("default-target", "w8a8", None) == "w8a8"


def _quantized_greedy_is_exact(arch: str, mode: str, max_error: float) -> None:
    """Quantized in `mode`: logits within `max_error` (relative) of the dense model's, and
    speculative greedy output equal to target-only output."""
    from specdec.target.model_weights import calibration_forward
    from specdec.target.quant.convert import prepare_quantized, quantize_model

    hf = hf_model(arch)
    reference = _prefill_logits(from_hf(hf), PROMPTS[0])
    models = [from_hf(hf), from_hf(hf_model(arch, seed=1, num_hidden_layers=1))]
    for m in models:
        quantize_model(m, mode, progress=False, calibrate=calibration_forward(m, list(range(3, 90))))
        prepare_quantized(m)
    quantized = _prefill_logits(models[0], PROMPTS[0])
    assert ((quantized - reference).norm() / reference.norm()).item() < max_error
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

    def run(**kw):
        config = EngineConfig(dtype="float32", num_blocks=64, block_size=4, adaptive_k=False, **kw)
        return [o.token_ids for o in Engine.from_models(config, *models).generate(PROMPTS, greedy)]

    assert run(proposer="draft", num_speculative_tokens=3) == run(proposer="none")


def _prefill_logits(model, ids: list[int]) -> torch.Tensor:
    runner = ModelRunner.build(model, block_size=4, num_blocks=16)
    table = runner.new_table()
    table.ensure_slots(len(ids))
    return runner.forward([Window(table, ids, len(ids))])


@pytest.mark.parametrize("arch", ["qwen3", "mistral-window"])
def test_smoothed_w8a8_runs_qwen3_and_windowed_mistral(arch):
    _quantized_greedy_is_exact(arch, "w8a8", 0.1)


@pytest.mark.parametrize("arch", ["gemma2", "phi3"])
def test_int4_runs_gemma_and_phi3(arch):
    _quantized_greedy_is_exact(arch, "int4", 0.6)  # random weights, off the int4 grid: Llama's is 0.4-0.5


def test_llama3_rope_loads_from_a_folder(tmp_path):
    """The loader builds the model on the meta device; transformers' rope functions still run."""
    test_hf_folder_loads_as_transformers_saved_it(tmp_path, "llama3")


def _decode_logits(model) -> torch.Tensor:
    """Logits of a batched prefill of PROMPTS and three verify-like steps after it."""
    runner = ModelRunner.build(model, block_size=4, num_blocks=64)
    tables = [runner.new_table() for _ in PROMPTS]
    for t, p in zip(tables, PROMPTS):
        t.ensure_slots(len(p) + 6)
    out = [runner.forward([Window(t, p, 1) for t, p in zip(tables, PROMPTS)])]
    for width in (1, 3, 2):
        out.append(runner.forward([Window(t, list(range(40, 40 + width)), width) for t in tables]))
    return torch.cat(out)


@pytest.mark.skipif(cpu_attention.load_attention() is None,
                    reason=f"CPU attention kernel unavailable: {cpu_attention.kernel().unavailable_reason()}")
@pytest.mark.parametrize("arch", ["qwen3", "gemma3", "mistral-window"])
def test_bf16_on_the_c_attention_matches_the_reference_path(arch, monkeypatch):
    """In bf16 on the CPU the C attention takes the layers it implements (q/k-normed heads, a
    query_pre_attn_scalar scale, Gemma 3's global layer), the reference the windowed ones."""
    model = from_hf(hf_model(arch), torch.bfloat16)
    with_kernel = _decode_logits(model)
    monkeypatch.setenv("SPECDEC_NO_KERNELS", "1")
    reference = _decode_logits(model)
    assert ((with_kernel - reference).norm() / reference.norm()).item() < 2e-2


def _tiny_multimodal_gemma3():
    """A tiny Gemma3ForConditionalGeneration (the 4B/12B/27B checkpoints' class): the text model
    of `hf_config("gemma3")` beside a tiny SigLIP tower."""
    import transformers as tf

    text = hf_config("gemma3")
    vision = tf.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                   image_size=28, patch_size=14)
    config = tf.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
                             boi_token_index=90, eoi_token_index=91, image_token_index=92, eos_token_id=2)
    torch.manual_seed(0)
    return tf.Gemma3ForConditionalGeneration(config).eval()


def test_a_multimodal_gemma3_checkpoint_runs_its_text_model(tmp_path):
    """Gemma 3 4B and up ship as Gemma3ForConditionalGeneration: the text model loads from under its
    prefix (the image tower is skipped) and matches transformers' text-only logits; a draft of
    the same family (a text-only Gemma 3) pairs with it."""
    from specdec.target.model_weights import load_config, load_model

    hf = _tiny_multimodal_gemma3()
    hf.save_pretrained(tmp_path)
    config = load_config(tmp_path)
    assert config.sliding_windows == (5, None) and config.tie_word_embeddings and config.eos_token_ids == [2]
    ids = PROMPTS[0]
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids])).logits[0].float()
    runner = ModelRunner.build(load_model(tmp_path, torch.float32), block_size=4, num_blocks=16)
    table = runner.new_table()
    table.ensure_slots(len(ids))
    assert (runner.forward([Window(table, ids, len(ids))]) - ref).abs().max().item() < TOL


def test_text_weights_are_found_under_either_multimodal_prefix():
    """transformers >= 4.52 writes `model.language_model.*`; the published Gemma 3 checkpoints
    hold `language_model.model.*` and `language_model.lm_head.weight`."""
    from specdec.target.checkpoint_reader import is_image_part, param_sources

    class Reader:
        def __init__(self, names):
            self._names = names

        def names(self):
            return self._names

    params = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    untied = ModelConfig.from_hf(hf_config("llama3"))
    old = Reader(["language_model.model.embed_tokens.weight", "language_model.model.norm.weight",
                  "language_model.lm_head.weight", "vision_tower.vision_model.post_layernorm.weight"])
    assert param_sources(old, params, untied) == {
        "model.embed_tokens.weight": "language_model.model.embed_tokens.weight",
        "model.norm.weight": "language_model.model.norm.weight",
        "lm_head.weight": "language_model.lm_head.weight",
    }
    new = Reader(["model.language_model.embed_tokens.weight", "model.language_model.norm.weight"])
    tied = ModelConfig.from_hf(hf_config("gemma3"))
    assert param_sources(new, params, tied)["lm_head.weight"] == "model.language_model.embed_tokens.weight"
    assert is_image_part("model.vision_tower.x") and is_image_part("multi_modal_projector.y")
    assert not is_image_part("model.language_model.norm.weight")


def _stream_logits(runner: ModelRunner, chunk: int | None) -> list[torch.Tensor]:
    """A stream's logits over a prefill and three decode / verify windows; with `chunk`, each of
    those steps also carries `chunk` rows of another prompt's prefill (its first token never sampled)."""
    stream, other = runner.new_table(), runner.new_table()
    tokens, prompt, fed = list(PROMPTS[0]), [(7 * i) % VOCAB for i in range(3 * (chunk or 0))], 0
    out = []
    for window in (tokens, [40], [41, 42, 43], [44]):
        if window is not tokens:
            tokens = tokens + window
        stream.ensure_slots(len(tokens))
        windows = [Window(stream, list(window), len(window))]
        if chunk and fed < len(prompt):
            other.ensure_slots(fed + chunk)
            windows.append(Window(other, prompt[fed:fed + chunk], 1))
            fed += chunk
        out.append(runner.forward(windows)[: len(window)].clone())
    return out


@pytest.mark.skipif(cpu_attention.load_attention() is None,
                    reason=f"CPU attention kernel unavailable: {cpu_attention.kernel().unavailable_reason()}")
def test_a_stream_beside_a_prompt_chunk_gets_bitwise_its_logits_alone(monkeypatch):
    """In bf16 a step that carries another prompt's chunk runs every row, the chunk's too, through
    the C attention, so a stream's tokens never depend on what arrives beside it.
    (Windowed layers stay on the reference for every row, as they do without a chunk.)"""
    model = from_hf(hf_model("qwen3"), torch.bfloat16)
    runner = ModelRunner.build(model, block_size=4, num_blocks=256)
    chunk = 80
    alone = _stream_logits(runner, None)
    calls = []
    kernel = cpu_attention.rope_write_attend
    monkeypatch.setattr(cpu_attention, "rope_write_attend", lambda qkv, *a: calls.append(qkv.shape[0]) or kernel(qkv, *a))
    beside = _stream_logits(runner, chunk)
    assert calls and max(calls) > chunk  # the stream's rows and the chunk's in one call
    for step, (a, b) in enumerate(zip(alone, beside)):
        assert torch.equal(a, b), f"step {step}"


def _prompt_state(runner: ModelRunner, prompt: list[int], chunks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits of one decode row after `prompt` was prefilled in `chunks`, and the prompt's
    keys and values as the cache holds them (every layer)."""
    table, fed = runner.new_table(), 0
    for n in chunks:
        table.ensure_slots(fed + n)
        runner.forward([Window(table, prompt[fed:fed + n], 1)])
        fed += n
    table.ensure_slots(len(prompt) + 1)
    logits = runner.forward([Window(table, [prompt[0]], 1)]).clone()
    slots = torch.tensor(table.slot_mapping(0, len(prompt)))
    kv = runner.kv_cache.kv.flatten(2, 3)[:, :, slots].clone()  # [layers, 2, tokens, Hkv, D]
    table.free()
    return logits, kv


@pytest.mark.skipif(cpu_attention.load_attention() is None,
                    reason=f"CPU attention kernel unavailable: {cpu_attention.kernel().unavailable_reason()}")
@pytest.mark.parametrize("family", ["qwen3", "qwen2"])
def test_a_prompt_prefilled_in_any_chunks_gives_bitwise_what_one_chunk_gives(family):
    """How a prompt is chunked follows the load (adaptive chunked prefill, a prefix already
    cached, a prefill replica), so no chunking may change a bit: in bf16 every window goes through
    the C attention, which computes each row alone. On SDPA (causal for a whole prompt, masked for
    a chunk after cached keys) the default target's logits moved by 0.5 between chunkings, and a
    greedy answer served by 2 replicas parted from a plain server's at its second token."""
    model = from_hf(hf_model(family), torch.bfloat16)
    runner = ModelRunner.build(model, block_size=4, num_blocks=512)
    prompt = [(7 * i + 3) % VOCAB for i in range(150)]
    whole = _prompt_state(runner, prompt, [150])
    for chunks in ([100, 50], [1, 149], [20, 33, 97], [64, 64, 22], [149, 1]):
        logits, kv = _prompt_state(runner, prompt, chunks)
        assert torch.equal(logits, whole[0]), chunks
        assert torch.equal(kv, whole[1]), chunks
