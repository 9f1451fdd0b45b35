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


def _seq(rid: str, n: int, arrival: float = 0.0, priority=Priority.STANDARD, deadline=None, first: int = 1) -> Sequence:
    """`first`: the prompt's first token id (prompts from different ones share no cached prefix)."""
    return Sequence(rid, list(range(first, first + n)), SamplingParams(max_tokens=100), arrival, priority, deadline)


def _step(s: Scheduler, now: float = 0.0):
    out = s.schedule(now)
    sampled = {c.request_id: 7 for c in out.chunks if c.needs_sample}
    s.update(out, sampled)
    return out


@settings(max_examples=100, deadline=None)
@given(lengths=st.lists(st.integers(1, 60), min_size=1, max_size=20), budget=st.integers(1, 64),
       max_num_seqs=st.integers(1, 6), num_blocks=st.integers(16, 40),
       classes=st.lists(st.sampled_from(list(Priority)), min_size=20, max_size=20), arrive_every=st.integers(0, 3))
def test_budget_and_seq_cap_hold_and_everything_drains(lengths, budget, max_num_seqs, num_blocks, classes,
                                                       arrive_every):
    """Sequences of every class, arriving together or a few steps apart (so that higher classes
    arrive to find lower ones running, and preempt them): nothing is lost, nothing livelocks."""
    s = _scheduler(num_blocks=num_blocks, max_num_seqs=max_num_seqs, budget=budget)
    seqs = [_seq(f"r{i}", n, arrival=i, priority=classes[i]) for i, n in enumerate(lengths)]
    arrivals = list(seqs)
    for step in range(5000):
        while arrivals and (arrive_every == 0 or step >= arrivals[0].arrival_s * arrive_every):
            s.add(arrivals.pop(0))
        if not (s.running or s.waiting or arrivals):
            break
        out = _step(s)
        assert out.num_batched_tokens <= budget
        assert len(s.running) <= max_num_seqs
        for seq in list(s.running):
            if seq.num_output_tokens >= 3:
                s.finish(seq, FinishReason.LENGTH)
    assert not s.running and not s.waiting and not arrivals
    assert all(seq.status is SequenceStatus.FINISHED for seq in seqs)
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
    hi = _seq("hi", 7, arrival=3, priority=Priority.INTERACTIVE, first=100)
    early = _seq("early", 7, arrival=1, priority=Priority.BATCH)
    late = _seq("late", 7, arrival=2, priority=Priority.BATCH, first=50)
    s.add(early)
    s.add(late)
    _step(s)
    s.add(hi)
    _step(s)  # 2 + 2 + 2 blocks: full; the next tokens of every sequence need a new block
    assert s.blocks.num_free_blocks == 0 and hi.status is SequenceStatus.RUNNING
    out = _step(s)
    assert out.num_preempted >= 1
    assert late.status is SequenceStatus.PREEMPTED and late.num_computed_tokens == 0
    assert hi.status is SequenceStatus.RUNNING


def test_a_higher_class_takes_the_slot_of_the_latest_lower_class_sequence():
    s = _scheduler(max_num_seqs=3, budget=64, chunk=64)
    jobs = [_seq(f"job{i}", 6, arrival=i, priority=Priority.BATCH) for i in range(4)]
    for seq in jobs:
        s.add(seq)
    _step(s)
    assert [q.request_id for q in s.running] == ["job0", "job1", "job2"]
    chat = _seq("chat", 5, arrival=5, priority=Priority.INTERACTIVE, first=100)
    s.add(chat)
    out = _step(s)
    assert chat.status is SequenceStatus.RUNNING
    assert ("chat", 5) in [(c.request_id, len(c.token_ids)) for c in out.chunks]
    assert jobs[2].status is SequenceStatus.PREEMPTED and jobs[2].num_computed_tokens == 0
    assert "job2" not in [c.request_id for c in out.chunks]  # its decode this step was dropped
    assert out.num_preempted == 1 and [q.request_id for q in s.waiting] == ["job2", "job3"]


