"""Version choice for requests that name no version, pure policy: traffic splits, sticky A/B
assignment and canary analysis (DESIGN's `router` stage, the part before replica choice).

    a running Canary's current step  ──────┐   the first of these that exists
    operator's split (admin API)  ─────────┼─▶ is the model's Split ─▶ choose(served, key) ─▶ version
    declared split (model.toml [routing]) ─┘   (none: the newest version)

A `Split` gives each version a weight. A sticky split maps a request's route key (the caller's
`X-Sluice-Route-Key`, else its OpenAI `user`; without either, a version is drawn) to a point in
[0, 1) by a hash and gives the point to the version whose range holds it. Ranges are laid out
newest version first, so as a new version's share grows the keys it already had stay with it (a
user who saw version 2 at a 5% share still sees it at 25%). Versions no worker serves are
skipped, their share spread over the rest.

A `Canary` moves a new version through steps of its baseline's traffic (by default 5%, 25%,
50%, then all; other versions in the split keep their shares and their callers: the canary's
range is cut from the start of its baseline's), judging each step from the
answers both versions gave in it, side by side under the same load:

- *errors*: once it has `min_requests` answers, the canary is rolled back as soon as the lower
  bound of the Wilson interval of its failure rate (one-sided, 95%) is above the baseline's
  failure rate plus `max_error_rate`: a few unlucky failures in a small sample do not condemn
  it, while a broken version is withdrawn after `min_requests` answers;
- *latency*: at a step's end, the canary's p95 *execution* time (the device time of the batches
  its requests rode in; queueing is left out because both versions queue on the same devices,
  so a slow version delays the baseline's requests as much as its own) must be within
  `max_latency_ratio` of the baseline's, plus a small margin for noise at low latencies;
- a step ends after `step_s` and at least `min_requests` canary answers; until then it holds,
  and after `10 * step_s` without them the canary is rolled back (nothing to judge it by);
- it is rolled back at once if either version stops being served.

A failure here is what the service did wrong (a device fault, a lost worker, an internal error,
a missed deadline the model's own SLO set); a client's invalid input or short deadline, overload
refusals and cancellations say nothing about a version and are not counted. Answers from the
result cache are not counted either; answers to requests that named the version are.

Several gateways keep one state per model between them (`gateway.shared_traffic`): each change
here is `published()` and the others `follow()` it. A canary runs on the gateway it was started
on, judged on the requests that gateway serves (behind a load balancer, a random share of all of
them); the others follow its steps, and a canary whose gateway stops publishing is rolled back.

When a canary ends, the split it started from comes back with the winner in the baseline's
place (promoted: the canary takes the baseline's share; rolled back: the baseline keeps it, and
takes any share the canary version had), as an operator's split would: it stays until an
operator changes or resets it.
"""

from __future__ import annotations

import enum
import hashlib
import math
import random
from collections import deque
from collections.abc import Container, Mapping
from dataclasses import dataclass, field

__all__ = ["BAD_OUTCOMES", "Canary", "CanaryPlan", "CanaryStatus", "Published", "Split", "Traffic", "version_order"]

BAD_OUTCOMES = frozenset({"failed", "error", "expired"})
"""Request outcomes (`Ticket`'s labels) that count against a version."""
COUNTED_OUTCOMES = BAD_OUTCOMES | {"ok"}

_Z = 1.645  # a one-sided 95% bound
_MAX_SAMPLES = 20_000
"""Execution times kept per version and step for the p95 (the most recent ones)."""


def version_order(version: str) -> tuple[int, str]:
    """Numbered versions in numeric order, after any others."""
    return (int(version), version) if version.isdigit() else (-1, version)


