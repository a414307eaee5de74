"""Count the target's own outputs into the draft vocabulary table (`draft.vocab`, FR-Spec /
VocabTrim), and measure its coverage on held-out prompts.

The target answers (greedy, target-only, all prompts batched) the HumanEval and ShareGPT prompts
after the first `--skip` of each (those are what `specdec bench latency` measures: held out); its
output ids, most frequent first, lead the table `draft/vocab/<tokenizer fingerprint>.json`. Ids
the target never said follow by their frequency in the datasets' own answers (HumanEval's
solutions, ShareGPT's replies; held-out prompts excluded): a few thousand generated answers name
only ~3,500 ids. The held-out prompts' answers then give the coverage of each size: the share of
the target's tokens a head over that many ids could propose.

    python -m specdec.eval.draft_vocab --per-dataset 96 --max-tokens 128
    python -m specdec.eval.draft_vocab --reuse draft/vocab/<fingerprint>.json   # recount the rest only
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from collections import Counter

from specdec.draft import vocab
from specdec.eval.datasets import humaneval_prompts, sharegpt_pairs, sharegpt_prompts

SIZES = (4096, 8192, 16384, 32768, 65536)


def answers(engine, prompts, max_tokens: int) -> list[list[int]]:
    """The target's greedy answers to `prompts`, all submitted at once (continuous batching)."""
    from specdec import SamplingParams

    ids = [engine.encode(p.text, chat=p.chat) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    return [out.token_ids for out in engine.generate(ids, params)]


def prompts_of(engine, skip: int, count: int) -> tuple[list, list]:
    """(held-out, counted): the first `skip` of each dataset, and the `count` after them."""
    tokenize = lambda text: engine.tokenizer(text).input_ids  # noqa: E731
    held, counted = [], []
    for source in (humaneval_prompts(), sharegpt_prompts(tokenize)):
        first = list(itertools.islice(source, skip + count))
        held += first[:skip]
        counted += first[skip:]
    return held, counted


def reference_order(tokenizer, held: list, replies: int) -> list[int]:
    """Ids by frequency in HumanEval's solutions and the first `replies` ShareGPT replies, the
    held-out prompts' own excluded."""
    held_ids, held_texts = {p.id for p in held}, {p.text for p in held}
    counts: Counter = Counter()
    for p in humaneval_prompts():
        if p.id not in held_ids:
            counts.update(tokenizer(p.reference).input_ids)
    taken = 0
    for _, prompt, reply in sharegpt_pairs():
        if taken >= replies:
            break
        if prompt not in held_texts:
            counts.update(tokenizer(reply).input_ids)
            taken += 1
    return [i for i, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]


def coverage(tokens: list[int], engine, table: list[int]) -> dict[int, float]:
    """Share of `tokens` inside the head each size keeps."""
    stop_ids = list(engine.eos_token_ids)
    vocab_size = engine.target.model.config.vocab_size
    out = {}
    for size in SIZES:
        kept = set(vocab.frequent_ids(engine.tokenizer, size, stop_ids, vocab_size, table).tolist())
        out[size] = sum(t in kept for t in tokens) / max(1, len(tokens))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--per-dataset", type=int, default=96, help="prompts counted per dataset")
    p.add_argument("--skip", type=int, default=10, help="first prompts of each dataset held out")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--replies", type=int, default=20000, help="ShareGPT replies counted after the outputs")
    p.add_argument("--reuse", default=None, metavar="TABLE",
                   help="take the output counts of this table instead of generating them again")
    p.add_argument("--out", default=None, help="table path (default: the shipped one for the tokenizer)")
    args = p.parse_args(argv)

    from specdec import Engine, EngineConfig

    engine = Engine(EngineConfig(proposer="none", max_num_seqs=32, kv_cache_memory_gib=2.0))
    held, counted = prompts_of(engine, args.skip, args.per_dataset)
    if args.reuse:
        record = json.loads(open(args.reuse).read())
        outputs = record["ids"][: record.get("output_ids", len(record["ids"]))]
    else:
        start = time.perf_counter()
        counts = Counter(t for ans in answers(engine, counted, args.max_tokens) for t in ans)
        outputs = [i for i, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
        record = {"tokenizer": vocab.fingerprint(engine.tokenizer), "prompts": len(counted),
                  "counted_tokens": sum(counts.values()), "max_tokens": args.max_tokens}
        print(f"counted {record['counted_tokens']} output tokens ({len(outputs)} distinct) of {len(counted)} "
              f"prompts in {time.perf_counter() - start:.0f} s")
    seen = set(outputs)
    rest = [i for i in reference_order(engine.tokenizer, held, args.replies) if i not in seen]
    table = outputs + rest
    record.update(output_ids=len(outputs), reference_replies=args.replies, ids=table)
    out = args.out or vocab.table_path(engine.tokenizer)
    with open(out, "w") as f:
        json.dump(record, f)
    print(f"{len(outputs)} ids from the target's outputs, {len(rest)} from the datasets' answers -> {out}")
    tokens = [t for ans in answers(engine, held, args.max_tokens) for t in ans]
    print(f"\ncoverage of the target's {len(tokens)} tokens on the {len(held)} held-out prompts:\n")
    print("| ids kept | " + " | ".join(str(s) for s in SIZES) + " |")
    print("|---|" + "---|" * len(SIZES))
    print("| share of tokens | " + " | ".join(f"{c:.4f}" for c in coverage(tokens, engine, table).values()) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
