"""Replica choice: power of two choices by load, and prefix affinity for generations."""

from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st

from sluice import wire
from sluice.gateway.router import Candidate, PrefixAffinity, affinity_scope, choose, prompt_bytes

SYSTEM = "You are a careful assistant. Answer in one short paragraph and cite nothing. " * 3


def _idle(*workers: str) -> list[Candidate]:
    return [Candidate(w, 0.0) for w in workers]


def test_power_of_two_takes_the_less_loaded_of_two_and_one_candidate_alone():
    rng = random.Random(0)
    assert choose([], rng) is None
    assert choose(_idle("w0"), rng) == Candidate("w0", 0.0)
    pair = [Candidate("busy", 1.0), Candidate("idle", 0.1)]
    assert {choose(pair, rng).worker_id for _ in range(50)} == {"idle"}  # type: ignore[union-attr]


@given(st.lists(st.floats(0, 10), min_size=3, max_size=8), st.integers(0, 1000))
def test_power_of_two_never_takes_the_most_loaded_of_several(waits, seed):
    candidates = [Candidate(f"w{i}", w) for i, w in enumerate(waits)]
    chosen = choose(candidates, random.Random(seed))
    assert chosen is not None and chosen in candidates
    if len(set(waits)) == len(waits):
        assert chosen.predicted_wait_s != max(waits)


def _route(affinity: PrefixAffinity, scope: str, prompt: str, candidates: list[Candidate], rng) -> tuple[str, bool]:
    keys = affinity.keys(scope, prompt.encode())
    chosen, by_affinity = affinity.choose(candidates, keys, rng)
    assert chosen is not None
    affinity.record(keys, chosen.worker_id)
    return chosen.worker_id, by_affinity


def test_prompts_sharing_a_prefix_go_where_the_first_went():
    affinity, rng = PrefixAffinity(), random.Random(1)
    workers = _idle("w0", "w1", "w2", "w3")
    first, by_affinity = _route(affinity, "t\0m\01", SYSTEM + "Question 0?", workers, rng)
    assert not by_affinity
    for i in range(1, 20):
        assert _route(affinity, "t\0m\01", SYSTEM + f"Question {i}?", workers, rng) == (first, True)


def test_the_longest_known_prefix_decides():
    """Two conversations share the system prompt; each later turn follows its own conversation."""
    affinity = PrefixAffinity(block_bytes=16)
    keys_a = affinity.keys("s", (SYSTEM + "conversation A, first turn").encode())
    keys_b = affinity.keys("s", (SYSTEM + "conversation B, first turn").encode())
    affinity.record(keys_a, "w0")
    affinity.record(keys_b, "w1")
    later_a = affinity.keys("s", (SYSTEM + "conversation A, first turn, and a second").encode())
    assert affinity.owner(later_a) == "w0"
    assert affinity.owner(affinity.keys("s", SYSTEM.encode())) == "w1"  # the shared part: its last taker
    assert affinity.owner(affinity.keys("s", b"something else entirely, long enough to make blocks")) is None


def test_another_tenant_or_model_does_not_follow_the_prefix():
    affinity = PrefixAffinity()
    prompt = (SYSTEM + "Question?").encode()
    affinity.record(affinity.keys("tenant-a\0m\01", prompt), "w0")
    assert affinity.owner(affinity.keys("tenant-a\0m\01", prompt)) == "w0"
    assert affinity.owner(affinity.keys("tenant-b\0m\01", prompt)) is None
    assert affinity.owner(affinity.keys("tenant-a\0m\02", prompt)) is None


def test_a_cache_salt_routes_with_its_own_salt_and_never_by_another_salts_prefix():
    """The worker's prefix cache is salted by tenant and `cache_salt`: a prompt under a salt goes
    where that salt's prompt with the same start went, and a prompt under another salt (or none)
    does not follow it there, as it would find nothing cached."""
    affinity, rng = PrefixAffinity(), random.Random(5)
    workers = _idle("w0", "w1", "w2", "w3")

    def scope(salt: str) -> str:
        return affinity_scope("t", "m", "1", wire.GeneratePayload(prompt=SYSTEM, cache_salt=salt))

    first, _ = _route(affinity, scope("alice"), SYSTEM + "Question 0?", workers, rng)
    for i in range(1, 10):
        assert _route(affinity, scope("alice"), SYSTEM + f"Question {i}?", workers, rng) == (first, True)
    prompt = (SYSTEM + "Question 0?").encode()
    assert affinity.owner(affinity.keys(scope("alice"), prompt)) == first
    assert affinity.owner(affinity.keys(scope("bob"), prompt)) is None
    assert affinity.owner(affinity.keys(scope(""), prompt)) is None  # no salt: the tenant's alone
    assert scope("") == affinity_scope("t", "m", "1", wire.GeneratePayload(prompt=SYSTEM))
    # a salt is the request's, within its tenant: another tenant's same salt is another scope
    other = affinity_scope("u", "m", "1", wire.GeneratePayload(prompt=SYSTEM, cache_salt="alice"))
    assert affinity.owner(affinity.keys(other, prompt)) is None


def test_a_busy_owner_is_passed_over_for_load_and_the_prefix_moves():
    affinity, rng = PrefixAffinity(slack_s=0.05), random.Random(2)
    keys = affinity.keys("s", (SYSTEM + "Q").encode())
    affinity.record(keys, "w0")
    slightly = [Candidate("w0", 0.04), Candidate("w1", 0.0)]
    assert affinity.choose(slightly, keys, rng) == (slightly[0], True)  # within the slack: keep the cache
    overloaded = [Candidate("w0", 0.5), Candidate("w1", 0.0)]
    chosen, by_affinity = affinity.choose(overloaded, keys, rng)
    assert chosen == overloaded[1] and not by_affinity
    affinity.record(keys, "w1")
    assert affinity.owner(keys) == "w1"