@dataclass(frozen=True, slots=True)
class Split:
    """Shares of a model's traffic by version: (version, weight), newest version first (`of`) or
    in the order a canary left them (`ordered`: its range cut from its baseline's)."""

    shares: tuple[tuple[str, float], ...]
    """In the order their ranges are laid out: a sticky key keeps its version while the ranges
    before it keep their sizes."""
    sticky: bool = True

    @classmethod
    def of(cls, weights: Mapping[str, float], sticky: bool = True) -> Split:
        """From version -> weight (any positive scale, e.g. percent), newest version first. Raises
        ValueError for a negative or non-finite weight, no positive one, or weights whose sum is not
        finite."""
        return cls.ordered(dict(sorted(weights.items(), key=lambda vw: version_order(vw[0]), reverse=True)), sticky)

    @classmethod
    def ordered(cls, weights: Mapping[str, float], sticky: bool = True) -> Split:
        """As `of`, with the versions' ranges laid out in the order `weights` gives them."""
        for version, weight in weights.items():
            if not isinstance(weight, int | float) or isinstance(weight, bool) or not math.isfinite(weight) \
                    or weight < 0:
                raise ValueError(f"version {version!r}: a weight must be a number >= 0, got {weight!r}")
        shares = tuple((v, float(w)) for v, w in weights.items() if w > 0)
        if not shares:
            raise ValueError("at least one version needs a weight above 0")
        if not math.isfinite(sum(w for _, w in shares)):  # each finite, their sum not: every share would be 0
            raise ValueError("the weights add up to more than a number can hold: give them as percentages")
        return cls(shares, sticky)

    def live(self, served: Container[str]) -> list[tuple[str, float]]:
        """The shares of the versions `served` (the others' spread over them by weight)."""
        return [(v, w) for v, w in self.shares if v in served]

    def choose(self, served: Container[str], key: str | None, rng: random.Random) -> str | None:
        """The version for one request, among those `served`; None if the split names none of them.
        `key`: the request's route key (sticky splits only; None draws at random)."""
        live = self.live(served)
        if not live:
            return None
        if len(live) == 1:
            return live[0][0]
        point = (_point(key) if self.sticky and key is not None else rng.random()) * sum(w for _, w in live)
        for version, weight in live:
            point -= weight
            if point < 0:
                return version
        return live[-1][0]

    def percent(self) -> dict[str, float]:
        total = sum(w for _, w in self.shares)
        return {v: round(100.0 * w / total, 4) for v, w in self.shares}

    def to_json(self) -> dict[str, object]:
        return {"traffic": dict(self.shares), "sticky": self.sticky}

    @classmethod
    def from_json(cls, value: object) -> Split | None:
        """The inverse of `to_json` (None for None), in the same order. Raises ValueError for anything else."""
        if value is None:
            return None
        if not isinstance(value, dict) or not isinstance(value.get("traffic"), dict) \
                or not isinstance(value.get("sticky"), bool):
            raise ValueError(f"not a split: {value!r}")
        return cls.ordered(value["traffic"], value["sticky"])


def _point(key: str) -> float:
    """A key's place in [0, 1), the same in every process (unlike `hash`)."""
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


@dataclass(frozen=True, slots=True)
class CanaryPlan:
    version: str
    """The new version under test."""
    baseline: str
    """The version it is compared with, whose callers it takes, and rolled back to."""
    steps: tuple[float, ...] = (5.0, 25.0, 50.0)
    """The canary's percent of its baseline's traffic at each step; after the last, it takes all."""
    step_s: float = 60.0
    min_requests: int = 100
    """Canary answers (ok or failed) a step needs before it may end."""
    max_error_rate: float = 0.01
    """How much the canary's failure rate may exceed the baseline's (absolute: 0.01 = one point)."""
    max_latency_ratio: float = 1.25
    """Canary p95 of successful answers / baseline's, at most (plus `latency_margin_s`)."""
    latency_margin_s: float = 0.002
    sticky: bool = True

    def check(self) -> None:
        """Raise ValueError for a plan that cannot run."""
        if self.version == self.baseline:
            raise ValueError("the canary and its baseline must be different versions")
        if not self.steps or any(not 0 < s < 100 for s in self.steps) or list(self.steps) != sorted(set(self.steps)):
            raise ValueError("steps must be increasing percentages between 0 and 100 (exclusive)")
        if not self.step_s > 0 or self.min_requests < 1:
            raise ValueError("step_s must be > 0 and min_requests >= 1")
        if not 0 <= self.max_error_rate < 1 or not self.max_latency_ratio >= 1 or self.latency_margin_s < 0:
            raise ValueError("max_error_rate must be in [0, 1), max_latency_ratio >= 1, latency_margin_s >= 0")


