"""Which sequences compute how many tokens this step. Pure: no torch, no I/O; time comes in as `now_s`.

One step:

    1. expire   drop waiting and running sequences whose deadline passed (blocks freed now)
    2. running  decodes first (1 token each), then partial prefills (a chunk each), within the
                token budget; when blocks run out, preempt the lowest-class, latest-arrived running
                sequence (free its blocks; it recomputes later) until the allocation fits
    3. waiting  in (class, deadline, arrival) order, while the budget, the sequence cap and the
                free blocks allow; prefix-cache hits skip their tokens; stops at the first that
                does not fit so that order is kept

The result is a `SchedulerOutput`; after the model ran, `update` records what was computed.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from sluice.engines.generative.block_manager import BlockManager
from sluice.engines.generative.sequence import FinishReason, Sequence, SequenceStatus

__all__ = ["ScheduledChunk", "Scheduler", "SchedulerConfig", "SchedulerOutput"]


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    long_prefill_token_threshold: int


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """Compute tokens [start, start + len(token_ids)) of a sequence; sample if it reaches the end."""

    request_id: str
    token_ids: tuple[int, ...]
    start: int
    block_table: tuple[int, ...]
    needs_sample: bool


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    chunks: tuple[ScheduledChunk, ...]
    finished: tuple[Sequence, ...]
    """Sequences that ended inside the scheduler this step (deadline, abort)."""
    num_preempted: int

    @property
    def num_batched_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.blocks = block_manager
        self.waiting: list[Sequence] = []   # kept sorted by queue_key
        self.running: list[Sequence] = []
        self._finished: list[Sequence] = []  # finished between steps (abort), reported next step
        self.num_preemptions_total = 0

    # ---- queue changes -----------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        keys = [s.queue_key() for s in self.waiting]
        self.waiting.insert(bisect.bisect_right(keys, seq.queue_key()), seq)

    def abort(self, request_id: str) -> Sequence | None:
        for queue in (self.running, self.waiting):
            for seq in queue:
                if seq.request_id == request_id:
                    self.finish(seq, FinishReason.ABORT)
                    self._finished.append(seq)
                    return seq
        return None

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Remove a sequence from the queues and free its blocks at once."""
        if seq.is_finished:
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq.request_id)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._finished)

    def discard_finished(self) -> None:
        """Forget sequences finished between steps (their owner has been told otherwise)."""
        self._finished.clear()

    # ---- one step ----------------------------------------------------------------------------

    def schedule(self, now_s: float) -> SchedulerOutput:
        finished, self._finished = self._finished, []
        finished += self._expire(now_s)
        budget = self.config.max_num_batched_tokens
        chunks: dict[str, ScheduledChunk] = {}
        num_preempted = 0
        for seq in sorted(self.running, key=lambda s: (s.is_prefilling, s.victim_key())):
            if seq.status is not SequenceStatus.RUNNING or budget == 0:
                continue
            num_new = self._chunk_size(seq, budget)
            while self.blocks.allocate(seq.request_id, seq.num_computed_tokens + num_new) is None:
                victim = max(self.running, key=Sequence.victim_key)
                self._preempt(victim)
                num_preempted += 1
                dropped = chunks.pop(victim.request_id, None)
                budget += len(dropped.token_ids) if dropped else 0
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                chunks[seq.request_id] = self._chunk(seq, num_new)
                budget -= num_new
        if num_preempted == 0:
            budget = self._admit_waiting(budget, chunks)
        return SchedulerOutput(tuple(chunks.values()), tuple(finished), num_preempted)

    def _admit_waiting(self, budget: int, chunks: dict[str, ScheduledChunk]) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            cached = self.blocks.cached_prefix(seq.all_token_ids, seq.salt)
            num_cached = len(cached) * self.blocks.block_size
            seq.num_computed_tokens = num_cached
            num_new = self._chunk_size(seq, budget)
            if self.blocks.allocate(seq.request_id, num_cached + num_new, cached) is None:
                seq.num_computed_tokens = 0
                break
            self.blocks.record_query(seq.num_tokens, num_cached)
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = num_cached
            self.waiting.pop(0)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            chunks[seq.request_id] = self._chunk(seq, num_new)
            budget -= num_new
        return budget

    def _chunk_size(self, seq: Sequence, budget: int) -> int:
        remaining = seq.num_tokens - seq.num_computed_tokens
        return min(remaining, budget, self.config.long_prefill_token_threshold)

    def _chunk(self, seq: Sequence, num_new: int) -> ScheduledChunk:
        start = seq.num_computed_tokens
        return ScheduledChunk(
            request_id=seq.request_id,
            token_ids=tuple(seq.all_token_ids[start:start + num_new]),
            start=start,
            block_table=tuple(self.blocks.block_table(seq.request_id)),
            needs_sample=start + num_new == seq.num_tokens,
        )

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq.request_id)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions_total += 1
        self.add(seq)
        seq.status = SequenceStatus.PREEMPTED

    def _expire(self, now_s: float) -> list[Sequence]:
        expired = [s for s in self.running + self.waiting if s.deadline_s is not None and s.deadline_s <= now_s]
        for seq in expired:
            self.finish(seq, FinishReason.DEADLINE)
        return expired

    # ---- after the model ran -------------------------------------------------------------------

    def update(self, output: SchedulerOutput, sampled: dict[str, int]) -> list[Sequence]:
        """Record computed tokens and append sampled ones; returns the sequences that got a token."""
        by_id = {s.request_id: s for s in self.running}
        advanced: list[Sequence] = []
        for chunk in output.chunks:
            seq = by_id.get(chunk.request_id)
            if seq is None:  # finished meanwhile
                continue
            seq.num_computed_tokens = chunk.start + len(chunk.token_ids)
            self.blocks.commit(seq.request_id, seq.all_token_ids, seq.num_computed_tokens, seq.salt)
            token = sampled.get(chunk.request_id)
            if token is not None:
                seq.append(token)
                advanced.append(seq)
        return advanced
