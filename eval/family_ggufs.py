"""Each family's GGUF as llama.cpp makes it, run by specdec and by llama.cpp on the same text.

    python -m specdec.eval.family_ggufs --llama-cpp DIR [--families llama32 smollm3 ...]
                                        [--gguf FILE ...] [--chunks 8] [--out DIR]

For each family: a small random transformers model of it (real layer kinds, fewer and narrower
layers; the default draft's Qwen2.5 tokenizer, which llama.cpp's converter knows), converted by
llama.cpp's own `convert_hf_to_gguf.py` and quantized to Q4_K_M by its `llama-quantize`; then
`specdec eval perplexity`'s method on it beside `llama-perplexity`, same file, same text (ShareGPT
answers). `--gguf` adds files you have (a real Gemma 3 270M). A random model's perplexity is large;
what the ratio shows is that both engines compute the same function of the same bytes. DIR is the
llama.cpp tree `shared/tools/build-llama-cpp.sh` unpacks (its `build/bin` holds the binaries).
"""

from __future__ import annotations

import argparse
import json
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
}
# llama-perplexity's context per family: longrope keeps its short factors up to its original context
CTX = {"phi4-mini": 256}


def make_model(family: str, tokenizer, out: Path, seed: int = 0) -> Path:
    """A random `family` model with `tokenizer`, saved as a transformers folder `out`."""
    import torch
    import transformers as tf

    cls, extra = FAMILIES[family]
    if family == "glm4":  # llama.cpp's GLM-4 converter sets its end-of-turn token from this one
        import copy

        tokenizer = copy.deepcopy(tokenizer)
        tokenizer.add_special_tokens({"additional_special_tokens": ["<|user|>"]})
    shape = dict(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-6,
                 bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"), eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(getattr(tf, cls)(**{**shape, **extra}), dtype=torch.float32)
    with torch.no_grad():  # peaked next-token distributions: a wrong forward moves the perplexity
        for p in model.parameters():
            p.normal_(0, 0.06) if p.dim() == 2 else p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if family == "phi4-mini":  # llama.cpp's Phi-3 converter reads a BPE vocabulary (Phi-4's) by this class
        config = json.loads((out / "tokenizer_config.json").read_text())
        (out / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "GPT2Tokenizer"}))
    return out


def convert(llama_cpp: Path, folder: Path, out: Path) -> Path:
    """`convert_hf_to_gguf.py` to f32, then `llama-quantize` to Q4_K_M (`out`)."""
    f32 = out.with_name(out.stem + "-f32.gguf")
    bin_dir = llama_cpp / "build" / "bin"
    _run([sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"), str(folder), "--outfile", str(f32), "--outtype", "f32"])
    _run([str(bin_dir / "llama-quantize"), str(f32), str(out), "Q4_K_M"], env={"LD_LIBRARY_PATH": str(bin_dir)})
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
    args = p.parse_args(argv)
    if not (args.llama_cpp / "convert_hf_to_gguf.py").is_file():
        p.error(f"{args.llama_cpp} has no convert_hf_to_gguf.py: pass the llama.cpp tree")
    out = args.out or default_out_dir("family-ggufs")
    out.mkdir(parents=True, exist_ok=True)
    text = sharegpt_text(6 * 512 * args.chunks)
    text_file = out / "text.txt"
    text_file.write_text(text, encoding="utf-8")
    tokenizer = load_tokenizer(resolve_model("default-draft"))
    rows = {}
    for family in args.families:
        print(f"{family}: converting and quantizing", file=sys.stderr)
        gguf = convert(args.llama_cpp, make_model(family, tokenizer, out / family), out / f"{family}-Q4_K_M.gguf")
        rows[family] = measure(gguf, args.llama_cpp, text, text_file, CTX.get(family, 512), args.chunks, args.threads)
        print(table({family: rows[family]}).splitlines()[-1], file=sys.stderr)
    for path in args.gguf:
        rows[path.stem] = measure(path, args.llama_cpp, text, text_file, 512, args.chunks, args.threads)
    result = table(rows)
    (out / "family_ggufs.json").write_text(json.dumps({"meta": provenance(args, ["python", "-m", "specdec.eval.family_ggufs"]),
                                                       "rows": rows}, indent=2, default=str))
    (out / "family_ggufs.md").write_text(result + "\n")
    print(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
