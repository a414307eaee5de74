"""The scheduler: admission with lookahead slots in both pools, chunked prefill, preemption of the
newest sequence when a pool runs short, and never a crash on full memory."""

from specdec.cache import BlockPool
from specdec.sampling_params import SamplingParams
from specdec.step.scheduler import ChunkBudget, Scheduler
from specdec.sequence import Sequence, SequenceStatus

BLOCK = 4


def draft_slots(num_tokens: int, k: int) -> int:  # the draft-model proposer's rule
    return num_tokens + k - 1 if k else 0


def make(target_blocks: int, draft_blocks: int = 64, chunk: int = 64, alone: int | None = None) -> Scheduler:
    """`chunk`: a step's target rows beside decoding; `alone`: a chunk with nothing decoding."""
    return Scheduler(
        BlockPool(target_blocks), BLOCK, BlockPool(draft_blocks), BLOCK, 8, 1000,
        draft_slots, ChunkBudget(chunk, alone or chunk),
    )


def seq(n: int, k: int = 3, arrival: int = 0, max_tokens: int = 100) -> Sequence:
    return Sequence(f"r{arrival}", list(range(3, 3 + n)), SamplingParams(max_tokens=max_tokens), k, arrival)


def decode(s: Sequence) -> None:
    """What a plain decoding step does to a scheduled sequence: its window is computed, a token
    appended."""
    s.target_table.num_computed = s.draft_table.num_computed = s.num_tokens
    s.token_ids.append(7)


def ids(seqs: list[Sequence]) -> list[str]:
    return [s.request_id for s in seqs]


def test_admission_reserves_the_prompt_and_the_lookahead_in_both_pools():
    scheduler = make(target_blocks=16)
    a = seq(10, k=3)
    scheduler.add(a)
    assert ids(scheduler.schedule()) == ["r0"]
    assert a.status is SequenceStatus.RUNNING and a.num_new_tokens == 10 and not a.fills_only
    assert a.target_table.capacity >= 10 + 3  # the window [prompt, d_1..d_3]
    assert a.draft_table.capacity >= 10 + 3 - 1  # the draft never feeds d_k
    assert scheduler.num_draft(a) == 3


def test_the_cap_respects_max_tokens_and_the_context():
    scheduler = make(target_blocks=16)
    assert scheduler.num_draft(seq(10, k=5, max_tokens=3)) == 2  # the step emits at most k + 1
    scheduler.max_model_len = 12
    assert scheduler.num_draft(seq(10, k=5)) == 2


def test_a_prompt_that_does_not_fit_waits_and_allocates_nothing():
    scheduler = make(target_blocks=3)  # 12 slots: a 10-token prompt + 3 lookahead needs 4 blocks
    a = seq(10, k=3)
    scheduler.add(a)
    assert ids(scheduler.schedule()) == []
    assert a.status is SequenceStatus.WAITING and a.target_table is None and a.draft_table is None
    assert scheduler.target_pool.num_free == 3 and scheduler.draft_pool.num_free == 64


def test_long_prompts_are_prefilled_in_chunks_within_the_budget():
    scheduler = make(target_blocks=32, chunk=8)
    a = seq(20)
    scheduler.add(a)
    assert ids(scheduler.schedule()) == ["r0"] and a.num_new_tokens == 8 and a.fills_only
    assert a.num_draft_fill == 8  # the draft's cache takes the same stretch
    a.target_table.num_computed = a.draft_table.num_computed = 8
    assert ids(scheduler.schedule()) == ["r0"] and a.num_new_tokens == 8
    a.target_table.num_computed = a.draft_table.num_computed = 16
    assert ids(scheduler.schedule()) == ["r0"] and a.num_new_tokens == 4 and not a.fills_only
    assert a.num_draft_fill == 0  # not beside the prompt's last chunk: the first token waits for no draft


def test_a_short_pool_preempts_the_newest_which_is_not_readmitted_in_the_same_step():
    # Beside decoding a step carries 16 prompt tokens (MIN_PREFILL_CHUNK): the victim's first
    # chunk would fit in what its preemption freed, yet it waits for the next step.
    scheduler = make(target_blocks=10, chunk=8, alone=64)
    old, new = seq(15, k=1, arrival=0), seq(20, k=1, arrival=1)  # 4 + 6 blocks: the pool is full
    scheduler.add(old)
    scheduler.add(new)
    assert ids(scheduler.schedule()) == ["r0", "r1"]
    decode(old)  # 16 tokens + d_1: old needs a 5th block
    decode(new)
    assert ids(scheduler.schedule()) == ["r0"]
    assert new.status is SequenceStatus.WAITING and scheduler.waiting[0] is new
    assert new.target_table is None and new.draft_table is None and scheduler.num_preemptions == 1
    assert scheduler.target_pool.num_free == 5
    decode(old)
    assert ids(scheduler.schedule()) == ["r0", "r1"] and new.num_new_tokens == 16  # recomputed, in chunks


def test_finish_frees_everything_whatever_the_state():
    scheduler = make(target_blocks=16)
    a, b = seq(6, arrival=0), seq(6, arrival=1)
    scheduler.add(a)
    scheduler.add(b)
    scheduler.schedule()
    waiting = seq(6, arrival=2)
    scheduler.add(waiting)
    for s in (a, b, waiting):
        scheduler.finish(s)
        assert s.status is SequenceStatus.FINISHED
    assert not scheduler.has_work()
    assert scheduler.target_pool.num_used == 0 and scheduler.draft_pool.num_used == 0
