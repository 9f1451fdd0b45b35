"""Which sequences compute how many tokens this step. Pure: no torch, no I/O; time comes in as `now_s`.

One step:

    1. expire   drop waiting and running sequences whose deadline passed (blocks freed now)
    2. running  decodes first (1 token each), then partial prefills (a chunk each, the tenant with
                the smallest tag first), within the token budget; when blocks run out, preempt the
                lowest-class, latest-arrived running sequence (free its blocks; it recomputes
                later) until the allocation fits. Partial prefills of a class below a waiting
                sequence's are held until after step 3, and then take the budget it leaves
                only if no higher-class prompt is computed in this step. While a higher class
                is running or waiting, lower classes compute at most one chunk of prompt tokens
                (`long_prefill_token_threshold`) per step between them
    3. waiting  admit in fair order (below) while the budget, the sequence cap and the free blocks
                allow, and no prompt of a higher class is computed in this step; prefix-cache
                hits skip their tokens; a sequence that does not fit for want
                of a slot or of blocks preempts running sequences of a lower class (the lowest,
                latest-arrived first; never a class's earliest) until it fits; stops at the
                first that still does not fit, so that a sequence whose turn it is is not
                overtaken
    4. charge   every token computed to its sequence's tenant and class

The fair order is the one-shot batcher's (`sluice.scheduler.fair`), with tokens computed for
device-seconds. Class: strict priority (interactive, standard, batch), except that a waiting lower
class owed its minimum share of the tokens computed (`ClassShares`: standard 10%, batch 5%) goes
first, one sequence per step, so no class starves under a flood of a higher one. Tenant: within the
class, start-time fair queueing: each token a step computes for a sequence (prompt tokens at
prefill, recomputation after a preemption, each decoded token) advances its tenant's tag by 1 /
its weight, and the tenant with the smallest tag goes next; a tenant with nothing waiting in the
class comes back no lower than the class's virtual time (`FairShare.activate`), so idling banks
no credit. Sequence: that tenant's earliest deadline, then earliest arrival. The tenant is
`Sequence.tenant`; weights come from `set_tenant_weights`.

Preempting for a higher class: without it, a lower class that filled the KV cache or the
sequence slots (a batch job's generations, sent in the batch class) would hold an interactive request
back until some of its sequences finished, each up to its whole output. The victim loses what it
computed (it recomputes when readmitted; the latest-arrived has the least to lose), and once a
step has preempted for admission the rest of its admissions follow strict priority, so a victim is
not readmitted in the same step on its class's owed share. Each class's earliest-arrived running
sequence is never a victim of admission: it runs to its end, so the sequence a class's owed share
let in is not undone by the next higher-class arrival, and the minimum share still bounds how long
a lower class waits (a victim that was always preempted before finishing would never finish).

Early refusal (`add`): a new sequence is refused (finished at once with `FinishReason.REFUSED`,
which the worker answers 503 with Retry-After) when it would wait behind its tenant's sequences
and then not finish by its deadline. Its wait: its tenant's sequences that go before it (same
class, deadline no later), less the free sequence slots, admitted one by one at the measured
admission rate (those whose deadline passes first expire instead, taking no time). Then it needs
its prefill chunks and `max_tokens - 1` more steps at the measured step time. Only sequences
certain to go first count, and one tenant is given the whole engine's admission rate, so the wait
is never overestimated; `max_tokens` is an upper bound on the decode (a sequence may stop sooner),
which is why nothing is refused that is not held back by a queue: a lone sequence that may be too
long still runs. Nothing is refused until 1 s of backlog has been measured (`EngineRates`). A
tenant that floods the engine is so refused on its own backlog while other tenants' requests are
still taken, and what is taken is admitted in time to finish.

The result is a `SchedulerOutput`; after the model ran, `update` records what was computed.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from sluice.engines.generative.block_manager import BlockManager
from sluice.engines.generative.sequence import FinishReason, Sequence, SequenceStatus
from sluice.priority import Priority
from sluice.scheduler.fair import DEFAULT_MIN_CLASS_SHARES, ClassShares, FairShare

__all__ = ["EngineRates", "ScheduledChunk", "Scheduler", "SchedulerConfig", "SchedulerOutput"]

Flow = tuple[Priority, str]


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
    """Sequences that ended inside the scheduler this step (deadline, abort, refusal)."""
    num_preempted: int

    @property
    def num_batched_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)


class EngineRates:
    """How fast the engine goes, measured from the steps' times: sequences admitted per second
    while sequences were left waiting (how fast the waiting queue drains), and seconds per step
    while sequences ran (one decoded token each). Both decay over ~`tau_s`; the admission rate is
    None until `min_observed_s` of backlog has been seen, the step time until a step has."""

    def __init__(self, tau_s: float = 10.0, min_observed_s: float = 1.0) -> None:
        self._tau_s = tau_s
        self._min_observed_s = min_observed_s
        self._num_admitted = 0.0
        self._backlog_s = 0.0
        self._step_s: float | None = None
        self._last_s: float | None = None
        self._was_backlogged = False

    def observe(self, now_s: float, was_running: bool, num_admitted: int, is_backlogged: bool) -> None:
        """A step at `now_s`, after one that left sequences running (`was_running`: the engine
        stepped on at once, so the time between is a step's), admitted `num_admitted` sequences and
        left some waiting (`is_backlogged`) or not. The time since the last step counts towards the
        admission rate if that one left sequences waiting (the engine stepped on then too)."""
        if self._last_s is not None:
            interval_s = max(now_s - self._last_s, 0.0)
            if self._was_backlogged:
                decay = math.exp(-interval_s / self._tau_s)
                self._num_admitted = self._num_admitted * decay + num_admitted
                self._backlog_s = self._backlog_s * decay + interval_s
            if was_running:
                step_s = self._step_s
                self._step_s = interval_s if step_s is None else step_s + 0.1 * (interval_s - step_s)
        self._last_s = now_s
        self._was_backlogged = is_backlogged

    @property
    def admitted_per_s(self) -> float | None:
        if self._backlog_s < self._min_observed_s:
            return None
        return self._num_admitted / self._backlog_s

    @property
    def step_s(self) -> float | None:
        return self._step_s


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, *,
                 min_class_shares: Mapping[Priority, float] = DEFAULT_MIN_CLASS_SHARES) -> None:
        self.config = config
        self.blocks = block_manager
        self.waiting: list[Sequence] = []   # kept sorted by queue_key: class, deadline, arrival
        self.running: list[Sequence] = []
        self._finished: list[Sequence] = []  # finished between steps (abort, refusal), reported next step
        self.num_preemptions_total = 0
        self._fair = FairShare()
        # debt kept up to a step's worth of tokens: about one sequence's prefill, whose service
        # is recorded step by step (see ClassShares)
        self._class_shares = ClassShares(min_class_shares, max_debt_s=config.max_num_batched_tokens)
        self.rates = EngineRates()
        self._top_class: Priority | None = None
        """The highest class running or waiting as this step is formed."""
        self._lower_prompt_left = config.long_prefill_token_threshold
        """Prompt tokens lower classes may still compute in this step (one chunk in all)."""

    def set_tenant_weights(self, weights: Mapping[str, float], *, default_weight: float = 1.0) -> None:
        """Tenants' fair-share weights; tenants not named get `default_weight`. May be called from
        another thread: the weights are replaced in one assignment, read at the next choice."""
        self._fair.set_weights(weights, default_weight=default_weight)

    # ---- queue changes -----------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence, or refuse it at once (see the module's docstring)."""
        late_s = self._late_s(seq)
        if late_s is not None and late_s > 0:
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = FinishReason.REFUSED
            rate = self.rates.admitted_per_s
            seq.retry_after_s = late_s + (1.0 / rate if rate else 0.0)  # + the queue's granularity
            self._finished.append(seq)
            return
        self._enqueue(seq)

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

    def _enqueue(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        if not any(s.priority == seq.priority and s.tenant == seq.tenant for s in self.waiting):
            self._fair.activate(seq.priority, seq.tenant)
        keys = [s.queue_key() for s in self.waiting]
        self.waiting.insert(bisect.bisect_right(keys, seq.queue_key()), seq)

    def _late_s(self, seq: Sequence) -> float | None:
        """How long after its deadline it would finish, waiting behind its tenant's sequences
        (None: nothing holds it back, or nothing is measured yet). It is also about how long
        until the same request would fit, if nothing else arrived: the queue ahead of it is
        admitted meanwhile and its deadline is as much later; to within one admission interval,
        as the queue is admitted a sequence at a time."""
        rate, step_s = self.rates.admitted_per_s, self.rates.step_s
        if seq.deadline_s is None or rate is None or step_s is None:
            return None
        admitted_at = self._admitted_at(seq, rate)
        if admitted_at is None:
            return None
        num_prefill_steps = -(-seq.num_prompt_tokens // self.config.long_prefill_token_threshold)
        return admitted_at + (num_prefill_steps + seq.params.max_tokens - 1) * step_s - seq.deadline_s

    def _admitted_at(self, seq: Sequence, rate: float) -> float | None:
        """When a new sequence would be admitted behind its tenant's sequences that go first
        (same class, deadline no later): the free slots take the first of them at once, the rest
        go one by one at `rate`, except those whose deadline passes first (they expire, taking no
        time). None if nothing holds it back."""
        key = seq.queue_key()
        ahead = [s for s in self.waiting
                 if s.priority == seq.priority and s.tenant == seq.tenant and s.queue_key() <= key]
        at_s = seq.arrival_s
        is_held_back = False
        for other in ahead[max(self.config.max_num_seqs - len(self.running), 0):]:
            if other.deadline_s is not None and other.deadline_s <= at_s:
                continue
            if rate <= 0:
                return math.inf
            at_s += 1.0 / rate
            is_held_back = True
        return at_s if is_held_back else None

    # ---- one step ----------------------------------------------------------------------------

    def schedule(self, now_s: float) -> SchedulerOutput:
        was_running = bool(self.running)
        finished, self._finished = self._finished, []
        finished += self._expire(now_s)
        chunks: dict[str, ScheduledChunk] = {}
        charged: set[str] = set()
        self._top_class = min((s.priority for s in (*self.running, *self.waiting)), default=None)
        self._lower_prompt_left = self.config.long_prefill_token_threshold
        held = self._held_prefills()
        budget, num_preempted = self._schedule_running(chunks, self.config.max_num_batched_tokens, held)
        self._charge_new(chunks, charged)
        num_admitted = 0
        if num_preempted == 0:
            budget, num_admitted, num_admission_preempted = self._admit_waiting(budget, chunks, charged)
            num_preempted += num_admission_preempted
            self._charge_new(chunks, charged)
        prompt_class = self._prompt_class(chunks)
        if held and (prompt_class is None or prompt_class >= min(s.priority for s in held)):
            budget, num_held_preempted = self._schedule_running(chunks, budget, set(self.running) - held)
            num_preempted += num_held_preempted
            self._charge_new(chunks, charged)
        self.rates.observe(now_s, was_running, num_admitted, bool(self.waiting))
        self._record_classes(chunks.values())
        return SchedulerOutput(tuple(chunks.values()), tuple(finished), num_preempted)

    def _held_prefills(self) -> set[Sequence]:
        """Running sequences still computing their prompt whose class is below a waiting one's.
        Their chunks come after this step's admissions, so that a higher-class prompt is not
        left for the next step behind a lower class's (a job's prompts would otherwise fill
        the token budget ahead of an interactive request's), and only if no higher-class prompt
        is computed in this step: its first token comes at the end of the step, which a full
        budget of a job's prompts would make several times longer."""
        top = min((s.priority for s in self.waiting if not s.is_waiting_for_prefix), default=None)
        if top is None:
            return set()
        return {s for s in self.running if s.is_prefilling and s.priority > top}

    def _prompt_class(self, chunks: Mapping[str, ScheduledChunk]) -> Priority | None:
        """The highest class whose prompt this step computes so far (None: no prompt)."""
        return min((s.priority for s in self.running if s.request_id in chunks and s.is_prefilling), default=None)

    def _charge_new(self, chunks: Mapping[str, ScheduledChunk], charged: set[str]) -> None:
        """Charge the chunks not charged yet (`_charge`), and note them as charged."""
        self._charge(chunk for request_id, chunk in chunks.items() if request_id not in charged)
        charged.update(chunks)

    def _schedule_running(self, chunks: dict[str, ScheduledChunk], budget: int,
                          skip: set[Sequence]) -> tuple[int, int]:
        """Chunks for running sequences other than `skip` (phase 2) within `budget`; returns the
        budget left and the preemptions."""
        num_preempted = 0
        for seq in sorted(self.running, key=self._running_key):
            if seq.status is not SequenceStatus.RUNNING or budget == 0 or seq in skip:
                continue
            num_new = self._chunk_size(seq, budget)
            if num_new == 0:
                continue  # a lower class's prompt, past its share of this step
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
        return budget, num_preempted

    def _running_key(self, seq: Sequence) -> tuple[bool, int, float, float]:
        """Decodes first, by class and arrival; then prefills by class, tenant tag and arrival."""
        tag = self._fair.tag(seq.priority, seq.tenant) if seq.is_prefilling else 0.0
        return seq.is_prefilling, int(seq.priority), tag, seq.arrival_s

    def _admit_waiting(self, budget: int, chunks: dict[str, ScheduledChunk],
                       charged: set[str]) -> tuple[int, int, int]:
        """Phase 3; returns the budget left, the sequences admitted and the running ones
        preempted to make room. `charged`: the chunks already charged to their tenants."""
        pending: dict[Flow, int] = {}  # tokens admitted this step, not yet charged
        may_jump = True
        prompt_class = self._prompt_class(chunks)
        num_admitted = num_preempted = 0
        while self.waiting and budget > 0:
            turn = self._next_waiting(pending, may_jump)
            if turn is None:
                break  # what waits, waits for its prompt's blocks
            seq, jumped = turn
            may_jump = may_jump and not jumped
            if prompt_class is not None and seq.priority > prompt_class:
                break  # a higher class's prompt is computed in this step: keep the step short
            if len(self.running) >= self.config.max_num_seqs:
                freed = self._make_room(seq, chunks, charged)
                if freed is None:
                    break
                budget, num_preempted, may_jump = budget + freed, num_preempted + 1, False
                continue
            cached = self.blocks.cached_prefix(seq.all_token_ids, seq.prefix_salt) if seq.may_use_prefix_cache else []
            num_cached = len(cached) * self.blocks.block_size
            seq.num_computed_tokens = num_cached
            num_new = self._chunk_size(seq, budget)
            if num_new == 0:  # a lower class's prompt, past its share of this step
                seq.num_computed_tokens = 0
                if not jumped:
                    break
                may_jump = False  # the class owed its share waits; a higher one may still go
                continue
            if self.blocks.allocate(seq.request_id, num_cached + num_new, cached) is None:
                seq.num_computed_tokens = 0
                freed = self._make_room(seq, chunks, charged)
                if freed is None:
                    break
                budget, num_preempted, may_jump = budget + freed, num_preempted + 1, False
                continue
            self.blocks.record_query(seq.num_tokens, num_cached)
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = num_cached
            self.waiting.remove(seq)
            self._fair.start(seq.priority, seq.tenant)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            chunks[seq.request_id] = self._chunk(seq, num_new)
            budget -= num_new
            num_admitted += 1
            if seq.is_prefilling:
                prompt_class = seq.priority if prompt_class is None else min(prompt_class, seq.priority)
            flow = (seq.priority, seq.tenant)
            pending[flow] = pending.get(flow, 0) + num_new
        return budget, num_admitted, num_preempted

    def _make_room(self, seq: Sequence, chunks: dict[str, ScheduledChunk], charged: set[str]) -> int | None:
        """Preempt the lowest-class, latest-arrived running sequence of a class below `seq`'s,
        other than its class's earliest-arrived; returns the tokens of this step's budget its
        dropped chunk frees (its charge refunded), or None if there is no such sequence."""
        earliest: dict[Priority, Sequence] = {}
        for other in self.running:
            if other.priority > seq.priority and (
                    other.priority not in earliest or other.arrival_s < earliest[other.priority].arrival_s):
                earliest[other.priority] = other
        kept = set(earliest.values())
        victims = [s for s in self.running if s.priority > seq.priority and s not in kept]
        if not victims:
            return None
        victim = max(victims, key=Sequence.victim_key)
        dropped = chunks.pop(victim.request_id, None)
        freed = 0 if dropped is None else len(dropped.token_ids)
        if freed and victim.request_id in charged:
            self._fair.charge(victim.priority, victim.tenant, -freed)
        charged.discard(victim.request_id)  # were it readmitted this step, its new chunk is charged
        if freed and self._is_lower_prompt(victim):
            self._lower_prompt_left += freed
        self._preempt(victim)
        return freed

    def _next_waiting(self, pending: Mapping[Flow, int], may_jump: bool) -> tuple[Sequence, bool] | None:
        """The waiting sequence whose turn it is, and whether its class jumped ahead of a higher
        one on its owed share: the class (`ClassShares.order`, or strict priority once a step has
        let a class jump), its tenant with the smallest tag counting `pending`, that tenant's
        earliest deadline. A sequence waiting for another to compute its prompt is passed over;
        None if only such sequences wait."""
        heads: dict[Flow, Sequence] = {}
        for seq in self.waiting:  # in queue_key order: a flow's first is its earliest deadline
            if not seq.is_waiting_for_prefix:
                heads.setdefault((seq.priority, seq.tenant), seq)
        if not heads:
            return None
        classes = sorted({priority for priority, _ in heads})
        priority = self._class_shares.order(classes)[0] if may_jump else classes[0]

        def turn(flow: Flow) -> tuple[float, tuple[int, float, float]]:
            tag = self._fair.tag(*flow) + pending.get(flow, 0) / self._fair.weight(flow[1])
            return tag, heads[flow].queue_key()

        flow = min((f for f in heads if f[0] == priority), key=turn)
        return heads[flow], priority != classes[0]

    def _charge(self, chunks: Iterable[ScheduledChunk]) -> None:
        """Advance each chunk's tenant's tag by its tokens (what fair queueing shares)."""
        by_id = {s.request_id: s for s in self.running}
        for chunk in chunks:
            seq = by_id[chunk.request_id]
            self._fair.charge(seq.priority, seq.tenant, len(chunk.token_ids))

    def _record_classes(self, chunks: Iterable[ScheduledChunk]) -> None:
        """Tell `ClassShares` how the step's tokens went to classes (their minimum shares)."""
        by_id = {s.request_id: s for s in self.running}
        served: dict[Priority, float] = {}
        for chunk in chunks:
            priority = by_id[chunk.request_id].priority
            served[priority] = served.get(priority, 0.0) + len(chunk.token_ids)
        self._class_shares.record(sum(served.values()), served, {s.priority for s in self.waiting})

    def _chunk_size(self, seq: Sequence, budget: int) -> int:
        """Tokens of `seq` to compute this step: a chunk, within `budget`; for the prompt of a
        class below the highest present, also within `_lower_prompt_left`."""
        remaining = seq.num_tokens - seq.num_computed_tokens
        size = min(remaining, budget, self.config.long_prefill_token_threshold)
        return min(size, self._lower_prompt_left) if self._is_lower_prompt(seq) else size

    def _is_lower_prompt(self, seq: Sequence) -> bool:
        return self._top_class is not None and seq.priority > self._top_class and seq.is_prefilling

    def _chunk(self, seq: Sequence, num_new: int) -> ScheduledChunk:
        if self._is_lower_prompt(seq):
            self._lower_prompt_left -= num_new
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
        self._enqueue(seq)
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
            written = self.blocks.commit(seq.request_id, seq.all_token_ids, seq.num_computed_tokens, seq.prefix_salt)
            if seq.num_preemptions == 0:
                size = self.blocks.block_size
                seq.num_cache_write_tokens += size * sum((i + 1) * size <= seq.num_prompt_tokens for i in written)
            token = sampled.get(chunk.request_id)
            if token is not None:
                seq.append(token)
                advanced.append(seq)
        return advanced