class CanaryStatus(enum.StrEnum):
    RUNNING = "running"
    PROMOTED = "promoted"
    ROLLED_BACK = "rolled_back"


@dataclass(slots=True)
class _Window:
    """One version's answers in the current step."""

    ok: int = 0
    bad: int = 0
    latencies: deque[float] = field(default_factory=lambda: deque(maxlen=_MAX_SAMPLES))

    @property
    def count(self) -> int:
        return self.ok + self.bad

    @property
    def error_rate(self) -> float:
        return self.bad / self.count if self.count else 0.0

    def p95(self) -> float | None:
        """The nearest-rank 95th percentile; None with fewer than 20 samples."""
        if len(self.latencies) < 20:
            return None
        ordered = sorted(self.latencies)
        return ordered[math.ceil(0.95 * len(ordered)) - 1]

    def summary(self) -> dict[str, object]:
        p95 = self.p95()
        return {"requests": self.count, "failed": self.bad, "error_rate": round(self.error_rate, 6),
                "p95_ms": None if p95 is None else round(p95 * 1000, 3)}


def wilson_lower(failures: int, count: int, z: float = _Z) -> float:
    """Lower bound of the Wilson score interval for a proportion."""
    if count == 0:
        return 0.0
    p = failures / count
    denominator = 1 + z * z / count
    centre = p + z * z / (2 * count)
    spread = z * math.sqrt(p * (1 - p) / count + z * z / (4 * count * count))
    return max((centre - spread) / denominator, 0.0)


@dataclass(frozen=True, slots=True)
class CanaryEvent:
    model: str
    kind: str
    """"advanced", "promoted" or "rolled_back"."""
    share: float
    """The canary's percent of traffic after the event."""
    reason: str


