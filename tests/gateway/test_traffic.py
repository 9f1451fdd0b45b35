"""Traffic splits, sticky assignment and canary analysis (`gateway.traffic`), on a virtual clock."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest

from sluice.gateway.traffic import (
    Canary,
    CanaryEvent,
    CanaryPlan,
    CanaryStatus,
    Published,
    Split,
    Traffic,
    wilson_lower,
)

SERVED = {"1", "2", "3"}


def _shares(split: Split, n: int = 20_000, sticky_keys: bool = False) -> dict[str, float]:
    rng = random.Random(7)
    counts = Counter(split.choose(SERVED, f"user-{i}" if sticky_keys else None, rng) for i in range(n))
    return {version: count / n for version, count in counts.items()}


def test_a_split_sends_each_version_its_weight() -> None:
    shares = _shares(Split.of({"1": 70, "2": 20, "3": 10}, sticky=False))
    assert shares == pytest.approx({"1": 0.7, "2": 0.2, "3": 0.1}, abs=0.015)
    # sticky keys spread the same way
    assert _shares(Split.of({"1": 70, "2": 30}), sticky_keys=True) == pytest.approx({"1": 0.7, "2": 0.3}, abs=0.015)


def test_a_sticky_key_keeps_its_version_and_keeps_it_as_the_new_version_grows() -> None:
    rng = random.Random(1)
    keys = [f"user-{i}" for i in range(2000)]
    at = {share: {k: Split.of({"1": 100 - share, "2": share}).choose(SERVED, k, rng) for k in keys}
          for share in (5, 25, 50, 100)}
    assert all(Split.of({"1": 95, "2": 5}).choose(SERVED, k, rng) == at[5][k] for k in keys)  # the same each time
    for smaller, larger in ((5, 25), (25, 50), (50, 100)):
        on_new = {k for k, v in at[smaller].items() if v == "2"}
        assert on_new and all(at[larger][k] == "2" for k in on_new)  # nobody who saw version 2 goes back
    # unsticky: drawn per request
    loose = Split.of({"1": 50, "2": 50}, sticky=False)
    assert len({loose.choose(SERVED, "same-key", rng) for _ in range(50)}) == 2


def test_versions_not_served_are_skipped_and_their_share_spread() -> None:
    split = Split.of({"1": 50, "4": 50}, sticky=False)
    assert {split.choose(SERVED, None, random.Random(i)) for i in range(100)} == {"1"}
    assert Split.of({"4": 100}).choose(SERVED, "k", random.Random(0)) is None


@pytest.mark.parametrize("weights", [{}, {"1": 0}, {"1": -5, "2": 10}, {"1": float("nan")}, {"1": True},
                                     {"1": 1e308, "2": 1e308}])  # was taken: 0% each, every request to one
def test_bad_weights_are_refused(weights: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        Split.of(weights)


def test_the_wilson_bound_needs_evidence() -> None:
    assert wilson_lower(0, 100) == 0.0
    assert wilson_lower(2, 100) < 0.01 < wilson_lower(20, 100)  # 2% of 100 could be luck; 20% cannot
    assert wilson_lower(1, 1) < 0.3


def _feed(canary: Canary, version: str, n: int, failed: int = 0, latency_s: float = 0.01) -> None:
    for i in range(n):
        canary.observe(version, "failed" if i < failed else "ok", latency_s)


PLAN = CanaryPlan(version="2", baseline="1", steps=(10.0, 50.0), step_s=30.0, min_requests=50)


def test_a_healthy_canary_is_promoted_step_by_step() -> None:
    canary = Canary("m", PLAN, now=0.0)
    assert canary.split.percent() == {"2": 10.0, "1": 90.0}
    _feed(canary, "2", 60, failed=1)
    _feed(canary, "1", 500, failed=5)
    assert canary.evaluate(10.0) is None  # the step has not lasted step_s
    event = canary.evaluate(30.0)
    assert event is not None and event.kind == "advanced" and canary.share == 50.0
    _feed(canary, "2", 30)
    assert canary.evaluate(70.0) is None  # the new step's evidence starts empty: 30 < min_requests
    _feed(canary, "2", 30)
    _feed(canary, "1", 60)
    event = canary.evaluate(70.0)
    assert event is not None and event.kind == "promoted" and canary.status is CanaryStatus.PROMOTED
    assert canary.split.percent() == {"2": 100.0}


def test_a_failing_canary_is_rolled_back_before_its_step_ends() -> None:
    canary = Canary("m", PLAN, now=0.0)
    _feed(canary, "1", 500, failed=2)
    _feed(canary, "2", 49, failed=10)
    assert canary.evaluate(1.0) is None  # not enough canary answers yet
    _feed(canary, "2", 1, failed=1)
    event = canary.evaluate(1.0)
    assert event is not None and event.kind == "rolled_back" and canary.share == 0.0
    assert "failed 11 of 50" in event.reason
    assert canary.split.percent() == {"1": 100.0}


def test_a_few_failures_like_the_baselines_do_not_roll_back() -> None:
    canary = Canary("m", PLAN, now=0.0)
    _feed(canary, "1", 1000, failed=10)  # 1%
    _feed(canary, "2", 50, failed=2)  # 4% of a small sample: within the noise
    event = canary.evaluate(31.0)
    assert event is not None and event.kind == "advanced"


def test_a_slow_canary_is_rolled_back_at_the_end_of_its_step() -> None:
    canary = Canary("m", PLAN, now=0.0)
    _feed(canary, "1", 200, latency_s=0.020)
    _feed(canary, "2", 60, latency_s=0.030)
    assert canary.evaluate(29.0) is None
    event = canary.evaluate(30.0)
    assert event is not None and event.kind == "rolled_back" and "p95 execution time 30.0 ms" in event.reason


def test_outcomes_that_say_nothing_about_a_version_are_not_counted() -> None:
    canary = Canary("m", PLAN, now=0.0)
    for outcome in ("invalid", "rejected", "cancelled", "unavailable"):
        for _ in range(100):
            canary.observe("2", outcome, 1.0)
    assert canary.describe(0.0)["current_step"] == {
        "2": {"requests": 0, "failed": 0, "error_rate": 0.0, "p95_ms": None},
        "1": {"requests": 0, "failed": 0, "error_rate": 0.0, "p95_ms": None}}


@pytest.mark.parametrize("plan", [
    CanaryPlan(version="1", baseline="1"),
    CanaryPlan(version="2", baseline="1", steps=()),
    CanaryPlan(version="2", baseline="1", steps=(50.0, 25.0)),
    CanaryPlan(version="2", baseline="1", steps=(5.0, 100.0)),
    CanaryPlan(version="2", baseline="1", step_s=0),
    CanaryPlan(version="2", baseline="1", max_latency_ratio=0.5),
])
def test_unusable_plans_are_refused(plan: CanaryPlan) -> None:
    with pytest.raises(ValueError):
        plan.check()


def test_a_canary_without_enough_traffic_is_rolled_back_after_ten_steps() -> None:
    canary = Canary("m", PLAN, now=0.0)
    _feed(canary, "2", 49)
    assert canary.evaluate(299.0) is None  # holding: the step needs 50 canary answers
    event = canary.evaluate(300.0)
    assert event is not None and event.kind == "rolled_back" and "got 49 of the 50" in event.reason


def test_the_p95_is_the_nearest_rank() -> None:
    canary = Canary("m", PLAN, now=0.0)
    for ms in range(1, 21):
        canary.observe("2", "ok", ms / 1000)
    assert canary.describe(0.0)["current_step"]["2"]["p95_ms"] == 19.0


def _fail_canary(traffic: Traffic, now: float) -> list[CanaryEvent]:
    events = []
    for i in range(100):
        events += [traffic.observe("m", "1", "ok", 0.01, now + i * 0.01),
                   traffic.observe("m", "2", "failed", 0.01, now + i * 0.01)]
    return [e for e in events if e is not None]


def test_operator_splits_come_before_the_declared_one_and_can_be_undone() -> None:
    traffic = Traffic()
    declared = Split.of({"1": 100})
    assert traffic.split("m", declared) is declared and traffic.source("m") is None
    traffic.set_split("m", Split.of({"1": 80, "2": 20}))
    traffic.set_split("m", Split.of({"1": 50, "2": 50}))
    assert traffic.split("m", declared).percent() == {"2": 50.0, "1": 50.0} and traffic.source("m") == "operator"
    traffic.roll_back("m")  # undo the last change
    assert traffic.split("m", declared).percent() == {"2": 20.0, "1": 80.0} and traffic.source("m") == "operator"
    traffic.set_split("m", None)  # back to the declared split
    traffic.roll_back("m")
    assert traffic.split("m", declared).percent() == {"2": 20.0, "1": 80.0}
    with pytest.raises(KeyError):
        traffic.roll_back("m")  # one step of undo


def test_a_canary_runs_over_the_split_it_started_from_and_its_outcome_replaces_the_baseline() -> None:
    traffic = Traffic()
    before = Split.of({"1": 90, "3": 10})
    traffic.start_canary("m", PLAN, now=0.0, current=before)
    # the canary takes its step's share of the baseline's traffic; version 3 keeps its own
    assert traffic.source("m") == "canary" and traffic.split("m", None).percent() == {"3": 10.0, "2": 9.0, "1": 81.0}
    with pytest.raises(ValueError):
        traffic.start_canary("m", PLAN, now=1.0, current=before)
    events = _fail_canary(traffic, now=1.0)
    assert [(e.kind, "failed 50 of 50" in e.reason) for e in events] == [("rolled_back", True)]
    assert traffic.split("m", None).percent() == {"3": 10.0, "1": 90.0}  # as it was
    assert traffic.source("m") == "canary result" and traffic.canaries["m"].status is CanaryStatus.ROLLED_BACK
    assert traffic.observe("m", "2", "failed", 0.01, now=3.0) is None  # a finished canary judges nothing
    with pytest.raises(KeyError):
        traffic.roll_back("m")  # rolled back already: nothing to give back

    traffic.start_canary("m", PLAN, now=10.0, current=traffic.split("m", None))
    traffic.promote("m")
    assert traffic.split("m", None).percent() == {"3": 10.0, "2": 90.0}  # the canary took the baseline's share
    traffic.roll_back("m")  # give it back
    assert traffic.split("m", None).percent() == {"3": 10.0, "1": 90.0} and traffic.source("m") == "rollback"
    with pytest.raises(KeyError):
        traffic.promote("m")


def test_a_canary_takes_its_callers_from_its_baseline_only_and_keeps_them() -> None:
    """An A/B split of 1 and 2, and a canary of 3 against 1: every caller of 2 stays on 2, at
    every step and after; the canary's callers all come from 1, and stay with it as it grows."""
    keys = [f"user-{i}" for i in range(4000)]
    rng = random.Random(0)

    def on(version: str, split: Split) -> set[str]:
        return {key for key in keys if split.choose(SERVED, key, rng) == version}

    traffic, before = Traffic(), Split.of({"1": 50, "2": 50})
    plan = CanaryPlan(version="3", baseline="1", steps=(10.0, 50.0), step_s=30.0, min_requests=50)
    traffic.start_canary("m", plan, now=0.0, current=before)
    first = traffic.split("m", None)
    assert first.percent() == {"2": 50.0, "3": 5.0, "1": 45.0}
    assert on("2", first) == on("2", before)
    assert on("3", first) and on("3", first) <= on("1", before)
    _feed(traffic.canaries["m"], "3", 50)
    _feed(traffic.canaries["m"], "1", 50)
    advanced = traffic.evaluate("m", now=31.0)
    assert advanced is not None and advanced.kind == "advanced"
    second = traffic.split("m", None)
    assert second.percent() == {"2": 50.0, "3": 25.0, "1": 25.0}
    assert on("2", second) == on("2", before) and on("3", first) < on("3", second) <= on("1", before)
    traffic.promote("m")
    assert on("2", traffic.split("m", None)) == on("2", before)
    assert on("3", traffic.split("m", None)) == on("1", before)  # the baseline's callers, all of them
    # another gateway follows the same layout
    follower = Traffic()
    follower.follow("m", Published.from_json(json.loads(json.dumps(traffic.published("m", "gw", 1.0).to_json()))))
    assert follower.split("m", None) == traffic.split("m", None)