def test_an_owner_that_is_not_a_candidate_any_more_is_ignored():
    affinity, rng = PrefixAffinity(), random.Random(3)
    keys = affinity.keys("s", (SYSTEM + "Q").encode())
    affinity.record(keys, "gone")
    chosen, by_affinity = affinity.choose(_idle("w0", "w1"), keys, rng)
    assert chosen is not None and chosen.worker_id in {"w0", "w1"} and not by_affinity


def test_short_prompts_and_single_replicas_route_by_load():
    affinity, rng = PrefixAffinity(), random.Random(4)
    assert affinity.keys("s", b"short") == []
    chosen, by_affinity = affinity.choose(_idle("w0", "w1"), [], rng)
    assert chosen is not None and not by_affinity
    keys = affinity.keys("s", SYSTEM.encode())
    affinity.record(keys, "w1")
    assert affinity.choose(_idle("w0"), keys, rng) == (Candidate("w0", 0.0), False)


def test_only_the_first_blocks_count_and_the_table_is_bounded():
    affinity = PrefixAffinity(block_bytes=8, max_blocks=4, capacity=10)
    assert len(affinity.keys("s", b"x" * 1000)) == 4
    for i in range(20):
        affinity.record(affinity.keys("s", f"{i:08d}".encode() * 4), f"w{i}")
    assert len(affinity._owner) == 10
    assert affinity.owner(affinity.keys("s", f"{19:08d}".encode() * 4)) == "w19"  # the latest stay
    assert affinity.owner(affinity.keys("s", f"{0:08d}".encode() * 4)) is None


def test_prompt_bytes_of_each_kind_of_generation_and_none_for_tensors():
    assert prompt_bytes(wire.GeneratePayload(prompt="héllo"), 4096) == "héllo".encode()
    ids = prompt_bytes(wire.GeneratePayload(prompt_token_ids=[1, 2]), 4096)
    assert ids == (1).to_bytes(8, "little") + (2).to_bytes(8, "little")
    first = [wire.ChatMessage("system", SYSTEM), wire.ChatMessage("user", "hi")]
    turn = prompt_bytes(wire.GeneratePayload(messages=first), 4096)
    later = prompt_bytes(wire.GeneratePayload(messages=[*first, wire.ChatMessage("assistant", "hello")]), 4096)
    assert turn is not None and later is not None and later.startswith(turn) and len(later) > len(turn)
    assert prompt_bytes(wire.TensorPayload("float32", (1, 2), bytes(8)), 4096) is None


def test_prompt_bytes_stop_soon_after_what_affinity_hashes():
    """A long prompt is not encoded whole: only enough of its start for the keys."""
    long = "x" * 100_000
    assert prompt_bytes(wire.GeneratePayload(prompt=long), 4096) == b"x" * 4096
    assert len(prompt_bytes(wire.GeneratePayload(prompt_token_ids=list(range(10_000))), 4096) or b"") == 4096
    many = [wire.ChatMessage("user", f"turn {i}: " + "y" * 500) for i in range(200)]
    chat = prompt_bytes(wire.GeneratePayload(messages=many), 4096)
    assert chat is not None and 4096 <= len(chat) < 4096 + 600


def test_a_replica_failing_in_a_row_is_ejected_for_a_while_longer_each_time():
    from sluice.gateway.router import Ejections

    ejections = Ejections(threshold=3, eject_s=5.0, max_eject_s=12.0)
    key = ("w0", "m", "1")
    assert [ejections.failed(key, 0.0) for _ in range(3)] == [0.0, 0.0, 5.0]
    assert ejections.is_ejected(key, 4.9) and not ejections.is_ejected(key, 5.0)
    assert not ejections.is_ejected(("w0", "m", "2"), 1.0)  # another version on the same worker
    assert [ejections.failed(key, 6.0) for _ in range(3)][-1] == 10.0  # ejected again: twice as long
    assert [ejections.failed(key, 20.0) for _ in range(3)][-1] == 12.0  # up to the cap
    assert ejections.known(21.0) == {key: True} and ejections.known(33.0) == {key: False}
    ejections.succeeded(key)
    assert not ejections.is_ejected(key, 21.0) and ejections.known(21.0) == {}
    assert [ejections.failed(key, 40.0) for _ in range(3)][-1] == 5.0  # a success starts it over


def test_failures_that_are_not_in_a_row_eject_nothing():
    from sluice.gateway.router import Ejections

    ejections = Ejections(threshold=3)
    key = ("w0", "m", "1")
    for _ in range(10):
        ejections.failed(key, 0.0)
        ejections.failed(key, 0.0)
        ejections.succeeded(key)
    assert not ejections.is_ejected(key, 0.0)


def test_ejected_replicas_are_left_out_unless_every_one_is():
    from sluice.gateway.router import Ejections

    ejections = Ejections(threshold=1, eject_s=5.0)
    replicas = [Candidate("w0", 0.0), Candidate("w1", 0.5)]
    assert ejections.healthy(replicas, "m", "1", 0.0) == replicas
    ejections.failed(("w0", "m", "1"), 0.0)
    assert ejections.healthy(replicas, "m", "1", 1.0) == [replicas[1]]
    assert ejections.healthy(replicas, "other", "1", 1.0) == replicas
    ejections.failed(("w1", "m", "1"), 0.0)
    assert ejections.healthy(replicas, "m", "1", 1.0) == replicas  # all ejected: better to try than refuse
    assert ejections.healthy(replicas[:1], "m", "1", 1.0) == replicas[:1]  # the only one: kept
