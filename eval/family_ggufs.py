"""Each family's GGUF as llama.cpp makes it, run by specdec and by llama.cpp on the same text.

    python -m specdec.eval.family_ggufs --llama-cpp DIR [--families llama32 smollm3 ...]
                                        [--gguf FILE ...] [--chunks 8] [--out DIR]
                                        [--shape tiny|0.5b] [--measure ppl speed] [--rounds 2]

For each family: a small random transformers model of it (real layer kinds, fewer and narrower
layers; the default draft's Qwen2.5 tokenizer, which llama.cpp's converter knows), converted by
llama.cpp's own `convert_hf_to_gguf.py` and quantized to Q4_K_M by its `llama-quantize`; then
`specdec eval perplexity`'s method on it beside `llama-perplexity`, same file, same text (ShareGPT
answers). `--gguf` adds files you have (a real Gemma 3 270M). A random model's perplexity is large;
what the ratio shows is that both engines compute the same function of the same bytes.
`--shape 0.5b --measure speed` makes them at the default target's widths and times one-row decode
and 512-token prefill beside `llama-bench` (tg128 / pp512) on each file. DIR is the
llama.cpp tree `shared/tools/build-llama-cpp.sh` unpacks (its `build/bin` holds the binaries).
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

# family -> (transformers config class, its arguments beyond the common shape); rope contexts of 256
# so a 512-token chunk runs past them where the family scales rope
FAMILIES = {
    "llama32": ("LlamaConfig", dict(tie_word_embeddings=True, rope_parameters=dict(
        rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=256, rope_theta=500000.0))),
    "smollm3": ("SmolLM3Config", dict(num_hidden_layers=4, no_rope_layer_interval=4, tie_word_embeddings=True)),
    "granite": ("GraniteConfig", dict(embedding_multiplier=12.0, residual_multiplier=0.22,
                                      attention_multiplier=0.015625, logits_scaling=4.0)),
    "phi4-mini": ("Phi3Config", dict(hidden_size=512, num_attention_heads=8, original_max_position_embeddings=256,
                                     tie_word_embeddings=True, rope_parameters=dict(
                                         rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.75,
                                         original_max_position_embeddings=256,
                                         short_factor=[1.0 + 0.05 * i for i in range(24)],
                                         long_factor=[2.0 + i for i in range(24)]))),
    "glm4": ("Glm4Config", dict(attention_bias=True)),  # half of each 64-wide head turned, in pairs
    # 8 experts of the common intermediate width, top 2; llama.cpp's graph wants as many k heads
    # as q heads (whole-width q/k norms) and its converter writes an eps of 1e-5 whatever the config says
    "olmoe": ("OlmoeConfig", dict(num_experts=8, num_experts_per_tok=2, num_key_value_heads=4, rms_norm_eps=1e-5)),
    # sinks, sliding layers (128) between full ones, YaRN from 256 (truncated to whole dims, as
    # llama.cpp runs it), router and expert biases, the SwiGLU clamp at 7; Q4_K_M, and MXFP4 experts
    # as gpt-oss ships them (`llama-quantize MXFP4_MOE`)
    "gpt-oss": ("GptOssConfig", dict(head_dim=64, num_local_experts=8, num_experts_per_tok=2, sliding_window=128,
                                     rope_parameters=dict(rope_type="yarn", factor=8.0, beta_fast=32.0, beta_slow=1.0,
                                                          original_max_position_embeddings=256, rope_theta=150000.0))),
    # hybrids: Gated DeltaNet layers (3 of 4) beside gated full attention; Qwen3.5 with 2 value heads
    # a key head (llama.cpp's converter tiles them), Qwen3-Next with its MoE (shared expert)
    "qwen3.5": ("Qwen3_5TextConfig", dict(num_hidden_layers=4, head_dim=64, linear_num_key_heads=2,
                                          linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64)),
    "qwen3-next": ("Qwen3NextConfig", dict(num_hidden_layers=4, head_dim=64, linear_num_key_heads=2,
                                           linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
                                           num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256,
                                           shared_expert_intermediate_size=256)),
}
FAMILIES["gpt-oss-mxfp4"] = FAMILIES["gpt-oss"]
# the converter's flags per family: the hybrids' multi-token-prediction head left out (random
# models have none; specdec does not read one)
CONVERT_FLAGS = {"qwen3.5": ("--no-mtp",), "qwen3-next": ("--no-mtp",)}
QUANT = {"gpt-oss-mxfp4": "MXFP4_MOE"}  # llama-quantize's type per family (default Q4_K_M)
# --shape: "tiny" for perplexity (what shows the same function), "0.5b" for speed at the default
# target's widths (Qwen2.5-0.5B: 896 wide, 24 layers, 14 heads of 64, 2 kv heads; MoE experts 1024
# wide); the families keep their own layer kinds
SHAPES = {"tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2),
          "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                       num_key_value_heads=2)}
_MOE = ("olmoe", "gpt-oss", "gpt-oss-mxfp4", "qwen3-next")
# llama-perplexity's context per family: longrope keeps its short factors up to its original context
CTX = {"phi4-mini": 256}


def make_model(family: str, tokenizer, out: Path, seed: int = 0, shape: str = "tiny") -> Path:
    """A random `family` model with `tokenizer` of `shape` (`SHAPES`), saved as a transformers folder `out`."""
    import torch
    import transformers as tf

    cls, extra = FAMILIES[family]
    if family == "glm4":  # llama.cpp's GLM-4 converter sets its end-of-turn token from this one
        import copy

        tokenizer = copy.deepcopy(tokenizer)
        tokenizer.add_special_tokens({"additional_special_tokens": ["<|user|>"]})
    widths = dict(SHAPES[shape])
    if shape != "tiny":
        extra = {k: v for k, v in extra.items()
                 if k not in ("hidden_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers")}
        if family in _MOE:
            widths["intermediate_size"] = 1024
        if family == "olmoe":  # as many k heads as q heads (above)
            widths["num_key_value_heads"] = widths["num_attention_heads"]
        if family == "phi4-mini":  # longrope's short factors to 4096, as Phi-4-mini ships: the speed
            # figures run 672 positions, and specdec stops a longrope context at its original length
            extra = {**extra, "original_max_position_embeddings": 4096,
                     "rope_parameters": {**extra["rope_parameters"], "original_max_position_embeddings": 4096}}
    widths = dict(vocab_size=len(tokenizer), **widths, max_position_embeddings=4096, rms_norm_eps=1e-6,
                  bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"), eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(getattr(tf, cls)(**{**widths, **extra}), dtype=torch.float32)
    with torch.no_grad():  # peaked next-token distributions: a wrong forward moves the perplexity
        for p in model.parameters():
            p.normal_(0, 0.06) if p.dim() == 2 else p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if family == "phi4-mini":  # llama.cpp's Phi-3 converter reads a BPE vocabulary (Phi-4's) by this class
        config = json.loads((out / "tokenizer_config.json").read_text())
        (out / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "GPT2Tokenizer"}))
    return out


def convert(llama_cpp: Path, folder: Path, out: Path, quant: str = "Q4_K_M", extra: tuple[str, ...] = ()) -> Path:
    """`convert_hf_to_gguf.py` to f32 (with `extra` flags), then `llama-quantize` to `quant` (`out`)."""
    f32 = out.with_name(out.stem + "-f32.gguf")
    bin_dir = llama_cpp / "build" / "bin"
    _run([sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"), str(folder), "--outfile", str(f32), "--outtype", "f32",
          *extra])
    _run([str(bin_dir / "llama-quantize"), str(f32), str(out), quant], env={"LD_LIBRARY_PATH": str(bin_dir)})
    f32.unlink()
    return out


def _run(cmd: list[str], env: dict | None = None) -> None:
    import os

    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-5:])
        raise RuntimeError(f"{Path(cmd[1] if cmd[0] == sys.executable else cmd[0]).name} failed:\n{tail}")


def measure(gguf: Path, llama_cpp: Path, text: str, text_file: Path, ctx: int, chunks: int, threads: int | None) -> dict:
    from specdec.config import EngineConfig
    from specdec.engine import Engine
    from specdec.eval import perplexity

    engine = Engine(EngineConfig(target=str(gguf), proposer="none"))
    ours = perplexity.perplexity(engine, text, ctx, chunks, progress=False)
    theirs = perplexity.llama_perplexity(llama_cpp / "build" / "bin", str(gguf), text_file, ctx, ours.chunks, threads)
    return {"file": str(gguf), "ctx": ctx, "chunks": ours.chunks, "specdec_ppl": ours.ppl, "llama_ppl": theirs["ppl"],
            "ratio": ours.ppl / theirs["ppl"], "quant": engine.config.target_quant, "dtype": engine.config.dtype}


def speed(gguf: Path, llama_cpp: Path, threads: int, rounds: int) -> dict:
    """One-row decode and 512-token prefill of `gguf` in specdec (the file's blocks as stored, bf16)
    and `llama-bench` (tg128 / pp512), `rounds` alternating rounds, medians (`moe_bench`'s figures)."""
    import torch

    from specdec.eval import moe_bench

    torch.set_num_threads(threads)
    runner, _ = moe_bench.load_runner(gguf, "gguf")
    bin_dir = llama_cpp / "build" / "bin"
    pairs = [(moe_bench.specdec_figures(runner, 3, ()), moe_bench.llama_figures(gguf, bin_dir, threads, 3, ()))
             for _ in range(max(1, rounds))]
    ours, theirs = (moe_bench.median_of([p[i] for p in pairs]) for i in (0, 1))
    return {"file": str(gguf), "bytes": gguf.stat().st_size, "threads": threads,
            **{f"specdec_{k}": ours[k] for k in ("tg128", "pp512")}, **{f"llama_{k}": theirs[k] for k in ("tg128", "pp512")}}


def speed_table(rows: dict[str, dict]) -> str:
    lines = ["| family | file | MB | tg128 specdec / llama.cpp (tok/s) | ratio | pp512 specdec / llama.cpp (tok/s) | ratio |",
             "|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        tg, pp = r["specdec_tg128"] / r["llama_tg128"], r["specdec_pp512"] / r["llama_pp512"]
        lines.append(f"| {name} | {Path(r['file']).name} | {r['bytes'] / 1e6:.0f} | {r['specdec_tg128']:.1f} / "
                     f"{r['llama_tg128']:.1f} | {tg:.2f}x | {r['specdec_pp512']:.0f} / {r['llama_pp512']:.0f} | {pp:.2f}x |")
    return "\n".join(lines)


def table(rows: dict[str, dict]) -> str:
    lines = ["| family | file | ctx x chunks | specdec PPL | llama.cpp PPL | specdec / llama.cpp |", "|---|---|---|---|---|---|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {Path(r['file']).name} | {r['ctx']} x {r['chunks']} | {r['specdec_ppl']:.4f} | "
                     f"{r['llama_ppl']:.4f} | {r['ratio']:.4f} ({100 * (r['ratio'] - 1):+.2f}%) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from specdec.eval.perplexity import sharegpt_text
    from specdec.eval.report import default_out_dir, provenance
    from specdec.target.model_files import resolve_model
    from specdec.target.tokenizer import load_tokenizer

    p = argparse.ArgumentParser(prog="python -m specdec.eval.family_ggufs", description=__doc__.split("\n\n")[0])
    p.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp's tree (convert_hf_to_gguf.py, build/bin)")
    p.add_argument("--families", nargs="*", choices=list(FAMILIES), default=list(FAMILIES))
    p.add_argument("--gguf", nargs="*", type=Path, default=[], help="GGUF files of your own, measured the same way")
    p.add_argument("--chunks", type=int, default=8, help="chunks of each file's context")
    p.add_argument("--threads", type=int, default=None, help="llama.cpp's threads")
    p.add_argument("--out", type=Path, default=None, help="output folder (default: results/family-ggufs-<UTC>)")
    p.add_argument("--shape", choices=list(SHAPES), default="tiny",
                   help="the random models' widths: tiny (perplexity) or 0.5b (the default target's, for --measure speed)")
    p.add_argument("--measure", nargs="*", choices=["ppl", "speed"], default=["ppl"],
                   help="perplexity beside llama-perplexity, and/or tg128 / pp512 beside llama-bench "
                        "(speed: run it with nothing else running); none: only make the files (then --gguf them)")
    p.add_argument("--rounds", type=int, default=2, help="speed: specdec then llama-bench, this many times alternating")
    args = p.parse_args(argv)
    if not (args.llama_cpp / "convert_hf_to_gguf.py").is_file():
        p.error(f"{args.llama_cpp} has no convert_hf_to_gguf.py: pass the llama.cpp tree")
    out = args.out or default_out_dir("family-ggufs")
    out.mkdir(parents=True, exist_ok=True)
    text = sharegpt_text(6 * 512 * args.chunks)
    text_file = out / "text.txt"
    text_file.write_text(text, encoding="utf-8")
    tokenizer = load_tokenizer(resolve_model("default-draft"))
    rows, speeds = {}, {}
    files = []
    for family in args.families:
        print(f"{family}: converting and quantizing ({args.shape})", file=sys.stderr)
        quant = QUANT.get(family, "Q4_K_M")
        folder = make_model(family, tokenizer, out / family, shape=args.shape)
        files.append((family, convert(args.llama_cpp, folder, out / f"{family}-{quant}.gguf", quant,
                                      CONVERT_FLAGS.get(family, ())), CTX.get(family, 512)))
        shutil.rmtree(folder)
    files += [(path.stem, path, 512) for path in args.gguf]
    for name, gguf, ctx in files:
        if "ppl" in args.measure:
            rows[name] = measure(gguf, args.llama_cpp, text, text_file, ctx, args.chunks, args.threads)
            print(table({name: rows[name]}).splitlines()[-1], file=sys.stderr)
        if "speed" in args.measure:
            speeds[name] = speed(gguf, args.llama_cpp, args.threads or 2, args.rounds)
            print(speed_table({name: speeds[name]}).splitlines()[-1], file=sys.stderr)
    result = "\n\n".join(t for t in (table(rows) if rows else "", speed_table(speeds) if speeds else "") if t)
    words = argv if argv is not None else sys.argv[1:]
    meta = {**provenance(args, words), "command": "python -m specdec.eval.family_ggufs " + shlex.join(words)}
    (out / "family_ggufs.json").write_text(json.dumps({"meta": meta,
                                                       "rows": rows, "speed": speeds}, indent=2, default=str))
    (out / "family_ggufs.md").write_text(result + "\n")
    print(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
