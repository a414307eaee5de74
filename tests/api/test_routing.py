"""The replica router's scoring, with fake replicas (no Ray): the prefix policy sends a prompt to the
replica holding its longest cached prefix, balances when queues are unbalanced, and its block keys
are exactly the engine's."""

from __future__ import annotations

import random

import pytest

from specdec.api.cluster.routing import PrefixPolicy, PrefixPolicyConfig, ReplicaView, RoutingHint, check_policy
from specdec.cache.block_pool import prefix_block_keys
from specdec.sampling_params import SamplingParams
from specdec.testing import tiny_serving_engine

BS = 4


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def keys(tokens: list[int], salt: str | None = None) -> list[bytes]:
    return prefix_block_keys(tokens, BS, salt)


def views(*names: str, clock: Clock | None = None) -> list[ReplicaView]:
    return [ReplicaView(name, clock or Clock()) for name in names]


def test_longest_held_prefix_wins():
    a, b = views("a", "b")
    conversation = list(range(40))
    a.report(keys(conversation[:8]))   # 2 blocks of the prompt
    b.report(keys(conversation[:24]))  # 6 blocks
    decision = PrefixPolicy("prefix").choose([a, b], RoutingHint(keys(conversation)))
    assert decision.ranked[0] == "b" and decision.reason == "prefix_hit" and decision.matched_blocks == 6


def test_a_prefix_is_matched_from_the_first_block_only():
    """Keys are chained: a replica holding later blocks of another prompt matches nothing."""
    a, b = views("a", "b")
    a.report(keys([9] + list(range(1, 24))))  # differs in the first token
    b.report(keys(list(range(8))))
    decision = PrefixPolicy("prefix", PrefixPolicyConfig(min_match=0.0)).choose([a, b], RoutingHint(keys(list(range(24)))))
    assert decision.ranked[0] == "b" and decision.reason == "prefix_hit" and decision.matched_blocks == 2


def test_salts_separate_prefixes():
    a, b = views("a", "b")
    prompt = list(range(16))
    a.report(keys(prompt, salt="tenant-1"))
    b.report(keys(prompt))
    assert PrefixPolicy().choose([a, b], RoutingHint(keys(prompt, "tenant-1"))).ranked[0] == "a"
    assert PrefixPolicy().choose([a, b], RoutingHint(keys(prompt))).ranked[0] == "b"


def test_no_match_goes_to_the_least_loaded_then_the_emptier_cache():
    a, b, c = views("a", "b", "c")
    a.in_flight, b.in_flight, c.in_flight = 2, 1, 1
    b.report(keys(list(range(100, 140))))  # holds other prompts: c is emptier
    decision = PrefixPolicy().choose([a, b, c], RoutingHint(keys(list(range(16)))))
    assert decision.reason == "least_loaded" and decision.ranked == ["c", "b", "a"]


def test_unbalanced_queues_fall_back_to_power_of_two_choices():
    a, b = views("a", "b")
    prompt = keys(list(range(16)))
    a.report(prompt)
    a.in_flight, b.in_flight = 20, 2  # 18 more (> 8) and 10x (> 1.5x)
    decision = PrefixPolicy("prefix", rng=random.Random(0)).choose([a, b], RoutingHint(prompt))
    assert decision.reason == "imbalanced" and decision.ranked[0] == "b"
    a.in_flight = 9  # 7 more: within balance_abs, so the cache wins
    assert PrefixPolicy().choose([a, b], RoutingHint(prompt)).ranked[0] == "a"


def test_both_thresholds_must_be_exceeded():
    a, b = views("a", "b")
    prompt = keys(list(range(16)))
    a.report(prompt)
    a.in_flight, b.in_flight = 60, 50  # 10 more than b but only 1.2x
    assert PrefixPolicy().choose([a, b], RoutingHint(prompt)).reason == "prefix_hit"


def test_min_match_demands_enough_of_the_prompt():
    a, b = views("a", "b")
    prompt = keys(list(range(40)))  # 10 blocks
    a.report(prompt[:2])
    policy = PrefixPolicy("prefix", PrefixPolicyConfig(min_match=0.5))
    assert policy.choose([a, b], RoutingHint(prompt)).reason == "least_loaded"
    a.report(prompt[:5])
    assert policy.choose([a, b], RoutingHint(prompt)).reason == "prefix_hit"