def test_a_canary_whose_baseline_has_no_share_is_refused() -> None:
    traffic = Traffic()
    with pytest.raises(ValueError, match="version 1 has no traffic"):
        traffic.start_canary("m", PLAN, now=0.0, current=Split.of({"2": 50, "3": 50}))
    assert not traffic.has_canary("m") and traffic.split("m", None) is None


def test_a_canary_of_a_model_with_no_split_ends_on_one_version() -> None:
    traffic = Traffic()
    traffic.start_canary("m", PLAN, now=0.0, current=None)  # all traffic was on the newest (2)
    assert _fail_canary(traffic, now=1.0)[0].kind == "rolled_back"
    assert traffic.split("m", None).percent() == {"1": 100.0}  # not back to the newest, the broken one
    traffic.start_canary("m", PLAN, now=5.0, current=None)
    traffic.promote("m")
    assert traffic.split("m", None).percent() == {"2": 100.0}


def test_a_canary_ends_when_an_operator_sets_a_split_or_a_version_is_no_longer_served() -> None:
    traffic = Traffic()
    traffic.start_canary("m", PLAN, now=0.0, current=None)
    assert traffic.check_served("m", {"1", "2"}) is None
    ended = traffic.check_served("m", {"2"})
    assert ended is not None and ended.kind == "rolled_back" and "version 1 is no longer served" in ended.reason
    assert not traffic.has_canary("m")
    traffic.start_canary("m", PLAN, now=1.0, current=None)
    ended = traffic.set_split("m", Split.of({"1": 50, "2": 50}))  # an operator takes over
    assert ended is not None and ended.kind == "rolled_back" and "operator" in ended.reason
    assert traffic.source("m") == "operator" and not traffic.has_canary("m")


