"""Grammar libraries on the real Qwen2.5 vocabulary (151,936 ids): tokenizer compile, schema compile,
mask time per token, and the speculative pattern (consume k drafts, mask, roll back).

    python docs/results/issue16/bench_grammar.py TOKENIZER_DIR [--threads 1]

TOKENIZER_DIR: a saved transformers tokenizer of the default pair, e.g. from the GGUF:
    AutoTokenizer.from_pretrained("~/.cache/specdec/gguf", gguf_file="Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf")
        .save_pretrained(TOKENIZER_DIR)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

V = 151_936
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
        },
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "email", "tags", "address", "role"],
    "additionalProperties": False,
}
INSTANCE = {"name": "Ada Lovelace, Countess of Lovelace", "age": 36, "email": "ada@example.org",
            "tags": ["math", "engines", "poetry of science"], "address": {"city": "London", "zip": "12345"},
            "role": "admin"}


def ms(xs: list[float]) -> str:
    return f"median {1e3 * statistics.median(xs):.3f} ms, p90 {1e3 * sorted(xs)[int(0.9 * len(xs))]:.3f} ms"


def bench_llguidance(tok, ids: list[int], k: int) -> None:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    t = time.perf_counter()
    info = llguidance.hf.from_tokenizer(tok, n_vocab=V)
    print(f"llguidance: tokenizer compile {time.perf_counter() - t:.2f} s")
    t = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": False})
    m = llguidance.LLMatcher(info, grammar)
    print(f"llguidance: schema compile {1e3 * (time.perf_counter() - t):.1f} ms; error: {m.get_error()!r}")
    mask = lt.allocate_token_bitmask(1, V)
    times, spec, ff = [], [], 0
    for i, token in enumerate(ids):
        t = time.perf_counter()
        lt.fill_next_token_bitmask(m, mask)
        times.append(time.perf_counter() - t)
        assert (mask[0, token // 32] >> (token % 32)) & 1, (i, tok.decode([token]))
        ff += len(m.compute_ff_tokens()) > 0
        drafts = ids[i + 1 : i + 1 + k]
        assert m.consume_token(token), m.get_error()
        t = time.perf_counter()
        for j in range(1, len(drafts) + 1):  # a verify window: one mask per row, each after its drafts
            m.consume_tokens(drafts[:j])
            lt.fill_next_token_bitmask(m, mask)
            m.rollback(j)
        spec.append((time.perf_counter() - t) / max(len(drafts), 1))
    lt.fill_next_token_bitmask(m, mask)
    print(f"llguidance: mask per token {ms(times)}; per verify row with drafts (k={k}) {ms(spec)}; "
          f"{ff}/{len(ids)} positions with forced tokens; accepting at end {m.is_accepting()}")


def bench_xgrammar(tok, ids: list[int], k: int) -> None:
    import xgrammar as xgr

    t = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=V)
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    print(f"xgrammar: tokenizer compile {time.perf_counter() - t:.2f} s")
    t = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":"))
    print(f"xgrammar: schema compile {1e3 * (time.perf_counter() - t):.1f} ms")
    m = xgr.GrammarMatcher(compiled, max_rollback_tokens=16)
    mask = xgr.allocate_token_bitmask(1, V)
    times, spec = [], []
    for i, token in enumerate(ids):
        t = time.perf_counter()
        m.fill_next_token_bitmask(mask)
        times.append(time.perf_counter() - t)
        assert (mask[0, token // 32] >> (token % 32)) & 1, (i, tok.decode([token]))
        drafts = ids[i + 1 : i + 1 + k]
        assert m.accept_token(token)
        t = time.perf_counter()
        for j in range(1, len(drafts) + 1):
            for d in drafts[:j]:
                m.accept_token(d)
            m.fill_next_token_bitmask(mask)
            m.rollback(j)
        spec.append((time.perf_counter() - t) / max(len(drafts), 1))
    print(f"xgrammar: mask per token {ms(times)}; per verify row with drafts (k={k}) {ms(spec)}")


def bench_outlines(tok, ids: list[int]) -> None:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core import json_schema

    t = time.perf_counter()
    eos = tok.eos_token_id
    byte_of = {c: b for b, c in _bytes_to_unicode().items()}  # byte-level BPE symbols -> raw bytes
    tokens: dict[bytes, list[int]] = {}
    for token_str, token_id in tok.get_vocab().items():
        if token_id != eos and token_id not in tok.all_special_ids and all(c in byte_of for c in token_str):
            tokens.setdefault(bytes(byte_of[c] for c in token_str), []).append(token_id)
    vocab = Vocabulary(eos, tokens)
    print(f"outlines-core: vocabulary {time.perf_counter() - t:.2f} s")
    t = time.perf_counter()
    index = Index(json_schema.build_regex_from_schema(json.dumps(SCHEMA)), vocab)
    print(f"outlines-core: schema index {time.perf_counter() - t:.2f} s")
    guide = Guide(index)
    times = []
    for token in ids:
        t = time.perf_counter()
        allowed = guide.get_tokens()
        times.append(time.perf_counter() - t)
        guide.advance(token)
    print(f"outlines-core: allowed-token list per token {ms(times)} (a list, not a bitmask)")


def _bytes_to_unicode() -> dict[int, str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return bytes_to_unicode()


def bench_specdec(tok, ids: list[int]) -> None:
    """What the engine pays per row: `GrammarConstraint.allowed` (mask + unpacking to [V] bool)."""
    from specdec.sampling_params import StructuredSpec
    from specdec.structured import GrammarCompiler

    t = time.perf_counter()
    compiler = GrammarCompiler(tok, V, [tok.eos_token_id])
    compiler.ll_tokenizer
    print(f"specdec: GrammarCompiler tokenizer {time.perf_counter() - t:.2f} s")
    t = time.perf_counter()
    constraint = compiler.constraint(StructuredSpec.json_schema(SCHEMA))
    print(f"specdec: first request's grammar {1e3 * (time.perf_counter() - t):.1f} ms")
    t = time.perf_counter()
    compiler.constraint(StructuredSpec.json_schema(SCHEMA))
    print(f"specdec: next request's constraint (grammar cached) {1e3 * (time.perf_counter() - t):.1f} ms")
    times = []
    text = tok.decode(ids)
    ids = tok.encode(json.dumps(json.loads(text)), add_special_tokens=False)  # the engine's ", " / ": "
    for token in ids:
        t = time.perf_counter()
        allowed = constraint.allowed([], V)
        times.append(time.perf_counter() - t)
        assert allowed[token], tok.decode([token])
        constraint.commit([token])
    print(f"specdec: GrammarConstraint.allowed per token {ms(times)}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("tokenizer_dir")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("-k", type=int, default=4)
    parser.add_argument("--libs", default="llguidance,xgrammar,outlines,specdec")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.tokenizer_dir)
    ids = tok.encode(json.dumps(INSTANCE, separators=(",", ":")), add_special_tokens=False)
    print(f"{len(ids)} tokens of JSON; vocabulary {V}")
    for lib in args.libs.split(","):
        try:
            {"llguidance": lambda: bench_llguidance(tok, ids, args.k), "xgrammar": lambda: bench_xgrammar(tok, ids, args.k),
             "outlines": lambda: bench_outlines(tok, ids), "specdec": lambda: bench_specdec(tok, ids)}[lib]()
        except Exception as error:  # report and go on to the next library
            print(f"{lib}: failed: {type(error).__name__}: {error}")


if __name__ == "__main__":
    main()
