"""The paged KV cache's bookkeeping: fixed-size blocks, reference counts and the prefix cache.

Pure (no torch): it hands out block ids; the model runner owns the tensor they index.

    block table of a sequence (block_size = 4):
        tokens   [t0 t1 t2 t3][t4 t5 t6 t7][t8 t9 .. ..]
        blocks   [    17     ][     3     ][     42    ]   <- full blocks are hashed and shareable
    slot of token i = table[i // block_size] * block_size + i % block_size

Prefix caching: a full block's key is SHA-256(previous block's key || its token ids as 8-byte
integers), the chain starting from SHA-256 of the tenant's salt, so equal prefixes of one tenant map
to the same blocks and another tenant's never do. The hash is cryptographic so that nobody can craft
a prompt whose blocks collide with another user's and poison what they read (Python's `hash()` of
a tuple is not collision-resistant: vLLM's CVE-2025-25183). Each full block is hashed once per
admission: lookups stop at the first miss, and a sequence's committed hashes are kept.

A block whose reference count drops to 0 stays in the cache, evictable, in an LRU free list;
allocation takes the least recently freed block and forgets its hash.

Invariants: ref_count >= 0; a block is in the free list iff its ref_count is 0; every block id is
in exactly one of {free list, some table}. Running out of blocks is a `None` return, never an
exception.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass

__all__ = ["BlockHash", "BlockManager", "PrefixCacheStats", "chain_hashes"]


@dataclass(frozen=True, slots=True)
class PrefixCacheStats:
    num_query_tokens: int
    num_hit_tokens: int


BlockHash = bytes
"""A full block's SHA-256 chain digest."""


def salt_hash(salt: str) -> BlockHash:
    """The chain's start for one tenant."""
    return hashlib.sha256(b"sluice-prefix\0" + salt.encode()).digest()


def iter_hashes(token_ids: Seq[int], block_size: int, parent: BlockHash, start: int = 0) -> Iterator[BlockHash]:
    """Chain hashes of the full blocks of `token_ids` from block `start`, `parent` being block
    `start - 1`'s hash (or the salt's). Lazy: a lookup that misses early hashes no further."""
    for i in range(start, len(token_ids) // block_size):
        block = array("q", token_ids[i * block_size:(i + 1) * block_size]).tobytes()
        parent = hashlib.sha256(parent + block).digest()
        yield parent


def chain_hashes(token_ids: Seq[int], block_size: int, salt: str, start: list[BlockHash] | None = None
                 ) -> list[BlockHash]:
    """Hashes of the full blocks of `token_ids`, extending `start` (the already hashed blocks)."""
    hashes = list(start or [])
    parent = hashes[-1] if hashes else salt_hash(salt)
    hashes.extend(iter_hashes(token_ids, block_size, parent, len(hashes)))
    return hashes


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._block_hash: dict[int, BlockHash] = {}   # block id -> its chain hash, for cached blocks
        self._cached: dict[BlockHash, int] = {}       # chain hash -> block id
        self._tables: dict[str, list[int]] = {}
        self._hashes: dict[str, list[BlockHash]] = {}  # per sequence: chain hashes of its committed blocks
        self._num_query_tokens = 0
        self._num_hit_tokens = 0

    # ---- queries -----------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some sequence (cached-but-free blocks count as free)."""
        return 1.0 - len(self._free) / self.num_blocks

    def block_table(self, seq_id: str) -> list[int]:
        return self._tables.get(seq_id, [])

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(self._num_query_tokens, self._num_hit_tokens)

    def blocks_needed(self, seq_id: str, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - len(self._tables.get(seq_id, ())))

    # ---- prefix cache --------------------------------------------------------------------------

    def cached_prefix(self, token_ids: Seq[int], salt: str) -> list[int]:
        """Block ids caching the longest run of full blocks of `token_ids`. Changes nothing.

        At least the last token is left out, so the model always computes one token (its logits)."""
        hits: list[int] = []
        for block_hash in iter_hashes(token_ids[:len(token_ids) - 1], self.block_size, salt_hash(salt)):
            block_id = self._cached.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def record_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self._num_query_tokens += num_query_tokens
        self._num_hit_tokens += num_hit_tokens

    # ---- allocation ----------------------------------------------------------------------------

    def allocate(self, seq_id: str, num_tokens: int, cached: Seq[int] = ()) -> list[int] | None:
        """Make `seq_id`'s table cover `num_tokens` tokens, first sharing the `cached` blocks
        (only when the table is empty). Returns the newly taken blocks, or None if not enough are free
        (then nothing changed)."""
        table = self._tables.get(seq_id)
        if table and cached:
            raise ValueError("cached blocks can only start an empty table")
        num_cached_free = sum(1 for b in cached if self._ref_counts[b] == 0)
        num_fresh = max(0, -(-num_tokens // self.block_size) - len(table or ()) - len(cached))
        if num_fresh + num_cached_free > len(self._free):
            return None
        if table is None:
            table = self._tables[seq_id] = []
        for block_id in cached:
            if self._ref_counts[block_id] == 0:
                del self._free[block_id]
            self._ref_counts[block_id] += 1
            table.append(block_id)
        if cached:
            self._hashes[seq_id] = [self._block_hash[b] for b in cached]
        fresh = [self._take_free_block() for _ in range(num_fresh)]
        table.extend(fresh)
        return list(cached) + fresh

    def _take_free_block(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block_hash = self._block_hash.pop(block_id, None)
        if block_hash is not None and self._cached.get(block_hash) == block_id:
            del self._cached[block_hash]
        assert self._ref_counts[block_id] == 0
        self._ref_counts[block_id] = 1
        return block_id

    def commit(self, seq_id: str, token_ids: Seq[int], num_computed_tokens: int, salt: str) -> list[int]:
        """Register the sequence's newly full, computed blocks in the prefix cache; returns the
        positions in its table of those it wrote there (not those an equal block held already)."""
        table = self._tables[seq_id]
        done = self._hashes.setdefault(seq_id, [])
        num_full = num_computed_tokens // self.block_size
        if num_full <= len(done):
            return []
        hashes = chain_hashes(token_ids[:num_full * self.block_size], self.block_size, salt, done)
        written = []
        for i in range(len(done), num_full):
            block_id = table[i]
            canonical = self._cached.setdefault(hashes[i], block_id)  # an equal block cached earlier stays canonical
            if canonical == block_id:
                written.append(i)
            self._block_hash.setdefault(block_id, hashes[i])
        self._hashes[seq_id] = hashes
        return written

    def free(self, seq_id: str) -> None:
        """Drop a sequence's references; blocks reaching 0 become evictable, tail blocks first."""
        table = self._tables.pop(seq_id, [])
        self._hashes.pop(seq_id, None)
        for block_id in reversed(table):
            self._ref_counts[block_id] -= 1
            assert self._ref_counts[block_id] >= 0
            if self._ref_counts[block_id] == 0:
                self._free[block_id] = None
