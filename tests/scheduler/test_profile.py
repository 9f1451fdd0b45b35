"""The latency profile: a fit of `alpha + beta * padded_cost` that follows the device."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.scheduler import LatencyProfile


def assert_sane(profile: LatencyProfile) -> None:
    assert math.isfinite(profile.alpha_s) and profile.alpha_s >= 0
    assert math.isfinite(profile.beta_s) and profile.beta_s >= 0


def test_before_any_observation_the_prior_is_used():
    profile = LatencyProfile(0.004, 0.00002, 128)
    assert profile.predict(0) == pytest.approx(0.004)
    assert profile.predict(1000) == pytest.approx(0.004 + 0.02)
    assert profile.num_observations == 0


@pytest.mark.parametrize(("alpha_s", "beta_s", "reference_cost", "decay"),
                         [(-1, 0, 1, 0.9), (0, -1, 1, 0.9), (0, 0, 0, 0.9), (0, 0, 1, 0), (0, 0, 1, 1.5)])
def test_a_bad_configuration_is_refused(alpha_s, beta_s, reference_cost, decay):
    with pytest.raises(ValueError):
        LatencyProfile(alpha_s, beta_s, reference_cost, decay=decay)


@pytest.mark.parametrize("seed", range(5))
def test_converges_to_the_true_device_from_noisy_observations(seed):
    rng = random.Random(seed)
    true_alpha_s, true_beta_s = 0.003, 0.000002
    profile = LatencyProfile(0.010, 0.0000005, 256)  # a prior off by 3x and 4x
    for _ in range(3000):
        cost = rng.randint(16, 4096)
        profile.observe(cost, (true_alpha_s + true_beta_s * cost) * rng.gauss(1.0, 0.03))
    assert profile.alpha_s == pytest.approx(true_alpha_s, rel=0.15)
    assert profile.beta_s == pytest.approx(true_beta_s, rel=0.05)
    assert profile.num_observations == 3000


def test_follows_a_device_that_slows_down():
    profile = LatencyProfile(0.002, 0.00001, 64)
    rng = random.Random(1)
    for _ in range(3000):
        cost = rng.randint(10, 2000)
        profile.observe(cost, 2 * (0.002 + 0.00001 * cost))
    assert profile.predict(1000) == pytest.approx(2 * (0.002 + 0.01), rel=0.02)


@settings(max_examples=60, deadline=None)
@given(
    cost=st.integers(1, 20_000),
    slowdown=st.floats(0.2, 5.0),
    noise=st.floats(0.0, 0.2),
    num_observations=st.sampled_from([1, 10, 300, 5000]),
    seed=st.integers(0, 2**16),
)
def test_identical_batch_sizes_give_a_sane_fit(cost, slowdown, noise, num_observations, seed):
    """All batches alike (an ill-conditioned fit): no NaN, nothing negative, the one size predicted well."""
    rng = random.Random(seed)
    alpha_s, beta_s = 0.003, 0.00001
    profile = LatencyProfile(alpha_s, beta_s, 256)
    true_s = slowdown * (alpha_s + beta_s * cost)
    for _ in range(num_observations):
        profile.observe(cost, true_s * max(0.0, 1.0 + rng.uniform(-noise, noise)))
    assert_sane(profile)
    if num_observations >= 300:
        assert profile.predict(cost) == pytest.approx(true_s, rel=noise / 2 + 0.05)
    assert profile.predict(cost) <= profile.predict(cost + 1)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 100_000), st.floats(0.0, 10.0)), max_size=300))
def test_predict_is_monotone_in_cost_whatever_is_observed(observations):
    profile = LatencyProfile(0.001, 0.000001, 100)
    for cost, seconds in observations:
        profile.observe(cost, seconds)
        assert_sane(profile)
    costs = [0, 1, 10, 100, 1_000, 10_000, 100_000]
    predictions = [profile.predict(c) for c in costs]
    assert predictions == sorted(predictions)
    assert all(p >= 0 for p in predictions)


def test_non_finite_or_negative_observations_are_ignored():
    profile = LatencyProfile(0.002, 0.00001, 64)
    before = (profile.alpha_s, profile.beta_s)
    for cost, seconds in [(100, math.nan), (100, math.inf), (math.nan, 0.01), (math.inf, 0.01), (-5, 0.01),
                          (100, -0.01)]:
        profile.observe(cost, seconds)
    assert (profile.alpha_s, profile.beta_s) == before
    assert profile.num_observations == 0


# -- warm-up timings: a prior, not observations --------------------------------------------------

TRUE_S = 0.02
"""A device (an upstream of concurrency 4) on which a batch of 1 or 4 items takes 20 ms."""


def _warmed_up(warmup: list[tuple[float, float]]) -> LatencyProfile:
    return LatencyProfile(0.015, 0.005, 1.0, prior_weight=0.5, warmup=warmup)  # as `ModelTable.register` does


def test_one_slow_warm_up_batch_among_its_repeats_is_ignored():
    # the first warm-up call ran while the host was busy: 1 s instead of 20 ms
    profile = _warmed_up([(1, 1.0), (4, TRUE_S), (1, TRUE_S), (4, TRUE_S)])
    assert profile.predict(1) == pytest.approx(TRUE_S, rel=0.25)
    assert profile.predict(4) == pytest.approx(TRUE_S, rel=0.25)
    assert profile.num_observations == 0


def test_a_warm_up_that_ran_slow_throughout_is_outweighed_by_the_first_real_batches():
    profile = _warmed_up([(1, 0.32), (4, 0.32), (1, 0.32), (4, 0.32)])
    assert profile.predict(1) > 5 * TRUE_S and profile.is_provisional
    profile.observe(1, TRUE_S)
    assert profile.is_provisional  # one batch: still leaning on the warm-up
    profile.observe(4, TRUE_S)
    assert not profile.is_provisional
    assert profile.predict(1) < 2 * TRUE_S and profile.predict(4) < 2 * TRUE_S


def test_a_profile_without_warm_up_timings_is_never_provisional():
    profile = LatencyProfile(0.004, 0.00002, 128)
    assert not profile.is_provisional
    profile.observe(128, 0.5)
    assert not profile.is_provisional


def test_a_good_warm_up_is_what_the_first_predictions_follow():
    profile = _warmed_up([(1, 0.05), (4, 0.08), (1, 0.05), (4, 0.08)])  # the prior guessed 20 / 35 ms
    assert 0.035 < profile.predict(1) < 0.05 and 0.06 < profile.predict(4) < 0.08
    assert_sane(profile)


def _learned(profile: LatencyProfile, cost: int, seconds: float, num_batches: int) -> LatencyProfile:
    for _ in range(num_batches):
        profile.observe(cost, seconds)
    return profile


def test_one_outlier_batch_raises_the_estimate_by_at_most_a_few_times():
    profile = _learned(LatencyProfile(0.004, 0.00002, 128), 128, 0.010, 200)
    before_s = profile.predict(128)
    profile.observe(128, 100 * before_s)  # a GC pause, a frozen worker that resumed
    assert profile.predict(128) < 1.1 * before_s
    assert_sane(profile)


def test_a_sustained_slowdown_is_still_learned():
    profile = _learned(LatencyProfile(0.004, 0.00002, 128), 128, 0.010, 200)
    _learned(profile, 128, 0.100, 30)  # the device really got 10x slower (a busy host)
    assert profile.predict(128) > 0.025  # as an unclamped profile learns it: only the first is clamped
    _learned(profile, 128, 0.100, 150)
    assert profile.predict(128) > 0.07


def test_an_outlier_after_normal_batches_is_clamped_again():
    profile = _learned(LatencyProfile(0.004, 0.00002, 128), 128, 0.010, 200)
    for _ in range(5):  # now and then a GC pause, between normal batches
        profile.observe(128, 1.0)
        _learned(profile, 128, 0.010, 10)
    assert profile.predict(128) < 0.013


def test_the_first_batches_correct_a_prior_that_was_far_off():
    """Until measurements outweigh the prior, a batch is learned as measured, however slow."""
    profile = _learned(LatencyProfile(0.001, 0.0, 128), 128, 0.100, 5)  # the prior 100x too fast
    assert profile.predict(128) > 0.03
