"""Prompts to token ids once, and timed batch-1 runs on our engine (a trace per request)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from specdec.eval.datasets import Prompt, file_prompts, humaneval_prompts, sharegpt_prompts
from specdec.eval.metrics import RequestTrace
from specdec.sampling_params import SamplingParams
from specdec.verify import AcceptanceStats


@dataclass
class EncodedPrompt:
    """A dataset prompt as the token ids every system receives (chat template applied if needed)."""

    id: str
    token_ids: list[int]


def load_engine(config):
    """`Engine(config)` behind a status line on stderr (the first run converts the GGUF files)."""
    from rich.console import Console

    from specdec.engine import Engine

    message = "loading models (the first run converts GGUF files; later runs take seconds)"
    with Console(stderr=True).status(message):
        return Engine(config)


def dataset_prompts(name: str, tokenize, seed: int, max_prompt_tokens: int) -> Iterator[Prompt]:
    """HumanEval in file order (raw code prompts), ShareGPT shuffled by `seed` (chat prompts), or
    a JSON-lines file of your own prompts."""
    if name == "humaneval":
        return humaneval_prompts()
    if name == "sharegpt":
        return sharegpt_prompts(tokenize, seed, max_prompt_len=max_prompt_tokens)
    if name.endswith(".jsonl") and Path(name).is_file():
        return file_prompts(Path(name))
    raise ValueError(f"unknown dataset {name!r}: use humaneval, sharegpt or an existing .jsonl file")


def encode_prompts(
    engine, name: str, limit: int | None, seed: int, max_prompt_tokens: int, max_tokens: int
) -> list[EncodedPrompt]:
    """The first `limit` prompts of a dataset that fit `max_prompt_tokens` and the engine's context."""
    tokenize = lambda text: engine.tokenizer(text).input_ids  # noqa: E731  (vLLM counts this way)
    max_len = min(max_prompt_tokens, engine.max_model_len - max_tokens)
    encoded = (
        EncodedPrompt(p.id, engine.encode(p.text, chat=p.chat))
        for p in dataset_prompts(name, tokenize, seed, max_prompt_tokens)
    )
    prompts = list(itertools.islice((e for e in encoded if len(e.token_ids) <= max_len), limit))
    if not prompts:
        raise ValueError(
            f"no {name} prompt fits --max-prompt-tokens {max_prompt_tokens} and the context "
            f"({engine.max_model_len} tokens, {max_tokens} of them for the output)"
        )
    return prompts


@dataclass
class StepRecord:
    """One engine step that advanced a lone request: what the engine reported (`StepDelta`) and how
    long it took. Steps that only fed a prefill chunk emit nothing and are not recorded."""

    num_drafted: int
    num_accepted: int
    seconds: float  # wall time of the whole `engine.step()`
    draft_seconds: float = 0.0  # of it, the draft model's timed forwards (0 when untimed)
    num_draft_forwards: int = 0
    depth: int | None = None  # a token tree's longest path (num_drafted counts its nodes); None: a chain

    @property
    def chain_length(self) -> int:
        """The drafts one path of this step held: a chain's drafts, a tree's depth."""
        return self.num_drafted if self.depth is None else self.depth


def time_draft_forwards(engine) -> bool:
    """Have the draft model time each forward (`DraftModelProposer.timed`, as the adaptive-k policy
    does; on CUDA each forward then syncs). False when the proposer has no draft model (n-gram)."""
    model = getattr(engine.proposer, "model", engine.proposer)  # HybridProposer wraps the model
    if not hasattr(model, "timed"):
        return False
    model.timed = True
    return True


def run_request(
    engine, token_ids: list[int], params: SamplingParams, k: int
) -> tuple[RequestTrace, list[StepRecord]]:
    """One request alone on the engine: its timing trace and a record of each step that emitted.
    Starts with an empty prefix cache, so that every system and k prefills the same prompt."""
    engine.reset_prefix_cache()
    draft_timings = getattr(engine.proposer, "forward_seconds", [])  # filled only when timed
    draft_timings.clear()
    trace = RequestTrace(time.perf_counter(), prompt_tokens=len(token_ids))
    steps: list[StepRecord] = []
    request_id = engine.add_request(token_ids, params, num_speculative_tokens=k)
    try:
        while engine.has_unfinished():
            start = time.perf_counter()
            deltas = engine.step()
            now = time.perf_counter()
            for delta in deltas:
                steps.append(StepRecord(
                    delta.num_drafted, delta.num_accepted, now - start,
                    sum(s for _, s in draft_timings), len(draft_timings), delta.draft_depth,
                ))
                if delta.token_ids:
                    trace.add_chunk(now, len(delta.token_ids))
                    trace.token_ids += delta.token_ids
            draft_timings.clear()
    finally:
        engine.release(request_id)
    return trace, steps


def run_concurrent(
    engine, prompts: list[list[int]], params: SamplingParams, k: int
) -> tuple[list[RequestTrace], float, AcceptanceStats]:
    """All prompts at once on the engine: per-request traces, wall seconds, and the acceptance
    counts of the steps that drafted. Starts with an empty prefix cache (see `run_request`)."""
    engine.reset_prefix_cache()
    start = time.perf_counter()
    traces, stats = {}, AcceptanceStats()
    for token_ids in prompts:
        rid = engine.add_request(token_ids, params, num_speculative_tokens=k)
        traces[rid] = RequestTrace(start, prompt_tokens=len(token_ids))
    try:
        while engine.has_unfinished():
            deltas = engine.step()
            now = time.perf_counter()
            for delta in deltas:
                if delta.num_drafted:
                    stats.update(delta.num_drafted, delta.num_accepted)
                if delta.token_ids:
                    traces[delta.request_id].add_chunk(now, len(delta.token_ids))
    finally:
        for rid in traces:
            engine.release(rid)
    return list(traces.values()), time.perf_counter() - start, stats
