"""A request's life inside the engine: its tokens, its two block tables, its counters."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from specdec.step.adaptive import AcceptanceEstimate
from specdec.cache import BlockTable
from specdec.sampling_params import SamplingParams
from specdec.verify import AcceptanceStats


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class TokenOrigin(str, enum.Enum):
    """Where an emitted token came from."""

    ACCEPTED = "accepted"  # a draft token the target agreed with
    RECOVERED = "recovered"  # the target's correction at the first rejected position
    BONUS = "bonus"  # the target's extra token after all drafts were accepted
    TARGET = "target"  # plain decoding (no drafts this step)


@dataclass
class TokenLogprobs:
    """One emitted token's log-probability and the most likely alternatives at its position
    (`SamplingParams.logprobs` of them, most likely first; the token itself may be among them)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), descending
    rank: int | None = None  # the token's rank in its distribution (1: the most likely), where computed


@dataclass
class Sequence:
    """One request. `token_ids` holds prompt + generated tokens; the tables hold their KV."""

    request_id: str
    token_ids: list[int]
    params: SamplingParams
    num_speculative_tokens: int
    arrival: int
    prompt_len: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    target_table: BlockTable | None = None
    draft_table: BlockTable | None = None
    generator: torch.Generator | None = None
    stats: AcceptanceStats = field(default_factory=AcceptanceStats)
    acceptance: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)  # drives adaptive k
    finish_reason: str | None = None
    detokenizer: Any = None
    cache_salt: str | None = None  # requests with different salts share no cached prefix
    # Prompt tokens found in each pool's prefix cache at first admission (None until admitted).
    num_cached_tokens: int | None = None
    num_draft_cached_tokens: int | None = None
    # Set by the scheduler for the current step: target tokens fed (the chunk while prefilling,
    # else 1) and tokens fed to the draft's cache alongside a prefill chunk.
    num_new_tokens: int = 0
    num_draft_fill: int = 0
    # n > 1: a sibling waits for this request's prompt to be prefilled (and its blocks cached)
    # before it is admitted, so that it starts on the cached prompt instead of computing it again.
    prefill_leader: "Sequence | None" = None
    logprobs: list[TokenLogprobs] | None = None  # emitted tokens' logprobs, when params.logprobs is set
    # params.prompt_logprobs: prompt tokens 1.. as the prefill computes them (token 0 has none)
    prompt_logprobs: list[TokenLogprobs] | None = None
    # Structured output: the grammar's state over the emitted tokens (`verify.controls.TokenConstraint`)
    constraint: Any = None
    # Prefill/decode disaggregation (`specdec.handoff`): this request ends, once its first token is
    # out and the draft's cache holds the whole prompt, by handing its KV over; `handing_off`
    # once the token is out and the draft's fill is all that is left. A resumed request holds the
    # prompt's partial last blocks it was handed (pool -> (block id, tokens)) until admission.
    handoff: bool = False
    handing_off: bool = False
    imported_partial: dict[str, tuple[int, int]] | None = None

    def __post_init__(self) -> None:
        self.prompt_len = self.prompt_len or len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def generated_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def num_pending(self) -> int:
        """Tokens the target's cache lacks: 1 when decoding, more while (re)prefilling."""
        assert self.target_table is not None
        return self.num_tokens - self.target_table.num_computed

    @property
    def fills_only(self) -> bool:
        """This step feeds a prefill chunk that stops short of the prompt's end: no token comes
        out of it."""
        return self.num_new_tokens < self.num_pending


@dataclass
class StepDelta:
    """What one engine step added to one request (the streaming unit)."""

    request_id: str
    token_ids: list[int]
    origins: list[TokenOrigin]
    text: str
    num_drafted: int
    num_accepted: int
    finished: bool
    finish_reason: str | None = None
    pieces: list[str] = field(default_factory=list)  # text of each token (aligned with token_ids)
    num_cached_tokens: int = 0  # prompt tokens served from the target's prefix cache
    stats: AcceptanceStats | None = None  # the request's acceptance counts, on its finishing delta
    logprobs: list[TokenLogprobs] | None = None  # aligned with token_ids, when params.logprobs is set
    handoff: Any = None  # a `handoff.HandoffTicket` on a handed-off request's last delta
    # params.prompt_logprobs, on the request's first delta: [None] + prompt tokens 1..'s
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    stop_string: str | None = None  # on the finishing delta of a request a stop string ended (Anthropic's stop_sequence)
    # a token tree's depth (its longest path of drafts; num_drafted counts its nodes); None: a chain
    draft_depth: int | None = None


@dataclass
class RequestOutput:
    """A finished request: text, token ids and acceptance statistics."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    stats: AcceptanceStats
    num_cached_tokens: int = 0  # prompt tokens served from the target's prefix cache
    logprobs: list[TokenLogprobs] | None = None  # aligned with token_ids, when params.logprobs is set
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # params.prompt_logprobs: [None] + tokens 1..
