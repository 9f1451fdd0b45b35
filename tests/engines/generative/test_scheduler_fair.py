"""The generative scheduler's order across tenants and classes, and its early refusal, on hand-built
sequences under a virtual clock: weighted shares of the tokens computed, a flooding tenant does not
hold back a light one, a lower class is admitted within its starvation bound, earliest deadline
first within a tenant, no credit banked while idle, refusal on a tenant's own backlog."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable

import pytest

from sluice.engines.generative.block_manager import BlockManager
from sluice.engines.generative.scheduler import Scheduler, SchedulerConfig
from sluice.engines.generative.sequence import FinishReason, SamplingParams, Sequence, SequenceStatus
from sluice.priority import Priority

INTER, STD, BAT = Priority.INTERACTIVE, Priority.STANDARD, Priority.BATCH
STEP_S = 0.01


def _scheduler(max_num_seqs: int = 4, budget: int = 64, num_blocks: int = 256) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs, budget, 32), BlockManager(num_blocks, 4))


class Run:
    """Steps a scheduler on a virtual clock like the engine would, finishing each sequence after
    `max_tokens` outputs, and records what was admitted when and whose tokens were computed."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.s = scheduler
        self.now = 0.0
        self.ids = itertools.count()
        self.admitted: list[Sequence] = []
        self.admitted_at: dict[str, float] = {}
        self.tokens: Counter[str] = Counter()
        self.class_tokens: Counter[Priority] = Counter()

    def add(self, tenant: str, priority: Priority = STD, *, prompt: int = 8, max_tokens: int = 8,
            deadline: float | None = None) -> Sequence:
        seq = Sequence(f"{tenant}-{next(self.ids)}", list(range(1, prompt + 1)), SamplingParams(max_tokens=max_tokens),
                       self.now, priority, deadline, tenant)
        self.s.add(seq)
        return seq

    def step(self, on_admit: Callable[[Sequence], None] = lambda seq: None) -> None:
        waiting = set(self.s.waiting)
        out = self.s.schedule(self.now)
        for seq in self.s.running:
            if seq in waiting and seq.request_id not in self.admitted_at:
                self.admitted.append(seq)
                self.admitted_at[seq.request_id] = self.now
                on_admit(seq)
        by_id = {seq.request_id: seq for seq in self.s.running}
        for chunk in out.chunks:
            self.tokens[by_id[chunk.request_id].tenant] += len(chunk.token_ids)
            self.class_tokens[by_id[chunk.request_id].priority] += len(chunk.token_ids)
        self.s.update(out, {c.request_id: 7 for c in out.chunks if c.needs_sample})
        for seq in list(self.s.running):
            if seq.num_output_tokens >= seq.params.max_tokens:
                self.s.finish(seq, FinishReason.LENGTH)
        self.now += STEP_S

    def steps(self, num_steps: int, on_admit: Callable[[Sequence], None] = lambda seq: None) -> None:
        for _ in range(num_steps):
            self.step(on_admit)


def test_backlogged_tenants_share_the_tokens_computed_by_weight():
    run = Run(_scheduler())
    run.s.set_tenant_weights({"light": 1.0, "heavy": 3.0})
    for _ in range(200):
        run.add("light")
        run.add("heavy")
    run.steps(300)
    assert {seq.tenant for seq in run.s.waiting} == {"light", "heavy"}  # both backlogged throughout
    share = run.tokens["light"] / (run.tokens["light"] + run.tokens["heavy"])
    assert 0.22 <= share <= 0.28  # 1:3
    admitted = Counter(seq.tenant for seq in run.admitted)
    assert 0.2 <= admitted["light"] / len(run.admitted) <= 0.3


def test_a_flooding_tenant_does_not_hold_back_a_light_tenants_request():
    run = Run(_scheduler())
    for i in range(100):
        run.add("flood", deadline=100.0 + i)
    run.steps(20)
    light = run.add("light", deadline=1000.0)  # a later deadline than every queued flood request
    run.steps(10)  # a flood sequence lives 9 steps (1 prefill + 8 decodes): a slot frees within that
    assert light.request_id in run.admitted_at
    assert sum(seq.tenant == "flood" for seq in run.s.waiting) > 50


def test_a_batch_sequence_is_admitted_within_its_bound_under_an_interactive_flood():
    run = Run(_scheduler(max_num_seqs=8))
    lengths = itertools.cycle([4, 11, 7, 16, 5, 9, 13])
    for _ in range(16):
        run.add("chat", INTER, prompt=24, max_tokens=next(lengths))
    batch = [run.add("jobs", BAT, max_tokens=16) for _ in range(200)]

    def keep_flooding(seq: Sequence) -> None:
        if seq.priority is INTER:
            run.add("chat", INTER, prompt=24, max_tokens=next(lengths))

    run.steps(20, keep_flooding)
    # owed its 5% as soon as one step ran without it, batch takes the next free slot
    assert batch[0].request_id in run.admitted_at
    run.steps(2000, keep_flooding)
    share = run.class_tokens[BAT] / run.class_tokens.total()
    assert 0.045 <= share <= 0.06  # its minimum share, and no more: interactive still goes first
    assert any(seq.priority is INTER for seq in run.s.waiting)


