"""An online model of a device's batch latency: `seconds = alpha + beta * padded_cost`.

Fitted by exponentially weighted least squares over observed batches. Until enough batches have
been seen, a prior (the runner's parameters) fills in, entered as pseudo-observations at two
costs: it keeps the first predictions sensible, and keeps the slope sensible when every batch so
far had the same cost (a fit that the data alone cannot pin down). The prior fades faster than
the observations (`prior_fade` per observation against `decay`), so measurements take over after
a few dozen batches even when the prior was far off.

Timings taken at warm-up are a prior too, not observations: a warm-up may run while the host is
busy (another process loading or compiling), and interference only ever slows a batch, so each
warm-up cost counts once, at its fastest run (one slow run among repeats is ignored), with the
weight of one batch, quartered by each real batch (`warmup_fade`): one or two real batches
outweigh a warm-up that ran slow throughout. Until they outweigh it `1 / PROVISIONAL_SHARE`
times, the profile `is_provisional`.

One batch far slower than predicted (a garbage-collection pause, a worker frozen and resumed) is
learned as at most `OUTLIER_FACTOR` times its prediction, once the profile's measurements outweigh
its prior: unclamped, a single 100x outlier would raise the estimate enough for admission to
refuse every request as unable to meet its deadline, and with no batch running nothing would
bring it back down. Only a lone outlier is clamped: the next batch, if it too is that slow, is a
real slowdown (a busy host, a throttled device) and is learned as measured, as is every slow batch
after it, so a sustained slowdown is learned about as fast as without the clamp.

Invariants: `alpha_s >= 0`, `beta_s >= 0`, both finite, so `predict` is non-negative and
non-decreasing in cost.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

OUTLIER_FACTOR = 4.0
"""A batch is learned as taking at most this many times its predicted time (see the module's docstring)."""

SETTLED_OBSERVATIONS = 30
"""`slowdown` compares with fits from this many batches on: the first fits swing with every batch."""

PROVISIONAL_SHARE = 0.25
"""A profile is provisional while its warm-up timings weigh more than this share of its real batches."""


class LatencyProfile:
    def __init__(
        self,
        alpha_s: float,
        beta_s: float,
        reference_cost: float,
        *,
        prior_weight: float = 4.0,
        decay: float = 0.995,
        prior_fade: float = 0.95,
        warmup: Sequence[tuple[float, float]] = (),
        warmup_fade: float = 0.25,
    ) -> None:
        """`warmup`: (padded cost, seconds) of batches timed at warm-up (see the module's docstring)."""
        if not (alpha_s >= 0 and beta_s >= 0 and reference_cost > 0):
            raise ValueError("a latency profile needs alpha >= 0, beta >= 0 and a positive reference cost")
        if not (math.isfinite(alpha_s) and math.isfinite(beta_s) and math.isfinite(reference_cost)):
            raise ValueError("a latency profile needs finite parameters")
        if not (0 < decay <= 1 and 0 < prior_fade <= 1 and 0 < warmup_fade <= 1):
            raise ValueError("decay, prior_fade and warmup_fade must be in (0, 1]")
        self._decay = decay
        self._prior_fade = prior_fade
        self._warmup_fade = warmup_fade
        self._data = _Sums()
        self._prior = _Sums()
        for cost in (reference_cost, 4 * reference_cost):
            self._prior.add(cost, alpha_s + beta_s * cost, prior_weight)
        self._warmup = _Sums()
        fastest: dict[float, float] = {}
        for cost, seconds in warmup:
            if 0 <= seconds < math.inf and 0 <= cost < math.inf:
                fastest[cost] = min(seconds, fastest.get(cost, math.inf))
        for cost, seconds in fastest.items():
            self._warmup.add(cost, seconds, 1.0)
        self.alpha_s = alpha_s
        self.beta_s = beta_s
        self.num_observations = 0
        self._reference_cost = reference_cost
        self._is_after_outlier = False
        """The last batch was an outlier (`observe`): another one in a row is a real slowdown."""
        self._fastest_s = math.inf
        """The lowest prediction at `reference_cost` since the fit settled (`slowdown`)."""
        if fastest:
            self._refit()

    @property
    def is_provisional(self) -> bool:
        """Its predictions still rest more on warm-up timings than on real batches: they may be
        far too slow (a warm-up on a busy host), so admission gives the first batches the benefit
        of the doubt (`Scheduler.admit`). False for a profile without warm-up timings."""
        return self._warmup.s0 > PROVISIONAL_SHARE * self._data.s0

    @property
    def slowdown(self) -> float:
        """How many times slower the profile predicts the device now than at its fastest since its
        fit settled (`SETTLED_OBSERVATIONS` batches, measurements outweighing the prior), at the
        reference cost: 1.0 when it never was faster. Admission
        uses it to tell a request that fits a device at its usual speed, refused only because
        the estimate went up, from one too tight for the model (`Scheduler.admit`'s probes)."""
        if not math.isfinite(self._fastest_s) or self._fastest_s <= 0:
            return 1.0
        return max(self.predict(self._reference_cost) / self._fastest_s, 1.0)

    def predict(self, padded_cost: float) -> float:
        """Predicted execution time, in seconds, of a batch of this padded cost."""
        return self.alpha_s + self.beta_s * padded_cost

    def observe(self, padded_cost: float, seconds: float) -> None:
        """Fold in one measured batch. Negative or non-finite measurements are ignored; a lone one
        far slower than predicted counts as `OUTLIER_FACTOR` times the prediction."""
        if not (0 <= seconds < math.inf and 0 <= padded_cost < math.inf):
            return
        ceiling_s = OUTLIER_FACTOR * self.predict(padded_cost)
        is_outlier = self._is_measured and 0 < ceiling_s < seconds
        if is_outlier and not self._is_after_outlier:
            seconds = ceiling_s
        self._is_after_outlier = is_outlier
        self._data.scale(self._decay)
        self._prior.scale(self._prior_fade)
        self._warmup.scale(self._warmup_fade)
        self._data.add(padded_cost, seconds, 1.0)
        self.num_observations += 1
        self._refit()
        if self._is_measured and self.num_observations >= SETTLED_OBSERVATIONS:
            self._fastest_s = min(self._fastest_s, self.predict(self._reference_cost))

    @property
    def _is_measured(self) -> bool:
        """Its predictions are its own: measurements (batches, warm-up) outweigh the prior."""
        return self._data.s0 + self._warmup.s0 >= self._prior.s0

    def _refit(self) -> None:
        sums = self._data.plus(self._prior).plus(self._warmup)
        s0, s1, s2, t0, t1 = sums.s0, sums.s1, sums.s2, sums.t0, sums.t1
        denominator = s0 * s2 - s1 * s1
        is_spread = denominator > 1e-9 * s0 * s2  # else all batches alike: keep the slope, refit the intercept
        beta = max((s0 * t1 - s1 * t0) / denominator if is_spread else self.beta_s, 0.0)
        alpha = (t0 - beta * s1) / s0
        if alpha < 0:  # the best line through the origin instead
            alpha = 0.0
            beta = max(t1 / s2, 0.0) if s2 > 0 else beta
        if math.isfinite(alpha) and math.isfinite(beta):
            self.alpha_s, self.beta_s = alpha, beta


class _Sums:
    """Weighted sums for a least-squares line: weights, x, x^2, y, x*y."""

    __slots__ = ("s0", "s1", "s2", "t0", "t1")

    def __init__(self, s0: float = 0.0, s1: float = 0.0, s2: float = 0.0, t0: float = 0.0, t1: float = 0.0) -> None:
        self.s0, self.s1, self.s2, self.t0, self.t1 = s0, s1, s2, t0, t1

    def add(self, x: float, y: float, weight: float) -> None:
        self.s0 += weight
        self.s1 += weight * x
        self.s2 += weight * x * x
        self.t0 += weight * y
        self.t1 += weight * x * y

    def scale(self, factor: float) -> None:
        self.s0 *= factor
        self.s1 *= factor
        self.s2 *= factor
        self.t0 *= factor
        self.t1 *= factor

    def plus(self, other: _Sums) -> _Sums:
        return _Sums(self.s0 + other.s0, self.s1 + other.s1, self.s2 + other.s2, self.t0 + other.t0,
                     self.t1 + other.t1)
