"""An online model of a device's batch latency: `seconds = alpha + beta * padded_cost`.

Fitted by exponentially weighted least squares over observed batches, starting from a prior
(the emulator's parameters, or timings taken at warm-up) entered as pseudo-observations, so the
first predictions are sensible and later ones follow the device as it really behaves.
"""

from __future__ import annotations


class LatencyProfile:
    def __init__(
        self,
        alpha_s: float,
        beta_s: float,
        reference_cost: float,
        *,
        prior_weight: float = 4.0,
        decay: float = 0.995,
    ) -> None:
        if alpha_s < 0 or beta_s < 0 or reference_cost <= 0:
            raise ValueError("a latency profile needs alpha >= 0, beta >= 0 and a positive reference cost")
        if not 0 < decay <= 1:
            raise ValueError("decay must be in (0, 1]")
        self._decay = decay
        self._s0 = self._s1 = self._s2 = self._t0 = self._t1 = 0.0
        self.alpha_s = alpha_s
        self.beta_s = beta_s
        self.num_observations = 0
        for cost in (reference_cost, 4 * reference_cost):
            self._add(cost, alpha_s + beta_s * cost, prior_weight)

    def predict(self, padded_cost: float) -> float:
        """Predicted execution time, in seconds, of a batch of this padded cost."""
        return self.alpha_s + self.beta_s * padded_cost

    def observe(self, padded_cost: float, seconds: float) -> None:
        """Fold in one measured batch."""
        if seconds < 0 or padded_cost < 0:
            return
        self._s0 *= self._decay
        self._s1 *= self._decay
        self._s2 *= self._decay
        self._t0 *= self._decay
        self._t1 *= self._decay
        self._add(padded_cost, seconds, 1.0)
        self.num_observations += 1
        self._refit()

    def _add(self, x: float, y: float, weight: float) -> None:
        self._s0 += weight
        self._s1 += weight * x
        self._s2 += weight * x * x
        self._t0 += weight * y
        self._t1 += weight * x * y

    def _refit(self) -> None:
        denominator = self._s0 * self._s2 - self._s1 * self._s1
        mean_x = self._s1 / self._s0
        if denominator > 1e-9 * max(self._s0 * self._s2, 1e-12):
            beta = (self._s0 * self._t1 - self._s1 * self._t0) / denominator
        else:
            beta = self.beta_s  # all batches alike: keep the slope, refit the intercept
        beta = max(beta, 0.0)
        alpha = self._t0 / self._s0 - beta * mean_x
        if alpha < 0:
            alpha = 0.0
            beta = max(self._t1 / self._s2, 0.0) if self._s2 > 0 else beta
        self.alpha_s, self.beta_s = alpha, beta
