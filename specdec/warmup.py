"""Warm-up: run both models through the shapes a request uses before anything is timed or served.

A freshly loaded engine answers its first request 3-4x slower than later ones: the weights mapped
from the quantized cache are paged in by the first forward that reads them, the GEMM libraries
pack and dispatch per shape on first use, and the speculation policy's cost tables and the
prefill chunk sizer start empty. `warm_up` sends the engine through one short request per
sampling mode (greedy, then sampled), which covers what a request does:

- a target prefill of a chat-sized prompt, and the draft's catch-up over the same prompt;
- decode steps: the target's one-row forward and verify windows up to the largest k (the prompt
  counts, so the draft agrees with the target and the policy drafts long windows);
- the draft's one-row loop, and warp_probs' greedy and top-p paths.

The first pass's timings are cold, so the policy's and sizer's measurements are dropped after it
and the second pass measures warm. Afterwards the engine's counters (acceptance, prefix-cache
hit statistics) read zero again. The blocks the passes cached stay cached: a later chat request
whose conversation starts with the same template (its system prompt) hits them as it would hit
any earlier request's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from specdec.sampling_params import SamplingParams

WARMUP_TEXT = "Count from 1 to 60, separated by commas: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"
WARMUP_TOKENS = 24  # generated per pass: enough steps for the policy to reach its longest windows
PASSES = (0.0, 0.7)  # temperatures: greedy, then sampled (top_p below exercises the sorted path)


@dataclass
class WarmupReport:
    seconds: float
    num_passes: int
    num_tokens: int  # generated over all passes


def warm_up(engine, max_tokens: int = WARMUP_TOKENS) -> WarmupReport:
    """Run `engine` through a short request per sampling mode; it must have nothing in flight."""
    if engine.has_unfinished():
        raise RuntimeError("warm_up needs an idle engine (requests are in flight)")
    start = time.perf_counter()
    prompt = warmup_prompt(engine)
    num_tokens = 0
    for i, temperature in enumerate(PASSES):
        params = SamplingParams(temperature=temperature, top_p=0.95, max_tokens=max_tokens,
                                ignore_eos=True, seed=i)
        request_id = engine.add_request(prompt, params, request_id=f"specdec-warmup-{i}")
        try:
            while engine.has_unfinished():
                num_tokens += sum(len(d.token_ids) for d in engine.step())
        finally:
            engine.release(request_id)
        if i == 0:
            _forget_timings(engine)  # cold: paging and first-use packing inflated every step
    engine.reset_stats()  # users read acceptance and prefix-cache hits from zero
    return WarmupReport(time.perf_counter() - start, len(PASSES), num_tokens)


def warmup_prompt(engine) -> list[int]:
    """`WARMUP_TEXT` as a chat message where the tokenizer has a template (a request's shape), as
    plain text otherwise; without a tokenizer, a run of ids below the vocabulary size."""
    tokenizer = engine.tokenizer
    if tokenizer is None:
        vocab = engine.target.model.config.vocab_size
        return [(7 * i + 3) % vocab for i in range(48)]
    from specdec.target.tokenizer import is_chat_model

    ids = engine.encode(WARMUP_TEXT, chat=is_chat_model(tokenizer))
    return ids[: max(1, engine.max_model_len - WARMUP_TOKENS - 1)]


def _forget_timings(engine) -> None:
    """Drop what the adaptive policy and the chunk sizer measured (they re-learn from warm steps)."""
    if engine.policy is not None:
        engine.policy.forget()
    if engine.chunk_sizer is not None:
        engine.chunk_sizer.forget()
