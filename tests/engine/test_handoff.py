"""Prefill/decode disaggregation in the engine, without Ray: a prefill engine emits the first token,
feeds its draft the prompt's full blocks and hands them over under a lease; a decode engine imports
the blocks it lacks and resumes. Greedy tokens equal one engine's; both pools of both engines go
back to zero held blocks; a lease nobody pulls expires; a payload that does not fit is refused."""

from __future__ import annotations

import time

import numpy as np
import pytest

from specdec.api.engine_loop import AsyncEngine
from specdec.cache.transfer import read_blocks, write_blocks
from specdec.handoff import UnknownLeaseError, compat_mismatch
from specdec.sampling_params import SamplingParams
from specdec.testing import tiny_serving_engine

GREEDY = SamplingParams(temperature=0, max_tokens=20)


def run(engine) -> list:
    deltas = []
    while engine.has_unfinished():
        deltas += engine.step()
    return deltas


def held(engine) -> int:
    return sum(usage["used"] for usage in engine.kv_usage().values())


def prompt_of(n: int, seed: int = 0) -> list[int]:
    return [(i * 13 + seed * 7) % 300 + 5 for i in range(n)]


def hand_over(prefill, decode, prompt: list[int], params: SamplingParams = GREEDY, rid: str = "r"):
    """Prefill on one engine, pull what the other lacks, resume there; returns (all tokens, ticket, payload)."""
    prefill.add_request(prompt, params, request_id=rid, handoff=True)
    deltas = run(prefill)
    first = [t for d in deltas for t in d.token_ids]
    assert deltas[-1].finish_reason == "handoff" and not any(d.finished for d in deltas[:-1])
    ticket = deltas[-1].handoff
    payload = prefill.export_kv(ticket.lease_id, decode.missing_keys(ticket))
    assert prefill.release_lease(ticket.lease_id)
    decode.add_request(prompt, params, request_id=rid, generated=first, payload=payload)
    rest = [t for d in run(decode) for t in d.token_ids]
    return first + rest, ticket, payload


@pytest.fixture(scope="module")
def engines():
    return [tiny_serving_engine(adaptive_k=False) for _ in range(3)]  # reference, prefill, decode