class Canary:
    """One model's canary: its plan, where it stands, and the current step's evidence."""

    def __init__(self, model: str, plan: CanaryPlan, now: float, before: Split | None = None) -> None:
        plan.check()
        if before is not None and plan.baseline not in dict(before.shares):
            raise ValueError(f"version {plan.baseline} has no traffic for a canary to take its share from")
        self.model = model
        self.plan = plan
        self.before = before
        """The model's split when the canary started (None: all to one version)."""
        self.status = CanaryStatus.RUNNING
        self.step = 0
        self.started_at = now
        self.step_started_at = now
        self.reason = ""
        self._windows = {plan.version: _Window(), plan.baseline: _Window()}
        self._split = self._make_split()

    @property
    def share(self) -> float:
        """The canary's percent of the baseline's traffic now."""
        if self.status is CanaryStatus.RUNNING:
            return self.plan.steps[self.step]
        return 100.0 if self.status is CanaryStatus.PROMOTED else 0.0

    @property
    def split(self) -> Split:
        return self._split

    def _make_split(self) -> Split:
        """The split it started from, with the baseline's weight (and any the canary had) shared
        between the two by the current step; the other versions keep theirs, and their places.
        The canary's range is the start of the baseline's, so every caller it takes was the
        baseline's, and keeps it as it grows:

            before   | 2: 50            | 1: 50             |
            step 1   | 2: 50            | 3: 5 | 1: 45      |
            step 2   | 2: 50            | 3: 12.5 | 1: 37.5 |
        """
        canary, baseline = self.plan.version, self.plan.baseline
        shares = self.before.shares if self.before is not None else ((baseline, 100.0),)
        pool = sum(w for v, w in shares if v in (canary, baseline))
        weights: dict[str, float] = {}
        for version, weight in shares:
            if version == baseline:
                weights[canary] = pool * self.share / 100.0
                weights[baseline] = pool - weights[canary]
            elif version != canary:
                weights[version] = weight
        return Split.ordered({v: w for v, w in weights.items() if w > 0}, self.plan.sticky)

    def observe(self, version: str, outcome: str, exec_s: float) -> None:
        """An answer from `version`: its outcome (`Ticket`'s label) and, if ok, its execution time."""
        window = self._windows.get(version)
        if window is None or self.status is not CanaryStatus.RUNNING:
            return
        if outcome == "ok":
            window.ok += 1
            window.latencies.append(exec_s)
        elif outcome in BAD_OUTCOMES:
            window.bad += 1

    def evaluate(self, now: float) -> CanaryEvent | None:
        """Judge the evidence so far: roll back, end the step (advance or promote), or hold (None)."""
        if self.status is not CanaryStatus.RUNNING:
            return None
        plan = self.plan
        canary, baseline = self._windows[plan.version], self._windows[plan.baseline]
        if canary.count >= plan.min_requests:
            lower = wilson_lower(canary.bad, canary.count)
            if lower > baseline.error_rate + plan.max_error_rate:
                return self._finish(CanaryStatus.ROLLED_BACK, (
                    f"version {plan.version} failed {canary.bad} of {canary.count} requests "
                    f"({canary.error_rate:.1%}; at least {lower:.1%} at 95% confidence) against "
                    f"{baseline.error_rate:.1%} for version {plan.baseline}, more than the "
                    f"{plan.max_error_rate:.1%} allowed"))
        if canary.count < plan.min_requests and now - self.step_started_at >= _PATIENCE * plan.step_s:
            return self._finish(CanaryStatus.ROLLED_BACK, (
                f"step {self.step + 1} got {canary.count} of the {plan.min_requests} canary answers it needs "
                f"in {now - self.step_started_at:.0f} s: too little traffic to judge version {plan.version}"))
        if now - self.step_started_at < plan.step_s or canary.count < plan.min_requests:
            return None
        canary_p95, baseline_p95 = canary.p95(), baseline.p95()
        if canary_p95 is not None and baseline_p95 is not None \
                and canary_p95 > baseline_p95 * plan.max_latency_ratio + plan.latency_margin_s:
            return self._finish(CanaryStatus.ROLLED_BACK, (
                f"version {plan.version}'s p95 execution time {canary_p95 * 1000:.1f} ms is over "
                f"{plan.max_latency_ratio:g}x version {plan.baseline}'s {baseline_p95 * 1000:.1f} ms"))
        passed = (f"step {self.step + 1} of {len(plan.steps)} passed: {canary.count} requests, "
                  f"{canary.error_rate:.1%} failed (baseline {baseline.error_rate:.1%})")
        if self.step + 1 == len(plan.steps):
            return self._finish(CanaryStatus.PROMOTED, passed)
        self.step += 1
        self._new_step(now)
        return CanaryEvent(self.model, "advanced", self.share, passed)

    def promote(self, reason: str = "promoted by an operator") -> CanaryEvent:
        return self._finish(CanaryStatus.PROMOTED, reason)

    def roll_back(self, reason: str = "rolled back by an operator") -> CanaryEvent:
        return self._finish(CanaryStatus.ROLLED_BACK, reason)

    def _new_step(self, now: float) -> None:
        self.step_started_at = now
        self._windows = {version: _Window() for version in self._windows}
        self._split = self._make_split()

    def _finish(self, status: CanaryStatus, reason: str) -> CanaryEvent:
        self.status = status
        self.reason = reason
        self._split = self._make_split()
        return CanaryEvent(self.model, status.value, self.share, reason)

    def describe(self, now: float) -> dict[str, object]:
        plan = self.plan
        return {
            "version": plan.version, "baseline": plan.baseline, "status": self.status.value,
            "share_percent": self.share, "step": self.step + 1, "steps": list(plan.steps),
            "step_seconds": plan.step_s, "step_elapsed_seconds": round(now - self.step_started_at, 3),
            "min_requests": plan.min_requests, "max_error_rate": plan.max_error_rate,
            "max_latency_ratio": plan.max_latency_ratio, "reason": self.reason,
            "current_step": {version: window.summary() for version, window in self._windows.items()},
        }


