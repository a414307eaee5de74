"""Grammar-forced drafting, side by side: the same JSON-schema workload with and without it, on
one engine (the proposer's switch flipped between rounds), greedy, so both give the same tokens.

    python docs/results/issue16/bench_forced.py [--rounds 2] [--max-tokens 160] [-k 5] [--fixed-k] [--proposer draft]

Prints per mode: wall time, generated tokens, tokens/s, draft-model forwards, tokens the grammar
proposed, acceptance; every answer is validated against its schema (jsonschema).
"""

from __future__ import annotations

import argparse
import json
import time

import jsonschema

from specdec import Engine, EngineConfig, SamplingParams, StructuredSpec

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "languages": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "languages"], "additionalProperties": False}
FUNCTION = {"type": "object", "properties": {
    "function_name": {"type": "string"}, "parameters": {"type": "array", "items": {"type": "object", "properties": {
        "name": {"type": "string"}, "type": {"enum": ["int", "str", "list", "dict", "float", "bool"]}},
        "required": ["name", "type"], "additionalProperties": False}},
    "returns": {"enum": ["int", "str", "list", "dict", "float", "bool", "None"]}, "complexity": {"type": "string"}},
    "required": ["function_name", "parameters", "returns", "complexity"], "additionalProperties": False}
TESTS = {"type": "object", "properties": {"cases": {"type": "array", "items": {"type": "object", "properties": {
    "input": {"type": "string"}, "expected": {"type": "string"}}, "required": ["input", "expected"],
    "additionalProperties": False}, "minItems": 2, "maxItems": 4}}, "required": ["cases"], "additionalProperties": False}
WORKLOAD = [
    ("Describe Guido van Rossum as JSON.", PERSON),
    ("Describe Grace Hopper as JSON.", PERSON),
    ("Describe the signature of def quicksort(xs: list) -> list as JSON.", FUNCTION),
    ("Describe the signature of def binary_search(items: list, target: int) -> int as JSON.", FUNCTION),
    ("Give test cases for a function that reverses a string, as JSON.", TESTS),
    ("Give test cases for a function that checks if a number is prime, as JSON.", TESTS),
]


def run(engine: Engine, forced: bool, max_tokens: int) -> dict:
    model = getattr(engine.proposer, "model", engine.proposer)
    model.grammar_forced = forced
    forwards = []
    forward = model._forward
    model._forward = lambda windows: (forwards.append(1), forward(windows))[1]
    forced_before = model.num_forced
    drafts_before, accepted_before = engine.stats.num_draft_tokens, engine.stats.num_accepted_tokens
    tokens, start = 0, time.perf_counter()
    for prompt, schema in WORKLOAD:  # one request at a time: batch 1, as a chat client sends them
        params = SamplingParams(temperature=0, max_tokens=max_tokens, structured=StructuredSpec.json_schema(schema))
        out = engine.generate([engine.encode(prompt, chat=True)], params)[0]
        tokens += len(out.token_ids)
        if out.finish_reason == "stop":
            jsonschema.validate(json.loads(out.text), schema)
    seconds = time.perf_counter() - start
    model._forward = forward
    drafts = engine.stats.num_draft_tokens - drafts_before
    return dict(forced=forced, seconds=seconds, tokens=tokens, tok_s=tokens / seconds, draft_forwards=len(forwards),
                grammar_tokens=model.num_forced - forced_before, drafted=drafts,
                acceptance=(engine.stats.num_accepted_tokens - accepted_before) / max(drafts, 1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("-k", type=int, default=5)
    parser.add_argument("--fixed-k", action="store_true", help="draft k every step (no adaptive policy)")
    parser.add_argument("--proposer", default="hybrid", choices=["draft", "hybrid"])
    args = parser.parse_args()
    engine = Engine(EngineConfig(num_speculative_tokens=args.k, adaptive_k=not args.fixed_k, proposer=args.proposer))
    run(engine, True, 16)  # warm: kernels, the grammar compiler's token table, the policy's costs
    results = {False: [], True: []}
    for r in range(args.rounds):
        for forced in ((False, True) if r % 2 == 0 else (True, False)):
            results[forced].append(run(engine, forced, args.max_tokens))
            print(json.dumps(results[forced][-1]))
    for forced, rs in results.items():
        total = {key: sum(x[key] for x in rs) for key in ("seconds", "tokens", "draft_forwards", "grammar_tokens")}
        print(f"grammar_forced={forced}: {total['tokens']} tokens in {total['seconds']:.1f} s = "
              f"{total['tokens'] / total['seconds']:.2f} tok/s; draft forwards {total['draft_forwards']}; "
              f"grammar-proposed tokens {total['grammar_tokens']}")


if __name__ == "__main__":
    main()