def test_earliest_deadline_first_within_a_tenant():
    run = Run(_scheduler(max_num_seqs=1))
    a = {deadline: run.add("a", deadline=deadline) for deadline in (90.0, 30.0, 60.0, 45.0)}
    for _ in range(4):
        run.add("b", deadline=10.0)
    run.steps(100)
    order = [seq for seq in run.admitted if seq.tenant == "a"]
    assert order == [a[30.0], a[45.0], a[60.0], a[90.0]]
    assert [seq.tenant for seq in run.admitted[:4]] in (["a", "b", "a", "b"], ["b", "a", "b", "a"])


def test_an_idle_tenant_banks_no_credit():
    run = Run(_scheduler())
    for _ in range(400):
        run.add("busy")
    run.steps(300)  # "late" had nothing waiting all this time
    before = len(run.admitted)
    for _ in range(40):
        run.add("late")
    run.steps(90)
    after = Counter(seq.tenant for seq in run.admitted[before:])
    assert after["late"] >= 10  # it shares at once ...
    assert after["busy"] >= 0.8 * after["late"]  # ... but earns no burst for the time it idled


def test_preempted_sequences_wait_again_in_fair_order():
    run = Run(_scheduler(max_num_seqs=8, num_blocks=12))
    for _ in range(6):
        run.add("a", prompt=12, max_tokens=12)
    for _ in range(6):
        run.add("b", prompt=12, max_tokens=12)
    run.steps(400)
    assert not run.s.has_unfinished()
    assert run.s.num_preemptions_total > 0
    assert run.s.blocks.num_free_blocks == 12


def test_a_flood_is_refused_on_its_own_backlog_and_what_is_taken_finishes_in_time():
    run = Run(_scheduler(max_num_seqs=2))  # ~21 steps a sequence: about 9.5 admissions a second
    seqs: list[Sequence] = []
    for i in range(1000):  # 30 a second, with 2 s to be admitted in: ~3x what it can take
        if i % 10 in (0, 3, 6):
            seqs.append(run.add("flood", max_tokens=20, deadline=run.now + 2.0))
        if i == 800:
            light = run.add("light", max_tokens=20, deadline=run.now + 2.0)
        run.step()
    outcomes = Counter(seq.finish_reason for seq in seqs)
    assert outcomes[FinishReason.REFUSED] > len(seqs) / 2
    # what it takes mostly finishes in time (unrefused, 28 finish and over 200 expire)
    assert outcomes[FinishReason.LENGTH] > 3 * outcomes[FinishReason.DEADLINE]
    assert light.finish_reason is FinishReason.LENGTH
    assert 8 < run.s.rates.admitted_per_s < 13 and run.s.rates.step_s == pytest.approx(STEP_S)


def test_nothing_is_refused_before_a_second_of_backlog_is_measured():
    run = Run(_scheduler(max_num_seqs=1))  # ~8 steps a sequence: ~12 admissions a second
    for _ in range(200):
        run.add("a", deadline=5.0)
    run.steps(50)  # half a second of backlog: the admission rate is not trusted yet
    early = run.add("a", deadline=5.0)  # behind ~190 of its tenant's: hopeless, but not yet known
    assert early.status is SequenceStatus.WAITING
    run.steps(60)  # over a second of backlog now
    late = run.add("a", deadline=5.0)
    assert late.finish_reason is FinishReason.REFUSED


def test_a_refused_request_is_told_when_the_same_request_would_be_taken():
    run = Run(_scheduler(max_num_seqs=1))  # ~8 steps a sequence: ~12 admissions a second
    for _ in range(400):  # more than can be admitted before their deadline: the queue reaches it
        run.add("a", deadline=10.0)
    run.steps(120)  # over a second of backlog measured
    slo_s = 10.0 - run.now  # due with them, behind them: admitted about then, done too late
    refused = run.add("a", deadline=run.now + slo_s)
    assert refused.finish_reason is FinishReason.REFUSED
    retry_after_s = refused.retry_after_s
    assert retry_after_s is not None and 0.05 < retry_after_s < 0.5  # about its own 8 steps
    run.steps(round(retry_after_s / 2 / STEP_S))  # half way: still too early
    assert run.add("a", deadline=run.now + slo_s).finish_reason is FinishReason.REFUSED
    run.steps(round(retry_after_s / 2 / STEP_S) + 1)  # retried when told: taken
    assert run.add("a", deadline=run.now + slo_s).status is SequenceStatus.WAITING