@dataclass(frozen=True, slots=True)
class Published:
    """One model's traffic state as a gateway shares it with the others: the split set there (None:
    the model's declared one) and by whom (`Traffic.source`); while a canary runs there, its
    description (`Canary.describe`, plus the owner's name) and the split it started from, the
    one it goes back to if its gateway disappears."""

    split: Split | None
    source: str | None
    canary: dict[str, object] | None = None
    before: Split | None = None

    def to_json(self) -> dict[str, object]:
        return {"split": None if self.split is None else self.split.to_json(), "source": self.source,
                "canary": self.canary, "before": None if self.before is None else self.before.to_json()}

    @classmethod
    def from_json(cls, value: dict[str, object]) -> Published:
        """Raises ValueError (or KeyError, TypeError) for a record that is not one."""
        canary = value.get("canary")
        if canary is not None and not isinstance(canary, dict):
            raise ValueError(f"not a canary: {canary!r}")
        source = value["source"]
        if source is not None and not isinstance(source, str):
            raise ValueError(f"not a source: {source!r}")
        return cls(Split.from_json(value["split"]), source, canary, Split.from_json(value.get("before")))


_EVALUATE_EVERY_S = 0.25
_PATIENCE = 10
"""A step without `min_requests` canary answers after this many `step_s` ends the canary."""


