"""The engine: schedule -> draft -> ONE target verify pass -> accept -> commit and roll back."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from specdec.step.adaptive import ChunkSizer, SpeculationPolicy
from specdec.config import EngineConfig
from specdec.draft import (
    DraftModelProposer, DraftOutput, HybridProposer, NgramProposer, Proposer, SamplingTensors, StepPlan,
    StepTimings,
)
from specdec.draft.recycling import RecyclingProposer
from specdec.expert_stats import ExpertStats
from specdec import handoff
from specdec.handoff import HandoffTicket, KVPayload, LeaseBook, import_payload
from specdec.step.planner import StepPlanner
from specdec.sampling_params import SamplingParams
from specdec.step.scheduler import ChunkBudget, Scheduler
from specdec.sequence import RequestOutput, Sequence, StepDelta, TokenLogprobs, TokenOrigin
from specdec.target.tokenizer import end_of_answer_ids
from specdec.step.stopping import StopChecker, append_until_stop
from specdec.structured import GrammarCompiler
from specdec.target.runner import ModelRunner
from specdec.step.verifier import Verifier
from specdec.verify import AcceptanceStats
from specdec.verify.controls import LogitControls


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
        from specdec.engine_parts import load_engine_parts, proposer_for_target, resolve_config

        # engine.config names what it runs: a target alone, of a family the default draft cannot
        # serve, decodes with prompt lookup (`proposer_note` says why)
        config, note = proposer_for_target(resolve_config(config or EngineConfig()))
        target, draft, tokenizer = load_engine_parts(config)
        self._setup(config, target, draft, tokenizer)
        self.proposer_note = note

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
        self.proposer_note: str | None = None  # why the proposer is not the one asked for
        self.target, draft_runner = build_runners(config, target, draft)
        if config.trees and config.speculative and any(
                getattr(r, "states", None) is not None for r in (self.target, draft_runner) if r is not None):
            raise ValueError("token trees (proposer 'recycling', spec_tree 'on') over a hybrid (linear-attention) "
                             "model are not supported: a recurrent state follows one path; use chains")
        self.timings = StepTimings()  # this step's timed forwards, for the policy
        self.proposer = self._build_proposer(draft_runner)
        self.runners = [self.target] + ([draft_runner] if self.proposer is not None and draft_runner else [])
        if config.kv_resident:  # (a parallel target's cache lives on its ranks)
            for runner in self.kv_runners().values():
                if getattr(runner, "group", None) is None:
                    runner.kv_cache.make_resident()
        self.verifier = Verifier(self.target, self.timings)
        self.policy = SpeculationPolicy(self.target.routing) if config.adaptive_k and self.proposer is not None else None
        self.timings.enabled = self.policy is not None
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
            tree_rows=config.tree_rows if config.trees and self.proposer is not None else 0,
        )
        self.planner = StepPlanner(
            self.scheduler, self.policy, drafts_with_model=draft_pool is not None,
            looks_up=config.proposer == "hybrid" and self.proposer is not None,
            early_stop=config.uses_draft_model and config.draft_stop_confidence > 0, steady=config.steady_steps,
            priced_trees=config.draft_trees and config.spec_tree == "auto",
        )
        for pool in self._pools().values():  # a hybrid's recurrent states have no snapshots at block ends
            pool.enable_caching = config.enable_prefix_caching and pool.states is None
        self.num_scheduled = 0  # sequences the latest step ran (a step may emit nothing: prefill chunks)
        self.eos_token_ids = set(target.config.eos_token_ids)
        if tokenizer is not None:
            if tokenizer.eos_token_id is not None:
                self.eos_token_ids.add(tokenizer.eos_token_id)
            self.eos_token_ids.update(end_of_answer_ids(tokenizer))  # gpt-oss: <|return|>, <|call|>
        self.stats = AcceptanceStats()
        self._grammars: GrammarCompiler | None = None  # structured output; built at its first request
        self._sequences: dict[str, Sequence] = {}
        self._counter = itertools.count()
        self.device = self.target.device
        self.leases = LeaseBook()  # KV held for decode engines (prefill/decode disaggregation)
        self.kv_imported_blocks = 0  # blocks handed over by prefill engines, written into the pools
        self._compat: dict[str, str] | None = None

    def memory_line(self) -> str:
        """What the models take: "weights 1.49 GB · KV pools up to 2.15 GB" (both models)."""
        weights, kv = (sum(part) for part in zip(*(r.memory_bytes() for r in self.runners)))
        return f"weights {_size(weights)} · KV pools up to {_size(kv)}"

    def _build_proposer(self, draft_runner: ModelRunner | None) -> Proposer | None:
        config = self.config
        if config.speculative and config.uses_draft_model:
            stop_below = config.draft_stop_confidence if config.adaptive_k and not config.steady_steps else 0.0
            model = DraftModelProposer(draft_runner, self.timings, stop_below, tree=config.draft_trees)
            return model if config.proposer == "draft" else HybridProposer(model)
        if config.speculative and config.proposer == "ngram":
            return NgramProposer(config.ngram_min, config.ngram_max, self.target.device, self.timings)
        if config.speculative and config.proposer == "recycling":
            return RecyclingProposer(self.target.output_vocab, device=self.target.device, timings=self.timings)
        return None

    def _max_model_len(self, draft_runner: ModelRunner | None) -> int:
        runners = [self.target] + ([draft_runner] if self.proposer and draft_runner else [])
        limits = [r.max_positions for r in runners]
        limits += [r.pool.num_blocks * r.block_size for r in runners]
        if self.config.max_model_len:
            limits.append(self.config.max_model_len)
        return min(limits)

    # ---- requests ------------------------------------------------------------------------------

    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        """Prompt text -> token ids, through the chat template when `chat`, else led by the model's BOS
        where its tokenizer adds one (`encode_prompt`)."""
        if self.tokenizer is None:
            raise ValueError("this engine has no tokenizer; pass token ids")
        from specdec.target.tokenizer import apply_chat_template, encode_prompt

        if chat:
            return apply_chat_template(self.tokenizer, prompt)
        return encode_prompt(self.tokenizer, prompt)

    def add_request(
        self, prompt: str | list[int], params: SamplingParams | None = None,
        request_id: str | None = None, num_speculative_tokens: int | None = None,
        cache_salt: str | None = None, share_prompt_with: str | None = None,
        handoff: bool = False, generated: list[int] | None = None, payload: KVPayload | None = None,
    ) -> str:
        """Queue a request; returns its id. Raises ValueError for prompts that can never run.

        Requests share cached prompt prefixes unless their `cache_salt`s differ (vLLM's
        extension: a tenant that must not share KV with others passes its own salt).
        `share_prompt_with` (n > 1: parallel samples of one prompt) names a queued or running
        request; this one is admitted only once that one's prompt is prefilled, so it starts on
        the cached prompt blocks instead of computing them again (with prefix caching off, it
        just waits).

        Prefill/decode disaggregation (`specdec.handoff`): `handoff` makes this a prefill engine's
        request, which ends after its first token(s) with finish reason "handoff" and a ticket
        for its KV; `generated` resumes a request another engine started: these tokens were
        already emitted (they count toward max_tokens, stop strings, penalties and the grammar),
        on the blocks of `payload` (what `export_kv` read there): its full blocks are cached, its
        partial last blocks are held for this request and attached at admission."""
        params = params or SamplingParams()
        token_ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        generated = list(generated or [])
        if not token_ids:
            raise ValueError("the prompt is empty")
        vocab = self.target.model.config.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab:
            raise ValueError(f"prompt token ids must lie in [0, {vocab})")
        if generated and (min(generated) < 0 or max(generated) >= vocab):
            raise ValueError(f"generated token ids must lie in [0, {vocab})")
        if payload is not None and not generated:
            raise ValueError("a KV payload resumes a request: pass the tokens it already generated (generated=...)")
        if len(generated) >= params.max_tokens:
            raise ValueError(f"{len(generated)} tokens already generated leave none of max_tokens={params.max_tokens}")
        for name, ids in (("logit_bias", params.logit_bias), ("stop_token_ids", params.stop_token_ids)):
            if any(t >= vocab for t in ids):
                raise ValueError(f"{name} token ids must lie in [0, {vocab})")
        if len(token_ids) + len(generated) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(token_ids) + len(generated)} tokens; this engine fits at most "
                f"{self.max_model_len - 1} (context length / KV cache size)"
            )
        k = self.config.num_speculative_tokens if num_speculative_tokens is None else num_speculative_tokens
        if not 0 <= k <= 16:
            raise ValueError(f"num_speculative_tokens must be in 0..16, got {k}")
        request_id = request_id or f"req-{next(self._counter)}"
        if request_id in self._sequences:
            raise ValueError(f"request id {request_id!r} is already in use")
        constraint = self.grammars.constraint(params.structured) if params.structured is not None else None
        seq = Sequence(request_id, token_ids + generated, params, k if self.proposer else 0, next(self._counter),
                       prompt_len=len(token_ids))
        seq.constraint = constraint
        seq.cache_salt = cache_salt
        seq.handoff = handoff
        if share_prompt_with is not None:
            leader = self._sequences.get(share_prompt_with)
            if leader is None:
                raise ValueError(f"share_prompt_with names no queued or running request: {share_prompt_with!r}")
            seq.prefill_leader = leader
        if params.seed is not None:
            seq.generator = torch.Generator(self.device).manual_seed(params.seed)
        seq.detokenizer = StopChecker(self.tokenizer, token_ids, params)
        if generated:  # the other engine streamed their text: get to the state it left
            seq.detokenizer.push(generated)
            if constraint is not None:
                constraint.commit(generated)
        if payload is not None:  # last: nothing above may fail once blocks are held for it
            written, seq.imported_partial = import_payload(self._movable_runners(), payload)  # (`handoff` is the flag here)
            self.kv_imported_blocks += written
        self._sequences[request_id] = seq
        self.scheduler.add(seq)
        return request_id

    @property
    def grammars(self) -> GrammarCompiler:
        """Structured output's compiler for this engine's tokenizer (its token table compiled once,
        each grammar once)."""
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer, self.target.model.config.vocab_size, self.eos_token_ids)
        return self._grammars

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its blocks in both pools (a handed-off request: its lease's);
        False if it is unknown or done."""
        seq = self._sequences.pop(request_id, None)
        if seq is None or seq.finished:  # handed off already: nobody will pull its KV now
            return any([self.release_lease(lease_id) for lease_id in self.leases.of_request(request_id)])
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
        same target forward as the others' verify windows and emit nothing this step. If the step
        raises, the sequences it ran are released and a `StepError` names them.
        """
        start = time.perf_counter()
        self.timings.clear()
        scheduled: list[Sequence] | None = None
        try:
            scheduled = self.scheduler.schedule()
            self.num_scheduled = len(scheduled)
            if not scheduled:
                return []
            deltas = self._step(self.planner.plan(scheduled))
        except BaseException as exc:
            failed = self._release_failed(scheduled)
            if isinstance(exc, Exception):
                raise StepError(failed, exc) from exc
            raise  # KeyboardInterrupt and friends stay what they are; their requests are released too
        if self.policy is not None:
            self.policy.observe(self.timings)
        if self.chunk_sizer is not None:
            self._sync()
            self.chunk_sizer.observe(
                time.perf_counter() - start, self.scheduler.num_prefill_tokens, self.verifier.num_decode_rows
            )
        return deltas

    def _step(self, plan: StepPlan) -> list[StepDelta]:
        """plan -> propose -> verify (ONE target forward, rejection sampling) -> commit."""
        seqs = [p.seq for p in plan.rows]
        sampling = self._sampling_tensors(seqs)
        draft = self._propose(plan, sampling)  # token_ids [B, k], probs [B, k, V] | None
        logits = self.verifier.forward(plan, draft)  # [sum(n_b + 1), V]
        handed = [self._hand_off(p.seq, []) for p in plan.seqs
                  if p.seq.handing_off and p.seq.fills_only and self._draft_holds_prompt(p.seq)]
        if not seqs:
            return handed  # prefill chunks (and draft fills) only
        out, controlled = self.verifier.accept(logits, draft, sampling)
        rows = torch.cat([out.token_ids, out.num_accepted.to(out.token_ids.dtype).unsqueeze(1)], 1).tolist()
        token_rows, accepted = [r[:-1] for r in rows], [r[-1] for r in rows]  # the one host sync
        paths = out.paths or [None] * len(seqs)
        emitted = [row[: accepted[b] + 1] for b, row in enumerate(token_rows)]
        if hasattr(self.proposer, "observe"):  # a proposer that learns from the target's rows
            self.proposer.observe(seqs, draft, logits, emitted)
        for b, s in enumerate(seqs):
            if draft.feeds_estimate[b]:  # the adaptive estimate is of the draft model's acceptance
                s.acceptance.update(draft.depth(b), accepted[b])
        logprobs: list = [None] * len(seqs)
        if any(s.params.logprobs is not None for s in seqs):
            logprobs = self.verifier.logprobs(
                controlled, [n + 1 for n in draft.num_draft], emitted,
                [s.params.temperature for s in seqs], [s.params.logprobs for s in seqs], paths,
            )
        for b, s in enumerate(seqs):
            if paths[b] is not None:  # a tree: only the root and the accepted path keep their KV
                self._keep_tree_path(b, s, paths[b])
        return [
            self._commit(s, token_rows[b], accepted[b], draft.num_draft[b], logprobs[b], _bonus(draft, b, paths[b]),
                         draft.depth(b) if draft.tree(b) is not None else None)
            for b, s in enumerate(seqs)
        ] + handed

    def _keep_tree_path(self, row: int, seq: Sequence, path: list[int]) -> None:
        """Roll the target's cache back to the tree's root and accepted `path`, the path's KV moved
        to the positions it now holds; a draft model's cache likewise (its proposer's
        `keep_tree_path`)."""
        src, dst = seq.target_table.keep_tree_path(seq.num_tokens - 1, path)
        self.target.kv_cache.copy_slots(src, dst)
        keep_draft = getattr(self.proposer, "keep_tree_path", None)
        if keep_draft is not None:
            keep_draft(row, seq, path)

    def _propose(self, plan: StepPlan, sampling: SamplingTensors) -> DraftOutput:
        if self.proposer is None:
            return DraftOutput.empty(len(plan.rows), self.device)
        return self.proposer.propose(plan, sampling).trimmed()

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

    def _sync(self) -> None:
        """Timings need the device's queue drained (CPU work is already done when it returns)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _sampling_tensors(self, seqs: list[Sequence]) -> SamplingTensors:
        # Kept on the host: warp_probs then skips work no row needs, without a device sync.
        p = [s.params for s in seqs]
        dev = "cpu"
        controls = [self._controls(s) for s in seqs]
        return SamplingTensors(
            torch.tensor([x.temperature for x in p], dtype=torch.float32, device=dev),
            torch.tensor([x.top_k for x in p], dtype=torch.long, device=dev),
            torch.tensor([x.top_p for x in p], dtype=torch.float32, device=dev),
            [s.generator for s in seqs],
            torch.tensor([x.min_p for x in p], dtype=torch.float32, device=dev) if any(x.min_p for x in p) else None,
            controls if any(c is not None for c in controls) else None,
        )

    def _controls(self, seq: Sequence) -> LogitControls | None:
        """The sequence's logit controls over its tokens so far (None: it has none)."""
        p = seq.params
        if not p.has_logit_controls and seq.constraint is None:
            return None
        stop_ids = list(p.stop_token_ids) + ([] if p.ignore_eos else sorted(self.eos_token_ids))
        prompt = seq.token_ids[: seq.prompt_len] if p.repetition_penalty != 1.0 else ()  # only it reads the prompt
        return LogitControls(
            seq.token_ids[seq.prompt_len :], prompt, p.presence_penalty,
            p.frequency_penalty, p.repetition_penalty, p.logit_bias, p.min_tokens, stop_ids, seq.constraint,
        )

    def _commit(
        self, seq: Sequence, row: list[int], num_accepted: int, num_draft: int,
        logprobs: list[TokenLogprobs] | None = None, bonus: bool | None = None, depth: int | None = None,
    ) -> StepDelta:
        """Append accepted (+1) tokens up to a stop, roll both caches back, finish if done.
        `bonus`: the last token followed every draft there was (None: a chain's, all accepted);
        `depth`: a tree's longest path (None: a chain)."""
        new = row[: num_accepted + 1]
        bonus = num_accepted == num_draft if bonus is None else bonus
        last = TokenOrigin.TARGET if num_draft == 0 else TokenOrigin.BONUS if bonus else TokenOrigin.RECOVERED
        origins = [TokenOrigin.ACCEPTED] * num_accepted + [last]
        first = seq.num_generated == 0
        if num_draft > 0:
            seq.stats.update(num_draft, num_accepted)
            self.stats.update(num_draft, num_accepted)
        emitted, pieces, reason = append_until_stop(seq, new, self.eos_token_ids, self.max_model_len)
        text = "".join(pieces)
        if seq.constraint is not None:
            seq.constraint.commit(emitted)
        if logprobs is not None:
            logprobs = logprobs[: len(emitted)]  # the emitted tokens are a prefix of `new`
            seq.logprobs = (seq.logprobs or []) + logprobs
        for table in (seq.target_table, seq.draft_table):
            if table is not None:
                table.truncate(seq.num_tokens - 1)
                table.cache_full_blocks(seq.token_ids)
        if reason is None and seq.handoff:
            seq.handing_off = True
            if self._draft_holds_prompt(seq):
                return self._hand_off(seq, emitted, origins[: len(emitted)], text, pieces, logprobs)
        if reason is not None:
            seq.finish_reason = reason
            self.scheduler.finish(seq)
        return StepDelta(
            seq.request_id, emitted, origins[: len(emitted)], text, num_draft, num_accepted,
            reason is not None, reason, pieces, seq.num_cached_tokens or 0,
            seq.stats if reason is not None else None, logprobs,
            prompt_logprobs=_prompt_logprobs(seq) if first else None,
            stop_string=seq.detokenizer.matched if reason == "stop" and seq.detokenizer is not None else None,
            draft_depth=depth,
        )

    # ---- prefill/decode disaggregation (specdec.handoff) ---------------------------------------

    def _draft_holds_prompt(self, seq: Sequence) -> bool:
        """Whether the draft's cache holds the whole prompt (what a handoff sends)."""
        return seq.draft_table is None or seq.draft_table.num_computed >= seq.prompt_len

    def _hand_off(self, seq: Sequence, emitted: list[int], origins: list | None = None, text: str = "",
                  pieces: list[str] | None = None, logprobs: list[TokenLogprobs] | None = None) -> StepDelta:
        """End a handoff request: lease its prompt's blocks, free the rest, say where they are."""
        ticket = handoff.take_lease(self.leases, self._movable_runners(), seq, handoff.compat_digest(self.compat))
        seq.finish_reason = "handoff"
        self.scheduler.finish(seq)
        return StepDelta(seq.request_id, emitted, origins or [], text, 0, 0, True, "handoff", pieces or [],
                         seq.num_cached_tokens or 0, seq.stats, logprobs, handoff=ticket)

    def close(self) -> None:
        """Stop what the engine started outside this process (a parallel target's ranks); the
        engine cannot step afterwards. Nothing to do for a one-process engine."""
        for runner in self.runners:
            if (close := getattr(runner, "close", None)) is not None:
                close()

    def _movable_runners(self) -> dict[str, ModelRunner]:
        """`kv_runners` where their blocks are to be read or written (a handoff's); a parallel
        target's cache is spread over its ranks: ValueError."""
        if getattr(self.target, "group", None) is not None:
            raise ValueError("prefill/decode handoff of a tensor- or pipeline-parallel target is not supported: "
                             "its cache is spread over the ranks")
        if any(getattr(r, "states", None) is not None for r in self.kv_runners().values()):
            raise ValueError("prefill/decode handoff of a hybrid (linear-attention) model is not supported: its "
                             "recurrent states do not travel with the KV blocks")
        return self.kv_runners()

    def kv_runners(self) -> dict[str, ModelRunner]:
        """The runners whose paged caches a handoff moves, by pool name."""
        runners = {"target": self.target}
        if self.proposer is not None and self.proposer.pool is not None:
            runners["draft"] = self.proposer.runner
        return runners

    @property
    def compat(self) -> dict[str, str]:
        """What must match between engines that hand KV to each other (`handoff.compat_fields`)."""
        if self._compat is None:
            self._compat = handoff.compat_fields(self)
        return self._compat

    def missing_keys(self, ticket: HandoffTicket) -> dict[str, list[bytes]]:
        """Per pool, the ticket's blocks this engine's caches lack."""
        return handoff.missing_keys(self._movable_runners(), ticket)

    def export_kv(self, lease_id: str, wanted: dict[str, list[bytes]] | None = None) -> KVPayload:
        """A lease's blocks (the `wanted` keys; None: all) as bytes; any thread. Then `release_lease`."""
        return handoff.export_lease(self.leases, self._movable_runners(), lease_id, wanted)

    def release_lease(self, lease_id: str) -> bool:
        return handoff.release_lease(self.leases, self.kv_runners(), lease_id)

    def expire_leases(self) -> int:
        """Free the blocks of the leases nobody claimed in time; returns how many expired."""
        return handoff.expire_leases(self.leases, self.kv_runners())

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
        """A request's result: what its deltas emitted (an EOS that ended it is not emitted)."""
        ids = seq.generated_ids
        if ids and seq.finish_reason == "stop" and not seq.params.ignore_eos and ids[-1] in self.eos_token_ids:
            ids = ids[:-1]
        return RequestOutput(
            seq.request_id, seq.token_ids[: seq.prompt_len], ids,
            seq.detokenizer.text, seq.finish_reason, seq.stats, seq.num_cached_tokens or 0,
            seq.logprobs if seq.params.logprobs is not None else None, _prompt_logprobs(seq),
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

    @property
    def block_size(self) -> int:
        """Tokens per KV block of the target's pool (the unit of its prefix cache)."""
        return self.target.block_size

    def cached_block_keys(self) -> tuple[bytes, ...]:
        """The keys of every block the target's prefix cache holds (`cache.block_pool.block_key`):
        what a router matches a request's prompt against."""
        return self.target.pool.cached_keys()

    @property
    def expert_stats(self) -> ExpertStats | None:
        """Experts an MoE target's verify windows read since start (None for a dense target)."""
        return self.verifier.expert_stats

    def reset_stats(self) -> None:
        """Zero the counters users read: acceptance, and prefix-cache lookups per pool."""
        self.stats = AcceptanceStats()
        if self.expert_stats is not None:
            self.verifier.expert_stats = ExpertStats(*self.target.routing)
        for pool in self._pools().values():
            pool.stats = type(pool.stats)()

    def reset_prefix_cache(self) -> int:
        """Drop every cached block no request holds, in both pools; returns how many."""
        return sum(p.reset_prefix_cache() for p in self._pools().values())


def _bonus(draft: DraftOutput, b: int, path: list[int] | None) -> bool | None:
    """A tree row's last token is a bonus where its accepted path ends at a leaf (None: a chain)."""
    tree = draft.tree(b)
    if path is None or tree is None:
        return None
    end = path[-1] if path else 0
    return end not in tree


def _check_device(config: EngineConfig, models: dict[str, torch.nn.Module | None]) -> None:
    """Every model on one device, and that device `config.device` unless it is "auto"."""
    devices = {name: m.model.norm.weight.device for name, m in models.items() if m is not None}
    wanted = None if config.device == "auto" else torch.device(config.device)
    for name, device in devices.items():
        if wanted is not None and (device.type != wanted.type or wanted.index not in (None, device.index)):
            raise ValueError(
                f"config.device is {config.device!r} but the {name} model is on {device}; move the "
                f"models first (model.to({config.device!r})) or pass device='auto'"
            )
    if len(set(devices.values())) > 1:
        raise ValueError(f"the models sit on different devices: {devices}")


def _size(num_bytes: int) -> str:
    return f"{num_bytes / 1e9:.2f} GB" if num_bytes >= 1e8 else f"{num_bytes / 1e6:.1f} MB"


def _prompt_logprobs(seq: Sequence) -> list[TokenLogprobs | None] | None:
    """[None] + the prompt tokens' logprobs from the first on, where the request asked for them."""
    if seq.params.prompt_logprobs is None:
        return None
    return [None, *(seq.prompt_logprobs or [])]