@pytest.mark.parametrize("length", [3, 8, 16, 41, 130])  # the tiny engines' blocks hold 8 tokens
def test_greedy_tokens_equal_one_engine_and_nothing_stays_held(engines, length):
    reference, prefill, decode = engines
    prompt = prompt_of(length, seed=length)
    expected = reference.generate([prompt], GREEDY)[0].token_ids
    tokens, ticket, payload = hand_over(prefill, decode, prompt, rid=f"len{length}")
    assert tokens == expected
    assert {pool: len(keys) for pool, keys in ticket.keys.items()} == {"target": length // 8, "draft": length // 8}
    assert ticket.partial == ({"target": length % 8, "draft": length % 8} if length % 8 else {})
    assert held(prefill) == held(decode) == 0 and len(prefill.leases) == 0


def test_the_partial_last_block_is_used_as_handed_over_not_computed_again(engines):
    """The decode engine's KV for the prompt is the payload's, bit for bit, partial block included:
    the payload's partial block is marked (last mantissa bit flipped), which no recomputation
    would reproduce, and the resumed request reports its whole prompt as cached."""
    _, prefill, decode = engines
    prompt = prompt_of(21, seed=5)  # 2 full blocks + 5 tokens
    prefill.add_request(prompt, GREEDY, request_id="mark", handoff=True)
    deltas = run(prefill)
    ticket = deltas[-1].handoff
    payload = prefill.export_kv(ticket.lease_id)
    prefill.release_lease(ticket.lease_id)
    for pool, (tokens, data) in payload.partial.items():
        marked = data.copy()
        marked.view(np.int32)[...] ^= 1
        payload.partial[pool] = (tokens, marked)
    decode.add_request(prompt, GREEDY, request_id="mark", generated=deltas[0].token_ids, payload=payload)
    first = decode.step()
    seq = decode._sequences["mark"]
    for pool, runner in decode.kv_runners().items():
        table = seq.target_table if pool == "target" else seq.draft_table
        got = read_blocks(runner.kv_cache, table.block_ids[:3])  # [L, 2, 3, S, H, D] bytes
        keys, full = payload.blocks[pool]
        assert np.array_equal(got[:, :, :2], full)
        assert np.array_equal(got[:, :, 2, :5], payload.partial[pool][1][:, :, 0, :5])
    run(decode)
    assert first[0].num_cached_tokens == len(prompt)
    assert held(decode) == 0


def test_a_partial_block_whose_full_blocks_are_gone_is_given_back(engines):
    """The full blocks were evicted (here: never sent) before the request was admitted: the partial
    one cannot follow them, so it is freed and the tail computed again; tokens are unchanged."""
    reference, prefill, decode = engines
    prompt = prompt_of(29, seed=6)
    expected = reference.generate([prompt], GREEDY)[0].token_ids
    prefill.add_request(prompt, GREEDY, request_id="gone-full", handoff=True)
    deltas = run(prefill)
    ticket = deltas[-1].handoff
    payload = prefill.export_kv(ticket.lease_id, {"target": [], "draft": []})
    prefill.release_lease(ticket.lease_id)
    assert payload.num_blocks == 2 and not payload.blocks
    decode.add_request(prompt, GREEDY, request_id="gone-full", generated=deltas[0].token_ids, payload=payload)
    rest = run(decode)
    assert deltas[0].token_ids + [t for d in rest for t in d.token_ids] == expected
    assert rest[0].num_cached_tokens < len(prompt) and held(decode) == 0 and held(prefill) == 0


def test_an_aborted_resumed_request_gives_its_partial_blocks_back(engines):
    _, prefill, decode = engines
    prompt = prompt_of(13, seed=7)
    prefill.add_request(prompt, GREEDY, request_id="abort-resumed", handoff=True)
    deltas = run(prefill)
    payload = prefill.export_kv(deltas[-1].handoff.lease_id)
    prefill.release_lease(deltas[-1].handoff.lease_id)
    decode.add_request(prompt, GREEDY, request_id="abort-resumed", generated=deltas[0].token_ids, payload=payload)
    assert held(decode) == 2  # the two partial blocks, before any step
    assert decode.abort("abort-resumed")
    assert held(decode) == 0
    with pytest.raises(ValueError, match="generated"):  # a payload without its tokens: nothing is held
        decode.add_request(prompt, GREEDY, request_id="no-tokens", payload=payload)
    assert held(decode) == 0


def test_the_first_token_comes_before_the_drafts_fill(engines):
    """The target's prefill emits the token; the draft's cache is fed the prompt in a step after."""
    _, prefill, _ = engines
    prefill.add_request(prompt_of(60, seed=1), GREEDY, request_id="ttft", handoff=True)
    first_step = prefill.step()
    assert len(first_step) == 1 and len(first_step[0].token_ids) == 1 and not first_step[0].finished
    last = run(prefill)[-1]
    assert last.finish_reason == "handoff" and last.token_ids == []
    prefill.release_lease(last.handoff.lease_id)
    assert held(prefill) == 0


def test_only_missing_blocks_are_read_and_a_lease_is_read_once(engines):
    reference, prefill, decode = engines
    shared = prompt_of(48, seed=2)
    hand_over(prefill, decode, shared + [9], rid="turn1")
    longer = shared + [9] + prompt_of(30, seed=3)
    prefill.add_request(longer, GREEDY, request_id="turn2", handoff=True)
    ticket = run(prefill)[-1].handoff
    wanted = decode.missing_keys(ticket)
    assert {pool: len(keys) for pool, keys in wanted.items()} == {"target": 9 - 6, "draft": 9 - 6}
    payload = prefill.export_kv(ticket.lease_id, wanted)
    assert payload.num_blocks == 6 + 2 and payload.nbytes > 0  # 79 tokens: + the partial block of each pool
    assert {pool: tokens for pool, (tokens, _) in payload.partial.items()} == {"target": 7, "draft": 7}
    with pytest.raises(UnknownLeaseError):
        prefill.export_kv(ticket.lease_id)  # being read (until released): not twice
    prefill.release_lease(ticket.lease_id)
    with pytest.raises(UnknownLeaseError):
        prefill.export_kv(ticket.lease_id)


def test_penalties_and_stop_strings_resume_after_the_first_token(engines):
    reference, prefill, decode = engines
    params = SamplingParams(temperature=0, max_tokens=16, stop=["zz"], presence_penalty=0.5)
    prompt = prompt_of(27, seed=4)
    expected = reference.generate([prompt], params)[0].token_ids
    tokens, _, _ = hand_over(prefill, decode, prompt, params, rid="penalty")
    assert tokens == expected


def test_an_unclaimed_lease_expires_and_frees_its_blocks():
    engine = tiny_serving_engine()
    engine.leases.timeout_s = 0.0
    engine.add_request(prompt_of(40), GREEDY, request_id="gone", handoff=True)
    run(engine)
    assert len(engine.leases) == 1 and held(engine) > 0
    assert engine.expire_leases() == 1
    assert held(engine) == 0 and engine.leases.num_expired == 1


def test_the_engine_loop_expires_leases_while_idle():
    async_engine = AsyncEngine(tiny_serving_engine())
    import asyncio

    async def scenario() -> None:
        from specdec.api.engine_loop import GenerationRequest

        async_engine.start()
        await asyncio.to_thread(async_engine.ready.wait)
        async_engine.engine.leases.timeout_s = 0.3
        stream = async_engine.submit(GenerationRequest("x", prompt_of(40), GREEDY, handoff=True))
        async for delta in stream:
            pass
        assert delta.finish_reason == "handoff"
        assert len(async_engine.engine.leases) == 1
        deadline = time.monotonic() + 5
        while len(async_engine.engine.leases) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # nothing else happens: the idle loop wakes for the deadline
        assert len(async_engine.engine.leases) == 0
        async_engine.shutdown()

    asyncio.run(scenario())
    assert held(async_engine.engine) == 0


def test_aborting_a_handed_off_request_frees_its_lease():
    engine = tiny_serving_engine()
    engine.add_request(prompt_of(40), GREEDY, request_id="left", handoff=True)
    run(engine)
    engine.release("left")
    assert engine.abort("left") and held(engine) == 0


def test_bad_resumes_and_payloads_are_refused(engines):
    _, prefill, decode = engines
    with pytest.raises(ValueError, match="max_tokens"):
        decode.add_request([5, 6, 7], SamplingParams(max_tokens=2), generated=[1, 2])
    with pytest.raises(ValueError, match="generated token ids"):
        decode.add_request([5, 6, 7], GREEDY, generated=[10**6])
    runner = decode.target
    with pytest.raises(ValueError, match="do not fit"):
        write_blocks(runner.pool, runner.kv_cache, [b"k" * 16], np.zeros((1, 3), dtype=np.uint8))


def test_engines_that_differ_are_told_apart_by_field():
    a, b = tiny_serving_engine(), tiny_serving_engine(seed=1)
    assert compat_mismatch(a.compat, tiny_serving_engine().compat) is None
    assert compat_mismatch(a.compat, b.compat).startswith("draft weights")
    c = tiny_serving_engine(block_size=16)
    assert compat_mismatch(a.compat, c.compat).startswith("block_size")