def test_a_higher_class_takes_blocks_from_lower_ones_but_never_a_classs_earliest():
    s = _scheduler(num_blocks=6, block_size=4, max_num_seqs=8, budget=64, chunk=64)
    jobs = [_seq(f"job{i}", 6, arrival=i, priority=Priority.BATCH) for i in range(3)]
    for seq in jobs:
        s.add(seq)
    _step(s)  # 2 blocks each: the cache is full
    assert s.blocks.num_free_blocks == 0
    chat = _seq("chat", 12, arrival=5, priority=Priority.INTERACTIVE, first=100)  # needs 3 blocks
    s.add(chat)
    out = _step(s)
    assert chat.status is SequenceStatus.RUNNING
    assert out.num_preempted == 2  # job2, then job1 (job0 is the class's earliest)
    assert [j.status for j in jobs] == [SequenceStatus.RUNNING, SequenceStatus.PREEMPTED, SequenceStatus.PREEMPTED]
    assert [c.request_id for c in out.chunks] == ["job0", "chat"]  # no job prompt beside the chat's
    s.add(_seq("chat2", 4, arrival=6, priority=Priority.INTERACTIVE, first=200))
    _step(s)
    assert jobs[0].status is SequenceStatus.RUNNING  # the batch class's earliest runs to its end


def test_a_higher_class_prompt_goes_before_a_lower_class_prompt_already_running():
    s = _scheduler(budget=16, chunk=16)
    job = _seq("job", 64, arrival=0, priority=Priority.BATCH)
    s.add(job)
    _step(s)  # the first of its four prompt chunks
    s.add(_seq("chat", 16, arrival=1, priority=Priority.INTERACTIVE, first=100))
    out = _step(s)
    assert [(c.request_id, len(c.token_ids)) for c in out.chunks] == [("chat", 16)]
    out = _step(s)  # the chat decodes, the job's prompt goes on with the rest of the budget
    assert [(c.request_id, len(c.token_ids)) for c in out.chunks] == [("chat", 1), ("job", 15)]


def test_a_lower_class_prompt_is_held_out_of_a_step_that_computes_a_higher_class_prompt():
    s = _scheduler(budget=64, chunk=32)
    job = _seq("job", 96, arrival=0, priority=Priority.BATCH)
    s.add(job)
    _step(s)
    s.add(_seq("chat", 16, arrival=1, priority=Priority.INTERACTIVE, first=100))
    out = _step(s)  # the chat's first token comes at the end of a step of 16 tokens, not 64
    assert [(c.request_id, len(c.token_ids)) for c in out.chunks] == [("chat", 16)]
    out = _step(s)
    assert [(c.request_id, len(c.token_ids)) for c in out.chunks] == [("chat", 1), ("job", 32)]


def test_while_a_higher_class_runs_lower_classes_compute_one_chunk_of_prompt_per_step():
    def job_prompt_tokens(with_chat: bool) -> list[int]:
        s = _scheduler(budget=64, chunk=16)
        if with_chat:
            s.add(_seq("chat", 4, priority=Priority.INTERACTIVE, first=100))
            _step(s)
        for i in range(2):
            s.add(_seq(f"job{i}", 48, arrival=1 + i, priority=Priority.BATCH, first=200 + 100 * i))
        return [sum(len(c.token_ids) for c in _step(s).chunks if c.request_id.startswith("job")) for _ in range(3)]

    assert job_prompt_tokens(with_chat=False) == [32, 32, 32]  # a chunk each
    assert job_prompt_tokens(with_chat=True) == [16, 16, 16]  # one chunk between them: short steps for the chat


def test_an_equal_or_higher_class_is_never_preempted_for_admission():
    s = _scheduler(max_num_seqs=1)
    first = _seq("first", 4, arrival=0, priority=Priority.STANDARD)
    s.add(first)
    _step(s)
    s.add(_seq("same", 4, arrival=1, priority=Priority.STANDARD))
    s.add(_seq("lower", 4, arrival=2, priority=Priority.BATCH))
    out = _step(s)
    assert out.num_preempted == 0 and s.running == [first]


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