def test_a_shared_system_prompt_alone_does_not_pull_new_conversations_to_one_replica():
    """Every conversation starts with the same template blocks; the replica that served the first
    must not get them all (half the prompt's blocks make a hit, as SGLang's cache_threshold)."""
    a, b = views("a", "b")
    system = list(range(8))  # 2 blocks every prompt starts with
    a.report(keys(system + [50] * 12))
    a.in_flight = 1
    new_conversation = keys(system + [60] * 12)  # 5 blocks, 2 of them held by a
    decision = PrefixPolicy().choose([a, b], RoutingHint(new_conversation))
    assert decision.reason == "least_loaded" and decision.ranked[0] == "b"
    a.in_flight = 0  # equally idle: the longer prefix breaks the tie
    assert PrefixPolicy().choose([a, b], RoutingHint(new_conversation)).ranked[0] == "a"


def test_predicted_blocks_count_until_they_expire_or_a_report_confirms_them():
    clock = Clock()
    a, b = views("a", "b", clock=clock)
    prompt = keys(list(range(16)))
    a.predict(prompt, limit=100)  # routed there, not yet reported
    assert PrefixPolicy().choose([a, b], RoutingHint(prompt)).ranked[0] == "a"
    clock.now = 61.0  # past predict_ttl_s, never confirmed (evicted, or the prefill failed)
    assert PrefixPolicy().choose([a, b], RoutingHint(prompt)).reason == "least_loaded"
    a.predict(prompt, limit=100)
    a.report(prompt)  # the replica says it holds them: no longer predictions
    assert not a.predicted and a.held == frozenset(prompt)
    clock.now = 500.0
    assert PrefixPolicy().choose([a, b], RoutingHint(prompt)).ranked[0] == "a"


def test_a_report_drops_what_the_replica_evicted():
    a, b = views("a", "b")
    prompt = keys(list(range(16)))
    a.report(prompt)
    a.report([])  # evicted since
    assert PrefixPolicy().choose([a, b], RoutingHint(prompt)).reason == "least_loaded"


def test_predictions_are_bounded():
    (a,) = views("a")
    a.predict(keys(list(range(400))), limit=10)
    assert len(a.predicted) == 10


def test_round_robin_rotates_and_one_sticks():
    replicas = views("a", "b", "c")
    policy = PrefixPolicy("round-robin")
    firsts = [policy.choose(replicas, RoutingHint()).ranked[0] for _ in range(6)]
    assert firsts == ["b", "c", "a", "b", "c", "a"]
    one = PrefixPolicy("one")
    assert {one.choose(replicas, RoutingHint()).ranked[0] for _ in range(5)} == {"a"}


def test_a_request_can_override_the_policy():
    a, b = views("a", "b")
    prompt = keys(list(range(16)))
    a.report(prompt)
    policy = PrefixPolicy("prefix")
    assert policy.choose([a, b], RoutingHint(prompt, policy="one")).reason == "one"
    assert policy.choose([a, b], RoutingHint(prompt)).reason == "prefix_hit"


def test_pow2_prefers_the_shorter_of_two_queues():
    a, b = views("a", "b")
    a.in_flight = 5
    assert PrefixPolicy("pow2").choose([a, b], RoutingHint()).ranked[0] == "b"


def test_a_retry_avoids_the_replica_that_failed():
    a, b = views("a", "b")
    prompt = keys(list(range(16)))
    a.report(prompt)
    assert PrefixPolicy().choose([a, b], RoutingHint(prompt, avoid="a")).ranked == ["b"]
    assert PrefixPolicy().choose([a], RoutingHint(prompt, avoid="a")).ranked == ["a"]  # nobody else


def test_unknown_policies_are_refused():
    with pytest.raises(ValueError, match="round-robin"):
        check_policy("random")
    with pytest.raises(ValueError, match="unknown router"):
        PrefixPolicy().choose(views("a"), RoutingHint(policy="sticky"))
    with pytest.raises(ValueError, match="balance_rel"):
        PrefixPolicyConfig(balance_rel=0.5)


@pytest.mark.parametrize("salt", [None, "tenant"])
def test_router_keys_are_the_engines_cached_block_keys(salt):
    """What the router hashes is exactly what the engine caches: after a request, the engine's
    cached keys contain every full block of prompt + answer (less the last token) and nothing of
    another salt."""
    engine = tiny_serving_engine(block_size=BS)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]
    engine.add_request(prompt, SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True), "r",
                       cache_salt=salt)
    answer = []
    while engine.has_unfinished():
        for delta in engine.step():
            answer += delta.token_ids
    engine.release("r")
    cached = set(engine.cached_block_keys())
    expected = prefix_block_keys(prompt + answer[:-1], engine.block_size, salt)
    assert len(expected) == (len(prompt) + len(answer) - 1) // BS
    assert set(expected) <= cached
    other = prefix_block_keys(prompt, BS, "someone-else" if salt is None else None)
    assert not set(other) & cached