def test_a_published_state_survives_json_and_another_gateway_follows_it() -> None:
    owner, follower = Traffic(), Traffic()
    before = Split.of({"1": 100})
    owner.set_split("m", before)
    owner.start_canary("m", CanaryPlan(version="2", baseline="1", steps=(10.0,)), 0.0, before)
    state = Published.from_json(json.loads(json.dumps(owner.published("m", "gw-a", 1.0).to_json())))
    assert state.source == "canary" and state.before == before and state.canary is not None
    assert state.canary["owner"] == "gw-a" and state.split == owner.split("m", None)

    assert follower.follow("m", state) is None
    assert follower.split("m", None) == owner.split("m", None) and follower.source("m") == "canary"
    remote = follower.remote_canary("m")
    assert remote is not None and remote.before == before
    with pytest.raises(ValueError, match="already running on gateway gw-a"):
        follower.start_canary("m", CanaryPlan(version="2", baseline="1"), 1.0, before)

    follower.set_split("m", Split.of({"1": 50, "2": 50}))  # an operator's change on the follower...
    event = owner.follow("m", follower.published("m", "gw-b", 2.0))  # ...ends the canary where it runs
    assert event is not None and event.kind == "rolled_back" and "another gateway" in event.reason
    assert not owner.has_canary("m") and owner.source("m") == "operator"
    assert owner.split("m", None) == Split.of({"1": 50, "2": 50})
    owner.follow("m", Published(None, None))  # reset to the declared split
    assert owner.split("m", Split.of({"1": 100})) == Split.of({"1": 100}) and owner.source("m") is None


@pytest.mark.parametrize("record", [{"split": {"traffic": {"1": -1}, "sticky": True}, "source": "operator"},
                                    {"split": [1], "source": "operator"}, {"split": None, "source": 3},
                                    {"split": None, "source": None, "canary": "x"}, {"source": None}])
def test_a_malformed_published_record_is_refused(record: dict) -> None:
    with pytest.raises((ValueError, KeyError)):
        Published.from_json(record)