class Traffic:
    """Every model's split as operators changed it, and the canaries, on top of the splits the
    models declare. Driven by the requests' outcomes (`observe`) and the caller's clock: a canary
    is judged on each failure, and otherwise at most every quarter second, as requests end (with
    none, there is nothing new to judge)."""

    def __init__(self) -> None:
        self._splits: dict[str, tuple[Split, str]] = {}
        """Splits set here, and by whom: "operator", "canary result", "rollback"."""
        self._undo: dict[str, tuple[Split, str] | None] = {}
        """What an operator's last change replaced (None: nothing was set here)."""
        self.canaries: dict[str, Canary] = {}
        """Each model's latest canary, running or ended."""
        self._running: dict[str, Canary] = {}
        self._next_evaluation: dict[str, float] = {}
        self._remote: dict[str, Published] = {}
        """Canaries running on another gateway, as it last published them."""

    def split(self, model: str, declared: Split | None) -> Split | None:
        """The split requests to `model` that name no version follow now (None: the newest version)."""
        canary = self._running.get(model)
        if canary is not None:
            return canary.split
        own = self._splits.get(model)
        return declared if own is None else own[0]

    def source(self, model: str) -> str | None:
        """Who set the model's split now: "canary" (running), "canary result", "operator",
        "rollback", or None (the model's declared split, or the newest version)."""
        if model in self._running or model in self._remote:
            return "canary"
        own = self._splits.get(model)
        return None if own is None else own[1]

    def running(self) -> list[Canary]:
        return list(self._running.values())

    def set_split(self, model: str, split: Split | None) -> CanaryEvent | None:
        """An operator's split (None: back to the declared one). Ends a running canary (rolled
        back, returned)."""
        self._remote.pop(model, None)  # one running elsewhere ends when its gateway follows this
        canary = self._running.pop(model, None)
        event = None if canary is None else canary.roll_back("replaced by an operator's traffic split")
        self._undo[model] = self._splits.get(model)
        self._set(model, None if split is None else (split, "operator"))
        return event

    def start_canary(self, model: str, plan: CanaryPlan, now: float, current: Split | None) -> Canary:
        """Start moving `model`'s traffic from `current` (its split now, None: all to the newest
        version) to the plan's version. Raises ValueError if the plan is unusable, its baseline
        has no share of `current`, or a canary of the model already runs."""
        self.check_no_canary(model)
        canary = Canary(model, plan, now, current)
        self.canaries[model] = self._running[model] = canary
        self._undo.pop(model, None)  # the canary's outcome, not an operator's change, is what comes next
        self._next_evaluation[model] = now + _EVALUATE_EVERY_S
        return canary

    def check_no_canary(self, model: str) -> None:
        """Raise ValueError, saying which, if a canary of `model` runs (here or on another gateway)."""
        if model in self._running:
            raise ValueError(f"a canary of version {self._running[model].plan.version} is already running")
        remote = self._remote.get(model)
        if remote is not None and remote.canary is not None:
            raise ValueError(f"a canary of version {remote.canary.get('version')} is already running on gateway "
                             f"{remote.canary.get('owner')}")

    def promote(self, model: str) -> CanaryEvent:
        """Give the running canary the baseline's traffic now. Raises KeyError if none runs."""
        return self._end(self._running[model].promote())

    def roll_back(self, model: str) -> CanaryEvent | None:
        """Stop the running canary; with none running, give a promoted canary's traffic back to its
        baseline, or undo an operator's last change. Raises KeyError if there is nothing to undo."""
        canary = self._running.get(model)
        if canary is not None:
            return self._end(canary.roll_back())
        own = self._splits.get(model)
        latest = self.canaries.get(model)
        if own is not None and own[1] == "canary result" and latest is not None \
                and latest.status is CanaryStatus.PROMOTED:
            given_back = _replace(own[0], latest.plan.version, latest.plan.baseline)
            self._set(model, (given_back or Split.of({latest.plan.baseline: 100.0}), "rollback"))
            return None
        if model not in self._undo:
            raise KeyError(model)
        self._set(model, self._undo.pop(model))
        return None

    def published(self, model: str, owner: str, now: float) -> Published:
        """What this gateway shares of `model`'s state with the others."""
        canary = self._running.get(model)
        if canary is not None:
            return Published(canary.split, "canary", {**canary.describe(now), "owner": owner}, canary.before)
        own = self._splits.get(model)
        return Published(None, None) if own is None else Published(own[0], own[1])

    def follow(self, model: str, state: Published) -> CanaryEvent | None:
        """Take another gateway's newer state of `model`. A canary running here ends (returned):
        the other gateway changed the split after it."""
        canary = self._running.pop(model, None)
        event = None if canary is None else canary.roll_back("replaced by a change on another gateway")
        self._undo.pop(model, None)
        self._set(model, None if state.split is None else (state.split, state.source or "operator"))
        if state.source == "canary" and state.canary is not None:
            self._remote[model] = state
        else:
            self._remote.pop(model, None)
        return event

    def remote_canary(self, model: str) -> Published | None:
        """The canary of `model` running on another gateway, as it last published it."""
        return self._remote.get(model)

    def has_canary(self, model: str) -> bool:
        """A canary of `model` is running."""
        return model in self._running

    def observe(self, model: str, version: str, outcome: str, exec_s: float, now: float) -> CanaryEvent | None:
        """A request to `model` ended: evidence for its canary, if one runs."""
        canary = self._running.get(model)
        if canary is None:
            return None
        canary.observe(version, outcome, exec_s)
        if now < self._next_evaluation[model] and outcome not in BAD_OUTCOMES:
            return None  # a failure is judged at once (cheap); a step's end at most every quarter second
        return self.evaluate(model, now)

    def evaluate(self, model: str, now: float) -> CanaryEvent | None:
        canary = self._running.get(model)
        if canary is None:
            return None
        self._next_evaluation[model] = now + _EVALUATE_EVERY_S
        event = canary.evaluate(now)
        if event is not None and canary.status is not CanaryStatus.RUNNING:
            self._end(event)
        return event

    def check_served(self, model: str, served: Container[str]) -> CanaryEvent | None:
        """Roll back `model`'s running canary if either of its versions is no longer served."""
        canary = self._running.get(model)
        if canary is None:
            return None
        missing = [v for v in (canary.plan.version, canary.plan.baseline) if v not in served]
        if not missing:
            return None
        return self._end(canary.roll_back(f"version {missing[0]} is no longer served"))

    def _end(self, event: CanaryEvent) -> CanaryEvent:
        """A canary finished: the split it started from, with the winner in the baseline's place
        (its final split)."""
        canary = self._running.pop(event.model)
        self._set(event.model, (canary.split, "canary result"))
        return event

    def _set(self, model: str, split: tuple[Split, str] | None) -> None:
        if split is None:
            self._splits.pop(model, None)
        else:
            self._splits[model] = split


def _replace(split: Split, loser: str, winner: str) -> Split | None:
    """`split` with `loser`'s weight added to `winner`'s; None if no weight is left."""
    weights: dict[str, float] = {}
    for version, weight in split.shares:
        target = winner if version == loser else version
        weights[target] = weights.get(target, 0.0) + weight
    try:
        return Split.ordered(weights, split.sticky)
    except ValueError:
        return None
