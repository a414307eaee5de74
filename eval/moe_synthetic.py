"""`python -m specdec.eval.moe_synthetic OUT`: a shape-true synthetic MoE checkpoint and its Q4_K_M GGUF.

Speed at a real MoE's shapes without downloading it: Qwen3-30B-A3B's layer (hidden 2048, 32 query
and 4 KV heads of 128, 128 experts of width 768, top 8 renormalized, its 151,936-id vocabulary and
untied head), or with `--shape deepseek-v2-lite` DeepSeek-V2-Lite's (multi-head latent attention:
16 heads, latent rank 512 + rope 64, no q low-rank; a dense first layer of width 10,944, then 64
experts of width 1,408, top 6, and 2 shared experts; its vocabulary of 102,400 ids is Qwen's
151,936 here, the tokenizer the converter is given), with fewer layers (`--layers`, 4 by default:
the machine's memory and disk; below 26 layers a V2-Lite's queries take DeepSeek-V2's low-rank
projection, 1536, as llama.cpp reads a `deepseek2` GGUF without `q_lora_rank` only at V2-Lite's
26 or 27 layers) and random weights, written as an HF folder (bf16 safetensors, one shard a
layer, written tensor by tensor)
with the default pair's tokenizer (Qwen's BPE, the vocabulary Qwen3 shares), then turned into a
GGUF by llama.cpp's own `convert_hf_to_gguf.py` and `llama-quantize` (both from the tree
`shared/tools/build-llama-cpp.sh` builds: `--llama-cpp`), so specdec and `llama-bench` run the
same file (`specdec.eval.moe_bench`).

Random weights route about uniformly (every expert equally likely), so a window of r rows reads
close to E(1 - (1 - k/E)^r) distinct experts a layer: more than a trained model's, whose routing
is skewed. Figures measured on it say so beside them.

    python -m specdec.eval.moe_synthetic /tmp/moe --layers 4 \
        --llama-cpp ~/.cache/llama-cpp/llama_cpp_python-0.3.36/vendor/llama.cpp
    python -m specdec.eval.moe_synthetic /tmp/mla --shape deepseek-v2-lite --layers 6 --llama-cpp ...
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm

# Qwen3-30B-A3B's config.json, less its layers
QWEN3_30B_A3B = dict(
    architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936, hidden_size=2048,
    intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
    num_attention_heads=32, num_key_value_heads=4, head_dim=128, max_position_embeddings=40960, rope_theta=1000000.0,
    rms_norm_eps=1e-6, tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[], hidden_act="silu",
    bos_token_id=151643, eos_token_id=151645, torch_dtype="bfloat16", attention_bias=False,
)
# DeepSeek-V2-Lite's config.json, less its layers (and with Qwen's vocabulary: see the top)
DEEPSEEK_V2_LITE = dict(
    architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", vocab_size=151936, hidden_size=2048,
    intermediate_size=10944, moe_intermediate_size=1408, n_routed_experts=64, num_experts_per_tok=6,
    n_shared_experts=2, num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512, q_lora_rank=None,
    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, first_k_dense_replace=1, moe_layer_freq=1,
    norm_topk_prob=False, routed_scaling_factor=1.0, topk_method="greedy", scoring_func="softmax", n_group=1,
    topk_group=1, rope_theta=10000.0, max_position_embeddings=163840, rms_norm_eps=1e-6, tie_word_embeddings=False,
    rope_scaling=dict(type="yarn", factor=40.0, original_max_position_embeddings=4096, mscale=0.707,
                      mscale_all_dim=0.707, beta_fast=32, beta_slow=1),
    bos_token_id=151643, eos_token_id=151645, torch_dtype="bfloat16", attention_bias=False, hidden_act="silu",
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json")
STD = 0.02  # the usual initializer range: logits and routers of sane size


def layer_tensors(config: dict, i: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Decoder layer i's weights (checkpoint names: per-expert linears), random, bf16."""
    if config["model_type"] == "deepseek_v2":
        return deepseek_layer_tensors(config, i, gen)
    h, d, e, w = config["hidden_size"], config["head_dim"], config["num_experts"], config["moe_intermediate_size"]
    hq, hkv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    rand = lambda *shape: (torch.randn(*shape, generator=gen) * STD).bfloat16()  # noqa: E731
    p = f"model.layers.{i}."
    out = {p + "input_layernorm.weight": torch.ones(h).bfloat16(), p + "post_attention_layernorm.weight": torch.ones(h).bfloat16(),
           p + "self_attn.q_proj.weight": rand(hq, h), p + "self_attn.k_proj.weight": rand(hkv, h),
           p + "self_attn.v_proj.weight": rand(hkv, h), p + "self_attn.o_proj.weight": rand(h, hq),
           p + "self_attn.q_norm.weight": torch.ones(d).bfloat16(), p + "self_attn.k_norm.weight": torch.ones(d).bfloat16(),
           p + "mlp.gate.weight": rand(e, h)}
    for x in range(e):
        out[f"{p}mlp.experts.{x}.gate_proj.weight"] = rand(w, h)
        out[f"{p}mlp.experts.{x}.up_proj.weight"] = rand(w, h)
        out[f"{p}mlp.experts.{x}.down_proj.weight"] = rand(h, w)
    return out


