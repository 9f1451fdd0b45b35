"""Block manager: reference counts, no leaks, prefix sharing and tenant isolation (hypothesis)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.engines.generative.block_manager import BlockManager


def _invariants(bm: BlockManager) -> None:
    counts = [bm.ref_count(b) for b in range(bm.num_blocks)]
    assert min(counts) >= 0
    assert bm.num_free_blocks == counts.count(0)


ops = st.lists(st.tuples(st.sampled_from(["alloc", "grow", "free"]), st.integers(0, 5), st.integers(1, 40)),
               max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops=ops, prefix=st.lists(st.integers(0, 3), min_size=0, max_size=24))
def test_random_operations_keep_ref_counts_sound_and_leak_nothing(ops, prefix):
    bm = BlockManager(num_blocks=16, block_size=4)
    lengths: dict[str, int] = {}
    for op, seq, n in ops:
        sid = f"s{seq}"
        tokens = prefix + [seq] * 40
        if op == "alloc" and sid not in lengths:
            cached = bm.cached_prefix(tokens[:n], salt="t")
            if bm.allocate(sid, n, cached) is not None:
                lengths[sid] = n
                bm.commit(sid, tokens, n, salt="t")
        elif op == "grow" and sid in lengths:
            new = min(lengths[sid] + n, len(tokens))
            if bm.allocate(sid, new) is not None:
                lengths[sid] = new
                bm.commit(sid, tokens, new, salt="t")
        elif op == "free":
            bm.free(sid)
            lengths.pop(sid, None)
        _invariants(bm)
        for s, length in lengths.items():
            assert len(bm.block_table(s)) * 4 >= length
    for sid in list(lengths):
        bm.free(sid)
    assert bm.num_free_blocks == 16 and bm.usage == 0.0


def test_allocation_failure_is_none_and_changes_nothing():
    bm = BlockManager(num_blocks=4, block_size=4)
    assert bm.allocate("a", 12) is not None
    assert bm.allocate("b", 8) is None
    assert bm.block_table("b") == [] and bm.num_free_blocks == 1


def test_shared_prefix_blocks_are_reference_counted():
    bm = BlockManager(num_blocks=8, block_size=4)
    tokens = list(range(10))
    bm.allocate("a", 10)
    bm.commit("a", tokens, 10, salt="")
    hits = bm.cached_prefix([*tokens, 99], salt="")
    assert hits == bm.block_table("a")[:2]
    bm.allocate("b", 11, hits)
    assert [bm.ref_count(b) for b in hits] == [2, 2]
    bm.free("a")
    assert [bm.ref_count(b) for b in hits] == [1, 1]
    bm.free("b")
    assert bm.cached_prefix(tokens, salt="") == hits  # still cached while free, until evicted


def test_commit_says_which_blocks_it_wrote_to_the_cache_not_those_an_equal_block_holds():
    bm = BlockManager(num_blocks=8, block_size=4)
    tokens = list(range(10))
    bm.allocate("a", 10)
    bm.allocate("b", 10)  # the same prompt computed beside it, not read from the cache
    assert bm.commit("a", tokens, 6, salt="") == [0]
    assert bm.commit("a", tokens, 10, salt="") == [1]  # the partial third block is not written
    assert bm.commit("a", tokens, 10, salt="") == []
    assert bm.commit("b", tokens, 10, salt="") == []  # a's blocks stay the cached ones
    assert bm.cached_prefix(tokens, salt="") == bm.block_table("a")[:2]


def test_salt_isolates_tenants():
    bm = BlockManager(num_blocks=8, block_size=4)
    tokens = list(range(12))
    bm.allocate("a", 12)
    bm.commit("a", tokens, 12, salt="tenant-a")
    assert len(bm.cached_prefix([*tokens, 1], salt="tenant-a")) == 3
    assert bm.cached_prefix([*tokens, 1], salt="tenant-b") == []


def test_blocks_with_different_tokens_never_share_a_cache_entry():
    """Python's hash() maps n and n + (2**61 - 1) to the same value: a chain of built-in hashes lets
    a crafted prompt read (or poison) blocks cached for different tokens."""
    bm = BlockManager(num_blocks=8, block_size=4)
    tokens = [5, 6, 7, 8, 9]
    bm.allocate("a", 5)
    bm.commit("a", tokens, 5, salt="")
    crafted = [t + (2**61 - 1) for t in tokens[:4]] + [9]
    assert bm.cached_prefix(crafted, salt="") == []
    assert len(bm.cached_prefix(tokens, salt="")) == 1


def test_whole_prompt_hit_still_leaves_a_token_to_compute():
    bm = BlockManager(num_blocks=8, block_size=4)
    tokens = list(range(8))
    bm.allocate("a", 8)
    bm.commit("a", tokens, 8, salt="")
    assert len(bm.cached_prefix(tokens, salt="")) == 1


def test_eviction_reuses_least_recently_freed_blocks():
    bm = BlockManager(num_blocks=2, block_size=4)
    bm.allocate("a", 4)
    bm.commit("a", [1, 2, 3, 4], 4, salt="")
    bm.free("a")
    bm.allocate("b", 8)  # needs both blocks: the cached one is evicted
    assert bm.cached_prefix([1, 2, 3, 4, 5], salt="") == []
