"""GGUF straight to the kernels' format: a tiny Qwen2 GGUF with Q4_K / Q6_K / Q8_0 / Q5_0 / F16 /
F32 tensors loads layer by layer into exactly what the former dense path (whole float32 model,
then quantize) produced, with no float copy on disk and one float layer in memory at a time."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec.target import quantized_stream
from specdec.target.checkpoint_reader import GGUFCheckpoint
from specdec.target.model_files import resolve_model
from specdec.target.model_weights import load_config, load_model
from specdec.target.quant.cache_file import quant_cache_path
from specdec.target.quant.convert import quantize_model
from specdec.target.quant.formats import MODES
from specdec.target.quantized_stream import calibration_forward, cast_dense

from .conftest import add_gguf_tokenizer, build_tiny_tokenizer

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 256, 512, 2, 4, 2  # K-quant rows need multiples of 256
IDS = list(range(3, 60))


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))


def _f16_bytes(value: float) -> np.ndarray:
    return np.array([value], dtype=np.float16).view(np.uint8)


def _k_blocks(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random but valid Q4_K / Q5_K / Q6_K / Q3_K blocks `[rows, cols / 256 * block bytes]` (gguf
    cannot quantize to K-quants): random quants and sub-block scales, small finite fp16 scales."""
    size = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210, "Q3_K": 110, "Q2_K": 84, "IQ4_XS": 136, "IQ4_NL": 18}[kind]
    blocks = rng.integers(0, 256, (rows, cols // (32 if kind == "IQ4_NL" else 256), size), dtype=np.uint8)
    if kind in ("Q4_K", "Q5_K"):  # d, dmin (fp16), scales[12], (qh[32]), qs[128]
        blocks[..., 0:2], blocks[..., 2:4] = _f16_bytes(0.002 if kind == "Q4_K" else 0.001), _f16_bytes(0.001)
    elif kind == "Q3_K":  # hmask[32], qs[64], scales[12], d (fp16)
        blocks[..., 108:110] = _f16_bytes(0.0005)
    elif kind == "Q2_K":  # scales[16], qs[64], d, dmin (fp16)
        blocks[..., 80:82], blocks[..., 82:84] = _f16_bytes(0.002), _f16_bytes(0.001)
    elif kind in ("IQ4_XS", "IQ4_NL"):  # d (fp16), (scales_h, scales_l[4]), qs
        blocks[..., 0:2] = _f16_bytes(0.00002 if kind == "IQ4_XS" else 0.0002)
    else:  # ql[128], qh[64], scales[16] (int8), d (fp16)
        blocks[..., 208:210] = _f16_bytes(0.0005)
    return blocks.reshape(rows, -1)


def _write_qwen2_gguf(path, tokenizer, tie: bool, k_quants_only: bool = False, head: str = "F16",
                      types: dict[str, str] | None = None) -> None:
    """`k_quants_only`: the Q8_0 / Q5_0 / F16 matrices written as Q4_K instead; `head`: the
    untied LM head's type; `types`: each matrix of a type written as another (`{"Q4_K": "Q5_K"}`)."""
    import gguf

    rng = np.random.default_rng(0)
    vocab = len(tokenizer)
    writer = gguf.GGUFWriter(str(path), arch="qwen2")
    writer.add_name("tiny qwen2")
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    add_gguf_tokenizer(writer, tokenizer)
    writer.add_tokenizer_pre("qwen2")

    def add(name: str, kind: str, rows: int, cols: int | None = None) -> None:
        if k_quants_only and cols and kind in ("Q8_0", "Q5_0", "F16"):
            kind = "Q4_K"
        if cols and types:
            kind = types.get(kind, kind)
        if kind in ("Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q2_K", "IQ4_XS", "IQ4_NL"):
            writer.add_tensor(name, _k_blocks(kind, rows, cols, rng), raw_dtype=gguf.GGMLQuantizationType[kind])
            return
        shape = (rows,) if cols is None else (rows, cols)
        values = (rng.standard_normal(shape) * (0.02 if cols else 0.1) + (0 if cols else 1)).astype(np.float32)
        if kind in ("Q8_0", "Q5_0", "Q4_0", "Q4_1", "Q5_1", "MXFP4"):
            qtype = gguf.GGMLQuantizationType[kind]
            writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, values.astype(np.float16) if kind == "F16" else values)

    add("token_embd.weight", "Q6_K", vocab, HIDDEN)
    kv = KV_HEADS * HIDDEN // HEADS
    for i in range(LAYERS):
        add(f"blk.{i}.attn_norm.weight", "F32", HIDDEN)
        add(f"blk.{i}.attn_q.weight", "Q4_K", HIDDEN, HIDDEN)
        add(f"blk.{i}.attn_q.bias", "F32", HIDDEN)
        add(f"blk.{i}.attn_k.weight", "Q4_K", kv, HIDDEN)
        add(f"blk.{i}.attn_k.bias", "F32", kv)
        add(f"blk.{i}.attn_v.weight", "Q6_K", kv, HIDDEN)
        add(f"blk.{i}.attn_v.bias", "F32", kv)
        add(f"blk.{i}.attn_output.weight", "Q8_0", HIDDEN, HIDDEN)
        add(f"blk.{i}.ffn_norm.weight", "F32", HIDDEN)
        add(f"blk.{i}.ffn_gate.weight", "Q5_0", FFN, HIDDEN)
        add(f"blk.{i}.ffn_up.weight", "Q4_K", FFN, HIDDEN)
        add(f"blk.{i}.ffn_down.weight", "Q6_K", HIDDEN, FFN)
    add("output_norm.weight", "F32", HIDDEN)
    if not tie:
        add("output.weight", head, vocab, HIDDEN)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(params=[False, True], ids=["untied", "tied"])
def gguf_folder(request, tmp_path):
    path = tmp_path / "tiny-qwen2.gguf"
    _write_qwen2_gguf(path, build_tiny_tokenizer(), tie=request.param)
    return resolve_model(str(path), progress=False)


def _dense_path(folder, mode: str) -> dict[str, torch.Tensor]:
    """What loading did before streaming: the whole model in float32, smoothed on a whole-model
    forward where the mode smooths, quantized, the rest cast to bf16."""
    model = load_model(folder, torch.float32)
    smooth = MODES[mode].smooth
    calibrate = calibration_forward(model, _calibration_ids(folder)) if smooth else None
    quantize_model(model, mode, progress=False, calibrate=calibrate)
    cast_dense(model, torch.bfloat16)
    return {k: v for k, v in model.state_dict().items() if not k.startswith("rotary.")}


def _calibration_ids(folder) -> list[int]:
    from specdec.target.model_weights import calibration_ids

    return calibration_ids(folder)


def test_gguf_folder_holds_no_weights_only_metadata_and_a_link(gguf_folder):
    names = sorted(p.name for p in gguf_folder.iterdir())
    assert "config.json" in names and "tokenizer.json" in names and "model.gguf" in names
    assert not list(gguf_folder.glob("*.safetensors"))
    assert (gguf_folder / "model.gguf").is_symlink()


def test_dense_load_reads_the_dequantized_gguf_values(gguf_folder):
    import gguf

    model = load_model(gguf_folder, torch.float32)
    reader = gguf.GGUFReader(gguf_folder / "model.gguf")  # the reference reader, slow but plain
    tensors = {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in reader.tensors}
    layer = model.model.layers[1]
    for name, param in [("token_embd.weight", model.model.embed_tokens.weight),
                        ("blk.1.attn_q.weight", layer.self_attn.q_proj.weight),
                        ("blk.1.attn_v.weight", layer.self_attn.v_proj.weight),
                        ("blk.1.attn_output.weight", layer.self_attn.o_proj.weight),
                        ("blk.1.ffn_gate.weight", layer.mlp.gate_proj.weight),
                        ("blk.1.ffn_down.weight", layer.mlp.down_proj.weight),
                        ("blk.1.attn_k.bias", layer.self_attn.k_proj.bias)]:
        assert torch.equal(param, torch.from_numpy(np.asarray(tensors[name], np.float32)).reshape(param.shape)), name
    head = tensors.get("output.weight", tensors["token_embd.weight"])
    assert torch.equal(model.lm_head.weight, torch.from_numpy(np.asarray(head, np.float32)).reshape(model.lm_head.weight.shape))


@pytest.mark.parametrize("mode", ["w8a8", "int4+w8a8", "auto"])
def test_streamed_quantization_is_bitwise_the_dense_path(gguf_folder, mode):
    from safetensors.torch import load_file

    expected = _dense_path(gguf_folder, mode)
    model = load_model(gguf_folder, torch.bfloat16, quant=mode)
    cached = load_file(quant_cache_path(gguf_folder, mode, torch.bfloat16))
    # the embedding stays in the GGUF (GGUFEmbedding): its rows are looked up, not cached
    table = expected.pop("model.embed_tokens.weight")
    assert set(cached) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(cached[name], tensor), name
    ids = torch.tensor([[0, 5, 5], [len(table) - 1, 1, 2]])
    rows = model.model.embed_tokens(ids)
    assert rows.dtype == torch.bfloat16 and torch.equal(rows, table[ids])
    assert model(*_prompt_inputs(model)).isfinite().all()


def test_shipped_statistics_give_the_bytes_of_a_calibrating_load(gguf_folder, tmp_path, monkeypatch):
    """A checkpoint with shipped SmoothQuant statistics skips the calibration forward and still
    writes exactly the cache file that calibrating wrote; statistics of other weights are not
    taken (the key is the checkpoint's sha256)."""
    from specdec.target.quant import shipped_stats

    calibrated = quant_cache_path(gguf_folder, "w8a8", torch.bfloat16)
    load_model(gguf_folder, torch.bfloat16, quant="w8a8")
    expected = calibrated.read_bytes()
    calibrated.unlink()

    stats: dict[str, torch.Tensor] = {}
    config = load_config(gguf_folder)
    quantized_stream.stream_quantized(gguf_folder, config, "w8a8", torch.bfloat16,
                                      lambda: _calibration_ids(gguf_folder), progress=False, keep_stats=stats)
    monkeypatch.setattr(shipped_stats, "STATS_DIR", tmp_path / "stats")
    shipped_stats.save_stats(stats, config.num_layers, shipped_stats.stats_path("ab" * 32))
    monkeypatch.setattr("specdec.target.model_weights.checkpoint_sha256", lambda folder: "ab" * 32)
    monkeypatch.setattr(quantized_stream, "calibration_forward", _no_calibration)
    load_model(gguf_folder, torch.bfloat16, quant="w8a8")
    assert calibrated.read_bytes() == expected

    calibrated.unlink()
    monkeypatch.setattr("specdec.target.model_weights.checkpoint_sha256", lambda folder: "cd" * 32)
    with pytest.raises(AssertionError, match="calibrated"):
        load_model(gguf_folder, torch.bfloat16, quant="w8a8")  # no stats for these weights


def _no_calibration(model, token_ids):
    raise AssertionError("calibrated although statistics were shipped")


def _prompt_inputs(model):
    """A one-window prompt through a runner (the model's forward needs a KV cache)."""
    from specdec.target.runner import ModelRunner

    runner = ModelRunner.build(model, 16, num_blocks=8)
    table = runner.new_table()
    table.ensure_slots(len(IDS))
    from specdec.cache import build_attention_metadata

    meta = build_attention_metadata([table], [0], [len(IDS)], torch.device("cpu"))
    ids = torch.tensor(IDS)
    return ids, torch.arange(len(IDS)), runner.kv_cache, meta, torch.tensor([len(IDS) - 1])


def test_streaming_holds_one_float_layer_at_a_time(gguf_folder, monkeypatch):
    seen = []
    original = GGUFCheckpoint.read

    def read(self, name):
        seen.append(_float_layers(model_box[0]))
        return original(self, name)

    model_box = []
    stream = quantized_stream.stream_quantized

    def capture(*args, **kwargs):
        from specdec.target.model import LlamaForCausalLM

        init = LlamaForCausalLM.__init__

        def remember(self, config):
            init(self, config)
            model_box.append(self)

        monkeypatch.setattr(LlamaForCausalLM, "__init__", remember)
        return stream(*args, **kwargs)

    monkeypatch.setattr(GGUFCheckpoint, "read", read)
    monkeypatch.setattr("specdec.target.model_weights.stream_quantized", capture)
    load_model(gguf_folder, torch.bfloat16, quant="w8a8")
    assert seen and max(seen) <= 1


def _float_layers(model) -> int:
    """How many decoder layers hold float32 weight matrices (read, not yet converted)."""
    return sum(
        any(p.dtype == torch.float32 and p.dim() == 2 and not p.is_meta for p in layer.parameters())
        for layer in model.model.layers
    )


def test_safetensors_folder_streams_to_the_same_cache(tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from specdec.testing import tiny_hf_model

    monkeypatch.setattr("specdec.target.model_weights.calibration_ids", lambda folder: IDS)
    folder = tmp_path / "hf"
    tiny_hf_model("qwen2").save_pretrained(folder)
    expected = _dense_path(folder, "w8a8")
    load_model(folder, torch.bfloat16, quant="w8a8")
    cached = load_file(quant_cache_path(folder, "w8a8", torch.bfloat16))
    assert set(cached) == set(expected)
    assert all(torch.equal(cached[k], v) for k, v in expected.items())