def deepseek_layer_tensors(config: dict, i: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """DeepSeek-V2(-Lite) decoder layer i's weights, random, bf16: MLA, then the dense MLP (the first
    `first_k_dense_replace` layers) or the experts, router and shared experts."""
    h, heads, rank, rope = config["hidden_size"], config["num_attention_heads"], config["kv_lora_rank"], config["qk_rope_head_dim"]
    nope, v = config["qk_nope_head_dim"], config["v_head_dim"]
    rand = lambda *shape: (torch.randn(*shape, generator=gen) * STD).bfloat16()  # noqa: E731
    ones = lambda n: torch.ones(n).bfloat16()  # noqa: E731
    p = f"model.layers.{i}."
    q_rank = config.get("q_lora_rank")
    q = ({p + "self_attn.q_a_proj.weight": rand(q_rank, h), p + "self_attn.q_a_layernorm.weight": ones(q_rank),
          p + "self_attn.q_b_proj.weight": rand(heads * (nope + rope), q_rank)} if q_rank
         else {p + "self_attn.q_proj.weight": rand(heads * (nope + rope), h)})
    out = {p + "input_layernorm.weight": ones(h), p + "post_attention_layernorm.weight": ones(h), **q,
           p + "self_attn.kv_a_proj_with_mqa.weight": rand(rank + rope, h), p + "self_attn.kv_a_layernorm.weight": ones(rank),
           p + "self_attn.kv_b_proj.weight": rand(heads * (nope + v), rank), p + "self_attn.o_proj.weight": rand(h, heads * v)}
    if i < config["first_k_dense_replace"]:
        w = config["intermediate_size"]
        out.update({p + "mlp.gate_proj.weight": rand(w, h), p + "mlp.up_proj.weight": rand(w, h), p + "mlp.down_proj.weight": rand(h, w)})
        return out
    w, shared = config["moe_intermediate_size"], config["moe_intermediate_size"] * config["n_shared_experts"]
    out[p + "mlp.gate.weight"] = rand(config["n_routed_experts"], h)
    for x in range(config["n_routed_experts"]):
        out[f"{p}mlp.experts.{x}.gate_proj.weight"] = rand(w, h)
        out[f"{p}mlp.experts.{x}.up_proj.weight"] = rand(w, h)
        out[f"{p}mlp.experts.{x}.down_proj.weight"] = rand(h, w)
    out.update({p + "mlp.shared_experts.gate_proj.weight": rand(shared, h), p + "mlp.shared_experts.up_proj.weight": rand(shared, h),
                p + "mlp.shared_experts.down_proj.weight": rand(h, shared)})
    return out


SHAPES = {"qwen3-30b-a3b": QWEN3_30B_A3B, "deepseek-v2-lite": DEEPSEEK_V2_LITE}


def write_checkpoint(folder: Path, layers: int, tokenizer_dir: Path, seed: int = 0, base: dict = QWEN3_30B_A3B,
                     **shape) -> Path:
    """The HF folder: config, tokenizer files, one safetensors shard per layer (+ embeddings, head);
    `base` is the model's config (`SHAPES`), `shape` overrides its fields (tests make a small one)."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {**base, "num_hidden_layers": layers, **shape}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, folder / name)
    gen = torch.Generator().manual_seed(seed)
    v, h = config["vocab_size"], config["hidden_size"]
    shards = {"model-embed.safetensors": lambda: {
        "model.embed_tokens.weight": (torch.randn(v, h, generator=gen) * STD).bfloat16(),
        "lm_head.weight": (torch.randn(v, h, generator=gen) * STD).bfloat16(),
        "model.norm.weight": torch.ones(h).bfloat16()}}
    shards.update({f"model-layer{i:02d}.safetensors": (lambda i=i: layer_tensors(config, i, gen)) for i in range(layers)})
    index = {}
    for name, make in tqdm(shards.items(), desc="writing the synthetic checkpoint", unit="shard"):
        tensors = make()
        save_file(tensors, folder / name, metadata={"format": "pt"})
        index.update({t: name for t in tensors})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    return folder


def to_gguf(folder: Path, llama_cpp: Path, out: Path, quant: str = "Q4_K_M") -> Path:
    """llama.cpp's converter (bf16 GGUF) then its quantizer (`quant`); the bf16 file is removed."""
    bf16 = out.with_name(out.stem + "-bf16.gguf")
    subprocess.run([sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"), str(folder), "--outtype", "bf16",
                    "--outfile", str(bf16)], check=True)
    quantize = llama_cpp / "build" / "bin" / "llama-quantize"
    subprocess.run([str(quantize), str(bf16), str(out), quant], check=True)
    bf16.unlink()
    return out


def default_tokenizer_dir() -> Path:
    """The default draft's folder (Qwen's BPE tokenizer files), prepared from the `models` extra."""
    from specdec.target.model_files import DEFAULT_DRAFT_SPEC, resolve_model

    return resolve_model(DEFAULT_DRAFT_SPEC)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m specdec.eval.moe_synthetic", description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path, help="folder for the HF checkpoint and the GGUF")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (Qwen3-30B-A3B has 48, V2-Lite 27)")
    parser.add_argument("--shape", choices=SHAPES, default="qwen3-30b-a3b", help="whose layer shapes")
    parser.add_argument("--llama-cpp", type=Path, help="llama.cpp's source tree with build/bin (omit: no GGUF)")
    parser.add_argument("--quant", default="Q4_K_M", help="llama-quantize's type (default Q4_K_M)")
    parser.add_argument("--keep-hf", action="store_true", help="keep the bf16 safetensors after converting")
    args = parser.parse_args(argv)
    if args.layers < 1:
        parser.error("--layers must be at least 1")
    shape = {}
    if args.shape == "deepseek-v2-lite" and args.layers not in (26, 27):
        # llama.cpp takes a deepseek2 GGUF without q_lora_rank for V2-Lite only at 26 or 27 layers
        # (its `is_lite`) and otherwise asks for the key: the queries go through DeepSeek-V2's
        # low-rank projection (1536) instead, the one shape that differs
        shape["q_lora_rank"] = 1536
        print(f"deepseek-v2-lite with {args.layers} layers: q_lora_rank 1536 (DeepSeek-V2's), which llama.cpp needs "
              "below 26 layers", file=sys.stderr)
    hf = write_checkpoint(args.out / "hf", args.layers, default_tokenizer_dir(), base=SHAPES[args.shape], **shape)
    if args.llama_cpp is None:
        print(f"HF checkpoint: {hf}")
        return
    name = "qwen3moe-a3b" if args.shape == "qwen3-30b-a3b" else "deepseek2-v2-lite"
    gguf = to_gguf(hf, args.llama_cpp.expanduser(), args.out / f"{name}-shapes-{args.layers}L-{args.quant}.gguf",
                   args.quant)
    if not args.keep_hf:
        shutil.rmtree(hf)
    print(f"GGUF: {gguf}")


if __name__ == "__main__":
    main()
