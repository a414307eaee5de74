"""Admission, lookahead slot allocation and preemption over the target and draft block pools."""

from __future__ import annotations

from collections import deque

from specdec.cache import BlockPool, BlockTable
from specdec.sequence import Sequence, SequenceStatus


class Scheduler:
    """Decides which sequences run this step and makes sure their KV slots exist in both pools.

    A step writes, for a sequence of n tokens drafting k: target positions up to n+k-1 (the window
    [last token, d_1..d_k]) and draft positions up to n+k-2. `schedule` first grows the running
    sequences (oldest first); when a pool is short it preempts the newest running sequence (frees
    its blocks; it is recomputed from its tokens later). Then it admits waiting sequences in FIFO
    order while both pools have room and `max_num_seqs` allows. It never raises on full memory.
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
    ) -> None:
        self.target_pool, self.draft_pool = target_pool, draft_pool
        self.target_block_size, self.draft_block_size = target_block_size, draft_block_size
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.draft_slots_needed = draft_slots_needed
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

    def schedule(self) -> list[Sequence]:
        """Sequences to run this step, each with slots for its window in both pools."""
        scheduled: list[Sequence] = []
        pending = list(self.running)
        while pending:
            seq = pending.pop(0)
            while not self._reserve(seq):
                victim = self.running[-1]
                self.preempt(victim)
                if victim is seq:
                    break
                if victim in pending:
                    pending.remove(victim)
            else:
                scheduled.append(seq)
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self._admit(seq):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(seq)
        return scheduled

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
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED

    def _admit(self, seq: Sequence) -> bool:
        seq.target_table = BlockTable(self.target_pool, self.target_block_size)
        if self.draft_pool is not None:
            seq.draft_table = BlockTable(self.draft_pool, self.draft_block_size)
        if self._reserve(seq):
            return True
        self._release(seq)
        return False

    def _reserve(self, seq: Sequence) -> bool:
        """Grow both tables for this step's window; on failure leave them as they were."""
        k = self.num_draft(seq)
        target, draft = seq.target_table, seq.draft_table
        assert target is not None
        target_slots = seq.num_tokens + k
        draft_slots = self.draft_slots_needed(seq.num_tokens, k) if draft is not None else 0
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
