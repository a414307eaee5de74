"""The engine: schedule -> draft -> ONE target verify pass -> accept -> commit and roll back."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from specdec.adaptive import ChunkSizer, SpeculationPolicy
from specdec.config import EngineConfig
from specdec.draft import DraftModelProposer, HybridProposer, NgramProposer, Proposer, SamplingTensors
from specdec.sampling_params import SamplingParams
from specdec.scheduler import ChunkBudget, Scheduler
from specdec.sequence import RequestOutput, Sequence, StepDelta, TokenOrigin
from specdec.stopping import StopChecker
from specdec.target.runner import ModelRunner, Window
from specdec.verify import AcceptanceStats, rejection_sample, warp_probs


MAX_PRICED_LAG = 8
MAX_CATCH_UP = 32  # draft-cache tokens fed in one catch-up beside other streams (Engine._catch_up_first)
MAX_LONE_CATCH_UP = 256  # ... for a sequence alone in its step (a chat prompt's draft prefill at once)
LOOKUP_MIN_TOKENS = 4  # hybrid: prompt lookup may propose this many even where the policy drafts fewer


class StepError(RuntimeError):
    """A step raised. The requests it ran (`request_ids`) are released (blocks freed in both
    pools, forgotten by the engine, finish reason "error"); every other request is untouched and
    the engine keeps serving. The original exception is the `__cause__`."""

    def __init__(self, request_ids: list[str], cause: BaseException) -> None:
        super().__init__(f"a step failed ({type(cause).__name__}: {cause}); released {len(request_ids)} request(s)")
        self.request_ids = request_ids


class Engine:
    """A speculative-decoding engine over a target and (optionally) a draft model.

    Build it from a config (`Engine(EngineConfig(...))` loads the models) or from models already in
    memory (`Engine.from_models`). Then `generate(prompts, params)` or `stream(prompts, params)`;
    servers drive `add_request` / `step` / `abort` themselves.
    """

    def __init__(self, config: EngineConfig | None = None) -> None:
        from specdec.engine_parts import load_engine_parts

        config = config or EngineConfig()
        target, draft, tokenizer = load_engine_parts(config)
        self._setup(config, target, draft, tokenizer)

    @classmethod
    def from_models(
        cls, config: EngineConfig, target: torch.nn.Module, draft: torch.nn.Module | None = None,
        tokenizer: Any = None,
    ) -> "Engine":
        """An engine over models already in memory; they must sit on `config.device` (any one
        device with "auto"): ValueError otherwise."""
        _check_device(config, {"target": target, "draft": draft})
        engine = cls.__new__(cls)
        engine._setup(config, target, draft, tokenizer)
        return engine

    def _setup(self, config: EngineConfig, target, draft, tokenizer) -> None:
        from specdec.engine_parts import build_runners

        self.config = config
        self.tokenizer = tokenizer
        self.target, draft_runner = build_runners(config, target, draft)
        self.proposer: Proposer | None = None
        if config.speculative and config.uses_draft_model:
            model = DraftModelProposer(
                draft_runner, timed=config.adaptive_k,
                stop_below=config.draft_stop_confidence if config.adaptive_k else 0.0,
            )
            self.proposer = model if config.proposer == "draft" else HybridProposer(model)
        elif config.speculative and config.proposer == "ngram":
            self.proposer = NgramProposer(config.ngram_min, config.ngram_max, self.target.device)
        self.max_model_len = self._max_model_len(draft_runner)
        draft_pool = self.proposer.pool if self.proposer is not None else None
        self.chunk_sizer = (
            ChunkSizer(config.prefill_gap_ratio, most=config.max_prefill_chunk)
            if config.max_num_batched_tokens is None else None
        )
        self.scheduler = Scheduler(
            self.target.pool, self.target.block_size,
            draft_pool, draft_runner.block_size if draft_runner is not None else 1,
            config.max_num_seqs, self.max_model_len,
            self.proposer.draft_slots_needed if self.proposer is not None else (lambda n, k: 0),
            ChunkBudget(config.max_num_batched_tokens, config.max_prefill_chunk, self.chunk_sizer),
        )
        for pool in self._pools().values():
            pool.enable_caching = config.enable_prefix_caching
        self._verify_rows = 0
        self.num_scheduled = 0  # sequences the latest step ran (a step may emit nothing: prefill chunks)
        self.eos_token_ids = set(target.config.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(tokenizer.eos_token_id)
        self.stats = AcceptanceStats()
        self.policy = SpeculationPolicy() if config.adaptive_k and self.proposer is not None else None
        self._sequences: dict[str, Sequence] = {}
        self._counter = itertools.count()
        self.device = self.target.device

    def _max_model_len(self, draft_runner: ModelRunner | None) -> int:
        runners = [self.target] + ([draft_runner] if self.proposer and draft_runner else [])
        limits = [r.max_positions for r in runners]
        limits += [r.pool.num_blocks * r.block_size for r in runners]
        if self.config.max_model_len:
            limits.append(self.config.max_model_len)
        return min(limits)

    # ---- requests ------------------------------------------------------------------------------

    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        """Prompt text -> token ids, through the chat template when `chat`."""
        if self.tokenizer is None:
            raise ValueError("this engine has no tokenizer; pass token ids")
        from specdec.target.tokenizer import apply_chat_template

        if chat:
            return apply_chat_template(self.tokenizer, prompt)
        return self.tokenizer.encode(prompt, add_special_tokens=False)

    def add_request(
        self, prompt: str | list[int], params: SamplingParams | None = None,
        request_id: str | None = None, num_speculative_tokens: int | None = None,
        cache_salt: str | None = None,
    ) -> str:
        """Queue a request; returns its id. Raises ValueError for prompts that can never run.

        Requests share cached prompt prefixes unless their `cache_salt`s differ (vLLM's
        extension: a tenant that must not share KV with others passes its own salt)."""
        params = params or SamplingParams()
        token_ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not token_ids:
            raise ValueError("the prompt is empty")
        vocab = self.target.model.config.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab:
            raise ValueError(f"prompt token ids must lie in [0, {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens; this engine fits at most "
                f"{self.max_model_len - 1} (context length / KV cache size)"
            )
        k = self.config.num_speculative_tokens if num_speculative_tokens is None else num_speculative_tokens
        if not 0 <= k <= 16:
            raise ValueError(f"num_speculative_tokens must be in 0..16, got {k}")
        request_id = request_id or f"req-{next(self._counter)}"
        if request_id in self._sequences:
            raise ValueError(f"request id {request_id!r} is already in use")
        seq = Sequence(request_id, token_ids, params, k if self.proposer else 0, next(self._counter))
        seq.cache_salt = cache_salt
        if params.seed is not None:
            seq.generator = torch.Generator(self.device).manual_seed(params.seed)
        seq.detokenizer = StopChecker(self.tokenizer, token_ids, params)
        self._sequences[request_id] = seq
        self.scheduler.add(seq)
        return request_id

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its blocks in both pools; False if it is unknown or done."""
        seq = self._sequences.pop(request_id, None)
        if seq is None or seq.finished:
            return False
        seq.finish_reason = "abort"
        self.scheduler.finish(seq)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # ---- the step ------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[StepDelta]:
        """One speculative step for every scheduled sequence; returns what each one emitted.

        Sequences whose prefill chunk stops short of the prompt's end (`fills_only`) ride in the
        same target forward as the others' verify windows and emit nothing this step.
        """
        start = time.perf_counter()
        scheduled: list[Sequence] | None = None
        try:
            scheduled = self.scheduler.schedule()
            self.num_scheduled = len(scheduled)
            if not scheduled:
                return []
            deltas = self._step(scheduled)
        except BaseException as exc:
            failed = self._release_failed(scheduled)
            if isinstance(exc, Exception):
                raise StepError(failed, exc) from exc
            raise  # KeyboardInterrupt and friends stay what they are; their requests are released too
        if self.chunk_sizer is not None:
            self._sync()
            self.chunk_sizer.observe(time.perf_counter() - start, self.scheduler.num_prefill_tokens, self._verify_rows)
        return deltas

    def _release_failed(self, scheduled: list[Sequence] | None) -> list[str]:
        """Release the sequences a failed step ran (all the scheduler holds if scheduling itself
        failed): their tables are in an unknown state, so they cannot go on. Returns their ids."""
        if scheduled is None:
            scheduled = self.scheduler.running + list(self.scheduler.waiting)
        for seq in scheduled:
            self._sequences.pop(seq.request_id, None)
            if not seq.finished:
                seq.finish_reason = "error"
                self.scheduler.finish(seq)
        return [seq.request_id for seq in scheduled]

    def _step(self, scheduled: list[Sequence]) -> list[StepDelta]:
        fills = [s for s in scheduled if s.fills_only]
        seqs = [s for s in scheduled if not s.fills_only]
        fill_windows = [self._fill_window(s) for s in fills]
        self._verify_rows = 0  # rows of decoding sequences' windows in this step's target forward
        if not seqs:
            if self.proposer is not None:
                self._fill_draft(scheduled, [])  # nothing decodes: the draft takes every stretch
                self.proposer.flush()
            self.target.forward(fill_windows)
            self._cache_full_blocks(fills)
            return []
        sampling = self._sampling_tensors(seqs)
        fill_rows = sum(s.num_new_tokens for s in fills)
        ks, caps = self._choose_k(seqs)
        if self.proposer is not None:
            self._fill_draft(scheduled, ks)
        num_draft, draft_ids, draft_probs, model_rows = self._propose(seqs, ks, caps, sampling)
        if self.proposer is not None:
            self.proposer.flush()  # fills that no draft forward took along
        windows = [self._verify_window(s, draft_ids[b, : num_draft[b]]) for b, s in enumerate(seqs)]
        self._verify_rows = sum(len(w.token_ids) for w, s in zip(windows, seqs) if s.num_pending <= 1)
        start = time.perf_counter()
        logits = self.target.forward(windows + fill_windows)  # [sum(n_b + 1), V]
        if self.policy is not None:
            self._sync()
            rows = sum(len(w.token_ids) for w in windows) + fill_rows
            self.policy.verify_cost.observe(rows, time.perf_counter() - start)
        self._cache_full_blocks(fills)
        counts = [n + 1 for n in num_draft]
        rows = sampling.repeat(counts)
        target_probs = _pad_rows(warp_probs(logits, rows.temperature, rows.top_k, rows.top_p), counts)
        out = rejection_sample(
            draft_ids, torch.tensor(num_draft), draft_probs, target_probs,
            sampling.generators, greedy=sampling.all_greedy,
        )
        token_rows, accepted = out.token_ids.tolist(), out.num_accepted.tolist()  # the one host sync
        for b, s in enumerate(seqs):
            if model_rows[b]:  # the adaptive estimate is of the draft model's acceptance
                s.acceptance.update(num_draft[b], accepted[b])
        return [
            self._commit(s, token_rows[b], accepted[b], num_draft[b]) for b, s in enumerate(seqs)
        ]

    def _fill_draft(self, scheduled: list[Sequence], ks: list[int]) -> None:
        """Queue the draft cache's share of this step: catch-ups (see `_catch_up_first`) always;
        the prompt stretches of prefilling sequences where a draft forward runs anyway or no
        stream waits on the step. A forward of its own would add its fixed cost (most of a one-row
        draft forward) to a step that streams are waiting on; a draft left behind catches up in
        chunks once it drafts."""
        decoding = [s for s in scheduled if s.num_pending <= 1]
        if decoding and not any(ks) and not any(s.num_draft_fill for s in decoding):
            for seq in scheduled:
                seq.num_draft_fill = 0
        self.proposer.fill(scheduled)

    @staticmethod
    def _fill_window(seq: Sequence) -> Window:
        """The next prefill chunk of a sequence whose prompt it does not finish (no logits)."""
        start = seq.target_table.num_computed
        return Window(seq.target_table, seq.token_ids[start : start + seq.num_new_tokens], 0)

    @staticmethod
    def _cache_full_blocks(seqs: list[Sequence]) -> None:
        """Offer both pools' prefix caches the blocks these sequences have written in full."""
        for seq in seqs:
            for table in (seq.target_table, seq.draft_table):
                if table is not None:
                    table.cache_full_blocks(seq.token_ids)

    def _choose_k(self, seqs: list[Sequence]) -> tuple[list[int], list[int]]:
        """This step's k per sequence (the policy's pick) and its cap (what slots allow).

        Prefill chunks riding in the step are not priced here: with per-row costs they add the
        same to every k, and counting them in a tokens-per-second objective would make drafting
        look cheaper exactly when a step is already long (measured: the stream drafted k = 5
        beside each chunk and its steps grew 6x). The cost tables still observe those steps."""
        caps = [self.scheduler.num_draft(s) for s in seqs]
        if self.proposer is not None and self.proposer.pool is not None:  # a draft model
            # A sequence's prefill step does not draft: its first token comes after the target's
            # prefill alone (TTFT), and the draft's cache is fed the same stretch beside it.
            caps = [0 if s.num_pending > 1 else k for s, k in zip(seqs, caps)]
        if self.policy is None:
            return [self._catch_up_first(s, k, len(seqs) == 1) for s, k in zip(seqs, caps)], caps
        # A draft cache that lags by the whole prompt must catch up once, whatever k. For a lone
        # sequence pricing that would keep speculation off forever, so its lag is priced up to a
        # few rows; a batch pays the whole catch-up it would cause (at 4 streams, prefilling the
        # draft and catching up after each pause cost more than drafting then won).
        lags = [s.num_tokens - s.draft_table.num_computed if s.draft_table else 1 for s in seqs]
        if len(seqs) == 1:
            lags = [min(MAX_PRICED_LAG, lag) for lag in lags]
        ks = self.policy.choose_k([s.acceptance.rate for s in seqs], caps, lags)
        ks = [self._catch_up_first(s, k, len(seqs) == 1) for s, k in zip(seqs, ks)]
        if self.config.uses_draft_model and self.config.draft_stop_confidence > 0:
            # The policy decides whether drafting pays; the draft's confidence decides how far
            # (early stop), which beats the policy's length from an average acceptance: on 10
            # HumanEval prompts 31.7 vs 29.8 modeled tok/s (cap 8, stop 0.5).
            ks = [cap if k else 0 for k, cap in zip(ks, caps)]
        return ks, caps

    @staticmethod
    def _catch_up_first(seq: Sequence, k: int, alone: bool) -> int:
        """A sequence about to draft whose draft cache fell behind by more than MAX_CATCH_UP
        tokens (MAX_LONE_CATCH_UP when it is alone in the step) is fed a chunk of them this step
        instead (`num_draft_fill`), and drafts once caught up: one catch-up forward over hundreds
        of tokens would stall every stream of the step, a lone one after its first token."""
        lag = seq.num_tokens - 1 - seq.draft_table.num_computed if seq.draft_table is not None else 0
        limit = MAX_LONE_CATCH_UP if alone else MAX_CATCH_UP
        if k == 0 or lag <= limit:
            return k
        seq.num_draft_fill = limit
        return 0

    def _propose(
        self, seqs: list[Sequence], ks: list[int], caps: list[int], sampling: SamplingTensors
    ) -> tuple[list[int], torch.Tensor, torch.Tensor | None, list[bool]]:
        """Drafts per sequence: (counts, ids [B, k], q [B, k, V] or None, rows the model drafted)."""
        lookup = isinstance(self.proposer, HybridProposer)
        if self.proposer is None or not (any(ks) or lookup and len(seqs) == 1 and any(caps)):
            empty = torch.empty(len(seqs), 0, dtype=torch.long, device=self.device)
            return [0] * len(seqs), empty, None, [True] * len(seqs)
        start = time.perf_counter()
        if lookup:  # prompt lookup costs no forward: it may propose where the model would not,
            # unless the policy switched drafting off for a whole batch (extra verify rows are
            # then not free: that is why it did)
            under_load = len(seqs) > 1 and not any(ks)
            limits = ks if under_load else [max(k, min(cap, LOOKUP_MIN_TOKENS)) for k, cap in zip(ks, caps)]
            draft = self.proposer.propose(seqs, ks, sampling, lookup_limits=limits)
        else:
            draft = self.proposer.propose(seqs, ks, sampling)
        if self.policy is not None:
            self._observe_draft(ks, time.perf_counter() - start)
        k = max(draft.num_draft)
        probs = draft.probs[:, :k] if draft.probs is not None else None  # [B, k, V]
        model_rows = [not x for x in draft.looked_up] if draft.looked_up else [True] * len(seqs)
        return draft.num_draft, draft.token_ids[:, :k], probs, model_rows

    def _observe_draft(self, ks: list[int], seconds: float) -> None:
        """Feed the policy the draft model's per-forward timings (a model-free proposer: the
        whole call, per drafted position)."""
        timings = getattr(self.proposer, "forward_seconds", None)
        if timings is None:
            self.policy.draft_cost.observe(sum(1 for k in ks if k), seconds / max(ks))
            return
        for rows, secs in timings:
            self.policy.draft_cost.observe(rows, secs)
        timings.clear()

    def _sync(self) -> None:
        """Timings need the device's queue drained (CPU work is already done when it returns)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _verify_window(self, seq: Sequence, drafts: torch.Tensor) -> Window:
        """[tokens the target cache lacks (the last one, or the whole prompt)] + [d_1..d_n]."""
        table = seq.target_table
        pending = seq.token_ids[table.num_computed :]
        if drafts.numel() == 0:
            return Window(table, pending, 1)
        head = torch.tensor(pending, dtype=torch.long, device=self.device)
        return Window(table, torch.cat([head, drafts]), drafts.numel() + 1)

    def _sampling_tensors(self, seqs: list[Sequence]) -> SamplingTensors:
        # Kept on the host: warp_probs then skips work no row needs, without a device sync.
        p = [s.params for s in seqs]
        dev = "cpu"
        return SamplingTensors(
            torch.tensor([x.temperature for x in p], dtype=torch.float32, device=dev),
            torch.tensor([x.top_k for x in p], dtype=torch.long, device=dev),
            torch.tensor([x.top_p for x in p], dtype=torch.float32, device=dev),
            [s.generator for s in seqs],
        )

    def _commit(self, seq: Sequence, row: list[int], num_accepted: int, num_draft: int) -> StepDelta:
        """Append accepted (+1) tokens up to a stop, roll both caches back, finish if done."""
        new = row[: num_accepted + 1]
        last = TokenOrigin.TARGET if num_draft == 0 else (
            TokenOrigin.BONUS if num_accepted == num_draft else TokenOrigin.RECOVERED
        )
        origins = [TokenOrigin.ACCEPTED] * num_accepted + [last]
        if num_draft > 0:
            seq.stats.update(num_draft, num_accepted)
            self.stats.update(num_draft, num_accepted)
        emitted, pieces, reason = self._append_tokens(seq, new)
        text = "".join(pieces)
        for table in (seq.target_table, seq.draft_table):
            if table is not None:
                table.truncate(seq.num_tokens - 1)
                table.cache_full_blocks(seq.token_ids)
        if reason is not None:
            seq.finish_reason = reason
            self.scheduler.finish(seq)
        return StepDelta(
            seq.request_id, emitted, origins[: len(emitted)], text, num_draft, num_accepted,
            reason is not None, reason, pieces, seq.num_cached_tokens or 0,
        )

    def _append_tokens(self, seq: Sequence, new: list[int]) -> tuple[list[int], list[str], str | None]:
        """Append tokens until a stop; returns (emitted ids, their text pieces, finish reason).

        EOS ends the request without being emitted; a stop string ends it at the token that
        completed it, with the stop string cut from the text; tokens past a stop are dropped.
        """
        emitted: list[int] = []
        pieces: list[str] = []
        reason = None
        for token in new:
            seq.token_ids.append(token)
            if not seq.params.ignore_eos and token in self.eos_token_ids:
                reason = "stop"
                break
            emitted.append(token)
            piece, hit = seq.detokenizer.push([token])
            pieces.append(piece)
            if hit or token in seq.params.stop_token_ids:
                return emitted, pieces, "stop"
            if seq.num_generated >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len:
                reason = "length"
                break
        if reason is not None:
            tail, _ = seq.detokenizer.push([], final=True)
            if pieces:
                pieces[-1] += tail
            elif tail:
                pieces.append(tail)
        return emitted, pieces, reason

    # ---- convenience ---------------------------------------------------------------------------

    def stream(
        self, prompts: Iterable[str | list[int]], params: SamplingParams | None = None
    ) -> Iterator[StepDelta]:
        """Add every prompt, then yield each step's deltas until all are done."""
        yield from self._run(prompts, params, [])

    def generate(
        self, prompts: Iterable[str | list[int]], params: SamplingParams | None = None
    ) -> list[RequestOutput]:
        """Run prompts to completion (batched); outputs in prompt order."""
        seqs: list[Sequence] = []
        for _ in self._run(prompts, params, seqs):
            pass
        return [self.output(s) for s in seqs]

    def _run(
        self, prompts: Iterable[str | list[int]], params: SamplingParams | None, seqs: list[Sequence]
    ) -> Iterator[StepDelta]:
        """Add the prompts (appending their sequences to `seqs`) and step until all are done.
        However it ends (done, a bad prompt, a failed step, a consumer that stops reading), none
        of these requests stays registered or holds a block."""
        try:
            for prompt in prompts:
                seqs.append(self._sequences[self.add_request(prompt, params)])
            while self.has_unfinished():
                yield from self.step()
        finally:
            for seq in seqs:
                self.abort(seq.request_id)

    def output(self, seq: Sequence) -> RequestOutput:
        return RequestOutput(
            seq.request_id, seq.token_ids[: seq.prompt_len], seq.generated_ids,
            seq.detokenizer.text, seq.finish_reason, seq.stats, seq.num_cached_tokens or 0,
        )

    def release(self, request_id: str) -> None:
        """Forget a finished request (servers call this after the last delta)."""
        seq = self._sequences.pop(request_id, None)
        if seq is not None and not seq.finished:
            self.scheduler.finish(seq)

    def _pools(self) -> dict[str, Any]:
        """The block pools by name: the target's, and the draft model's when there is one."""
        pools = {"target": self.target.pool}
        if self.proposer is not None and self.proposer.pool is not None:
            pools["draft"] = self.proposer.pool
        return pools

    def kv_usage(self) -> dict[str, dict[str, int]]:
        return {
            name: {"total": p.num_blocks, "free": p.num_free, "used": p.num_used, "cached": p.num_cached}
            for name, p in self._pools().items()
        }

    def prefix_cache_stats(self) -> dict[str, dict[str, int]]:
        """Per pool: prompt tokens looked up in the prefix cache and tokens found, since start."""
        return {
            name: {"queried_tokens": p.stats.queried_tokens, "hit_tokens": p.stats.hit_tokens}
            for name, p in self._pools().items()
        }

    def reset_prefix_cache(self) -> int:
        """Drop every cached block no request holds, in both pools; returns how many."""
        return sum(p.reset_prefix_cache() for p in self._pools().values())


def _check_device(config: EngineConfig, models: dict[str, torch.nn.Module | None]) -> None:
    """Every model on one device, and that device `config.device` unless it is "auto"."""
    devices = {name: next(m.parameters()).device for name, m in models.items() if m is not None}
    wanted = None if config.device == "auto" else torch.device(config.device)
    for name, device in devices.items():
        if wanted is not None and (device.type != wanted.type or wanted.index not in (None, device.index)):
            raise ValueError(
                f"config.device is {config.device!r} but the {name} model is on {device}; move the "
                f"models first (model.to({config.device!r})) or pass device='auto'"
            )
    if len(set(devices.values())) > 1:
        raise ValueError(f"the models sit on different devices: {devices}")


def _pad_rows(flat: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """`flat [sum(counts), V]` -> `[B, max(counts), V]`, zero rows where a sequence has fewer."""
    b, width = len(counts), max(counts)
    if all(c == width for c in counts):
        return flat.view(b, width, -1)
    out = flat.new_zeros(b, width, flat.shape[-1])
    bi = [i for i, c in enumerate(counts) for _ in range(c)]
    ji = [j for c in counts for j in range(c)]
    out[bi, ji] = flat
    return out
