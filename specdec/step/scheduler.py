"""Admission, lookahead slot allocation and preemption over the target and draft block pools."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from specdec.step.adaptive import ChunkSizer
from specdec.cache import BlockPool, BlockTable
from specdec.handoff import free_partial
from specdec.sequence import Sequence, SequenceStatus


MIN_PREFILL_CHUNK = 16  # with a fixed budget, a prefill advances this much per step however busy decoding is


@dataclass
class ChunkBudget:
    """Prefill tokens a step's target forward may carry.

    While any scheduled sequence decodes: a fixed `max_num_batched_tokens` for all of the
    forward's rows (decode and verify rows first, prefill the rest, at least MIN_PREFILL_CHUNK),
    or, when that is None, what `sizer` measures keeps the streams' gaps in bounds. With nothing
    decoding, chunks of `alone` tokens.
    """

    max_num_batched_tokens: int | None = None
    alone: int = 2048
    sizer: ChunkSizer | None = None

    def beside_decoding(self, decode_rows: int) -> int:
        if self.max_num_batched_tokens is not None:
            return max(self.max_num_batched_tokens - decode_rows, MIN_PREFILL_CHUNK)
        return self.sizer.budget() if self.sizer is not None else MIN_PREFILL_CHUNK


class Scheduler:
    """Decides which sequences run this step, how much of each prompt, and makes sure their KV
    slots exist in both pools.

    A decoding step writes, for a sequence of n tokens drafting k: target positions up to n+k-1
    (the window [last token, d_1..d_k]) and draft positions up to n+k-2. A prefilling sequence
    (its target cache lacks more than its last token: a new prompt, or one recomputed after
    preemption) gets a chunk of its pending tokens from the step's token budget; the draft's
    cache is fed the same stretch alongside (`Sequence.num_draft_fill`) except for the last
    chunk, so that the first token never waits for the draft.

    `schedule` first grows the running sequences (oldest first); when a pool is short it preempts
    the newest running sequence (frees its blocks; it is recomputed from its tokens later, reusing
    whatever the prefix cache still holds). Then, unless it preempted, it admits waiting sequences
    in FIFO order while both pools have room, the budget has tokens left and `max_num_seqs` allows. A new sequence
    starts on the longest cached prefix of its tokens in each pool. It never raises on full memory.
    """

    def __init__(
        self,
        target_pool: BlockPool,
        target_block_size: int,
        draft_pool: BlockPool | None,
        draft_block_size: int,
        max_num_seqs: int,
        max_model_len: int,
        draft_slots_needed,
        budget: ChunkBudget | None = None,
        tree_rows: int = 0,
    ) -> None:
        self.target_pool, self.draft_pool = target_pool, draft_pool
        self.tree_rows = tree_rows  # a tree proposer's nodes at most per sequence (0: chains)
        self.target_block_size, self.draft_block_size = target_block_size, draft_block_size
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.draft_slots_needed = draft_slots_needed
        self.budget = budget or ChunkBudget(MIN_PREFILL_CHUNK)
        self.num_prefill_tokens = 0  # prompt tokens the latest schedule feeds
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def num_draft(self, seq: Sequence) -> int:
        """This step's k: the configured k, clipped so the step can't pass max_tokens or the context."""
        remaining = seq.params.max_tokens - seq.num_generated
        room = self.max_model_len - seq.num_tokens
        return max(0, min(seq.num_speculative_tokens, remaining - 1, room))

    def num_rows(self, seq: Sequence) -> int:
        """The draft rows this step may verify: k, or with a tree proposer (`tree_rows`) a tree's
        nodes (k bounds its depth), within the context either way."""
        k = self.num_draft(seq)
        if not self.tree_rows or not k or seq.num_pending > 1:
            return k
        return max(k, min(self.tree_rows, self.max_model_len - seq.num_tokens))

    def schedule(self) -> list[Sequence]:
        """Sequences to run this step, each with its chunk set and slots for it in both pools."""
        scheduled: list[Sequence] = []
        decoding = [s for s in self.running if s.num_pending <= 1 and not s.handing_off]
        if decoding:
            left = self.budget.beside_decoding(sum(1 + self.num_rows(s) for s in decoding))
        else:
            left = self.budget.alone
        pending = list(self.running)
        preempted = False
        while pending:
            seq = pending.pop(0)
            left -= self._set_chunk(seq, left)
            while not self._reserve(seq):
                victim = self.running[-1]
                self.preempt(victim)
                preempted = True
                if victim is seq:
                    break
                if victim in pending:
                    pending.remove(victim)
            else:
                scheduled.append(seq)
        # A step that had to preempt admits nothing (as vLLM v1): memory is short, and the victim,
        # first in line, would be re-admitted at once only to recompute what it just gave up.
        while not preempted and self.waiting and len(self.running) < self.max_num_seqs and left > 0:
            seq = self.waiting[0]
            if _waits_for_leader(seq) or not self._admit(seq, left):
                break
            left -= seq.num_new_tokens + (0 if seq.fills_only else self.num_draft(seq))
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(seq)
        self.num_prefill_tokens = sum(s.num_new_tokens for s in scheduled if s.num_pending > 1)
        return scheduled

    def _set_chunk(self, seq: Sequence, left: int) -> int:
        """Set this step's target chunk and draft fill; returns the prefill tokens it takes."""
        pending = seq.num_pending
        if seq.handing_off and pending <= 1:  # its token is out: the draft's fill is all that is left
            lag = seq.prompt_len - seq.draft_table.num_computed if seq.draft_table is not None else 0
            seq.num_new_tokens, seq.num_draft_fill = 0, max(0, min(lag, max(left, 1)))
            return seq.num_draft_fill
        if pending <= 1:
            seq.num_new_tokens, seq.num_draft_fill = pending, 0
            return 0
        chunk = min(pending, max(left, 1))
        seq.num_new_tokens = chunk
        draft = seq.draft_table
        # The draft's cache takes the same stretch, except beside the prompt's last chunk: the
        # first token must not wait for the draft (TTFT); what is left there is caught up once
        # the sequence drafts (StepPlanner._catch_up_first).
        lag = seq.num_tokens - 1 - draft.num_computed if draft is not None and chunk < pending else 0
        seq.num_draft_fill = max(0, min(lag, chunk))
        return chunk

    def preempt(self, seq: Sequence) -> None:
        """Free the sequence's blocks and send it back to the front of the queue (recompute)."""
        self._release(seq)
        self.running.remove(seq)
        seq.status = SequenceStatus.WAITING
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and free every block it holds."""
        self._release(seq)
        self._free_partials(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED

    def _admit(self, seq: Sequence, left: int) -> bool:
        """Start the sequence's tables on their cached prefixes and reserve its first chunk."""
        seq.target_table = BlockTable(self.target_pool, self.target_block_size, seq.cache_salt)
        # prompt logprobs come out of the target's prefill: its cached blocks kept no logits
        seq.target_table.match_prefix(seq.token_ids, 0 if seq.params.prompt_logprobs is not None else seq.num_tokens - 1)
        if self.draft_pool is not None:
            seq.draft_table = BlockTable(self.draft_pool, self.draft_block_size, seq.cache_salt)
            seq.draft_table.match_prefix(seq.token_ids, seq.num_tokens - 1)
        attached = self._attach_partials(seq)  # what the prompt found: cached blocks (+ handed-over tail)
        hit, draft_hit = seq.target_table.num_computed, seq.draft_table.num_computed if seq.draft_table else 0
        self._set_chunk(seq, left)
        if self._reserve(seq):
            seq.imported_partial = None  # the tables own them now
            if seq.num_cached_tokens is None:  # first admission: what the prompt found cached
                seq.num_cached_tokens, seq.num_draft_cached_tokens = hit, draft_hit
            for pool, found in ((self.target_pool, hit), (self.draft_pool, draft_hit)):
                if pool is not None:  # counted once per admission, not per attempt
                    pool.stats.queried_tokens += seq.num_tokens
                    pool.stats.hit_tokens += found
            return True
        for pool, block_id in attached:  # the sequence keeps them for its next try
            pool.incref([block_id])
        self._release(seq)
        return False

    def _attach_partials(self, seq: Sequence) -> list[tuple[BlockPool, int]]:
        """A resumed request (`specdec.handoff`): put the prompt's partial last blocks it was
        handed after the full blocks its tables found cached. One whose full blocks were not all
        found (evicted since) is given back: that pool computes the prompt's tail again."""
        attached = []
        for name, (block_id, tokens) in list((seq.imported_partial or {}).items()):
            pool, table = self._pools()[name], seq.target_table if name == "target" else seq.draft_table
            if table is not None and table.num_computed + tokens == seq.prompt_len and table.attach_partial(block_id, tokens):
                attached.append((pool, block_id))
            else:
                free_partial(self._pools(), {name: seq.imported_partial.pop(name)})
        return attached

    def _pools(self) -> dict[str, BlockPool | None]:
        return {"target": self.target_pool, "draft": self.draft_pool}

    def _free_partials(self, seq: Sequence) -> None:
        free_partial(self._pools(), seq.imported_partial or {})
        seq.imported_partial = None

    def _reserve(self, seq: Sequence) -> bool:
        """Grow both tables for this step's window; on failure leave them as they were."""
        target, draft = seq.target_table, seq.draft_table
        assert target is not None
        fill_end = draft.num_computed + seq.num_draft_fill if draft is not None else 0
        if seq.fills_only:  # a prefill chunk short of the prompt's end, and the draft's fill
            target_slots, draft_slots = target.num_computed + seq.num_new_tokens, fill_end
        else:
            k = self.num_draft(seq)
            target_slots = seq.num_tokens + self.num_rows(seq)
            draft_slots = max(self.draft_slots_needed(seq.num_tokens, k), fill_end) if draft is not None else 0
        if draft is not None and draft.blocks_needed(draft_slots) > self.draft_pool.num_free:
            return False
        if not target.ensure_slots(target_slots):
            return False
        if draft is not None:
            ok = draft.ensure_slots(draft_slots)
            assert ok
        return True

    def _release(self, seq: Sequence) -> None:
        for table in (seq.target_table, seq.draft_table):
            if table is not None:
                table.free()
        seq.target_table = seq.draft_table = None


def _waits_for_leader(seq: Sequence) -> bool:
    """A sibling (n > 1) waits while its leader's prompt is not yet prefilled (and cached)."""
    leader = seq.prefill_leader
    if leader is None or leader.finished:
        return False
    return leader.target_table is None or leader.num_pending > 1
