"""Scheduler on hand-built sequences, no model: budget, caps, preemption order, deadlines, aborts."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.engines.generative.block_manager import BlockManager
from sluice.engines.generative.scheduler import Scheduler, SchedulerConfig
from sluice.engines.generative.sequence import FinishReason, SamplingParams, Sequence, SequenceStatus
from sluice.priority import Priority


def _scheduler(num_blocks=64, block_size=4, max_num_seqs=8, budget=32, chunk=16) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs, budget, chunk), BlockManager(num_blocks, block_size))


def _seq(rid: str, n: int, arrival: float = 0.0, priority=Priority.STANDARD, deadline=None) -> Sequence:
    return Sequence(rid, list(range(1, n + 1)), SamplingParams(max_tokens=100), arrival, priority, deadline)


def _step(s: Scheduler, now: float = 0.0):
    out = s.schedule(now)
    sampled = {c.request_id: 7 for c in out.chunks if c.needs_sample}
    s.update(out, sampled)
    return out


@settings(max_examples=100, deadline=None)
@given(lengths=st.lists(st.integers(1, 60), min_size=1, max_size=20), budget=st.integers(1, 64),
       max_num_seqs=st.integers(1, 6), num_blocks=st.integers(16, 40))
def test_budget_and_seq_cap_hold_and_everything_drains(lengths, budget, max_num_seqs, num_blocks):
    s = _scheduler(num_blocks=num_blocks, max_num_seqs=max_num_seqs, budget=budget)
    seqs = [_seq(f"r{i}", n, arrival=i) for i, n in enumerate(lengths)]
    for seq in seqs:
        s.add(seq)
    for _ in range(5000):
        if not (s.running or s.waiting):
            break
        out = _step(s)
        assert out.num_batched_tokens <= budget
        assert len(s.running) <= max_num_seqs
        for seq in list(s.running):
            if seq.num_output_tokens >= 3:
                s.finish(seq, FinishReason.LENGTH)
    assert not s.running and not s.waiting
    assert s.blocks.num_free_blocks == num_blocks


def test_decodes_come_before_new_prefills_and_long_prompts_are_chunked():
    s = _scheduler(budget=20, chunk=16)
    s.add(_seq("a", 3))
    _step(s)
    s.add(_seq("b", 50))
    out = _step(s)
    assert [(c.request_id, len(c.token_ids)) for c in out.chunks] == [("a", 1), ("b", 16)]


def test_preemption_picks_lowest_class_then_latest_arrival():
    s = _scheduler(num_blocks=6, block_size=4, budget=64, chunk=64)
    hi = _seq("hi", 8, arrival=3, priority=Priority.INTERACTIVE)
    early = _seq("early", 7, arrival=1, priority=Priority.BATCH)
    late = _seq("late", 7, arrival=2, priority=Priority.BATCH)
    for seq in (hi, early, late):
        s.add(seq)
    _step(s)  # 2 + 2 + 2 blocks: full; the next tokens of every sequence need a new block
    assert s.blocks.num_free_blocks == 0
    out = _step(s)
    assert out.num_preempted >= 1
    assert late.status is SequenceStatus.PREEMPTED and late.num_computed_tokens == 0
    assert hi.status is SequenceStatus.RUNNING


def test_waiting_order_is_class_then_deadline():
    s = _scheduler(max_num_seqs=1)
    s.add(_seq("batch", 4, arrival=0, priority=Priority.BATCH))
    s.add(_seq("late-deadline", 4, arrival=1, deadline=50.0))
    s.add(_seq("early-deadline", 4, arrival=2, deadline=10.0))
    s.add(_seq("interactive", 4, arrival=3, priority=Priority.INTERACTIVE))
    assert [q.request_id for q in s.waiting] == ["interactive", "early-deadline", "late-deadline", "batch"]


def test_expired_and_aborted_sequences_free_their_blocks_within_one_step():
    s = _scheduler()
    a, b = _seq("a", 10, deadline=5.0), _seq("b", 10)
    s.add(a)
    s.add(b)
    _step(s, now=0.0)
    assert s.blocks.num_free_blocks < 64
    s.abort("b")
    out = s.schedule(6.0)
    assert {q.request_id: q.finish_reason for q in out.finished} == {"a": FinishReason.DEADLINE,
                                                                     "b": FinishReason.ABORT}
    assert s.blocks.num_free_blocks == 64 and not out.chunks
