"""Reading a Prometheus text exposition: every sample of one scrape, sums by label, quantiles.

Pure: the text comes from whoever fetched it (`sluice top`, `sluice bench`).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

Labels = tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class Scrape:
    """Every sample of one scrape: sample name -> its label sets (sorted pairs) -> value."""

    taken_at_s: float
    samples: dict[str, dict[Labels, float]]

    @classmethod
    def parse(cls, text: str, taken_at_s: float) -> Scrape:
        samples: dict[str, dict[Labels, float]] = defaultdict(dict)
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                samples[sample.name][tuple(sorted(sample.labels.items()))] = sample.value
        return cls(taken_at_s, dict(samples))

    def grouped(self, name: str, keys: tuple[str, ...], **match: str) -> dict[tuple[str, ...], float]:
        """The sum of `name`'s series by the values of the labels `keys`, over the series whose
        labels include `match`."""
        sums: dict[tuple[str, ...], float] = defaultdict(float)
        for labels, value in self.samples.get(name, {}).items():
            found = dict(labels)
            if all(found.get(k) == v for k, v in match.items()):
                sums[tuple(found.get(k, "") for k in keys)] += value
        return dict(sums)


def histogram_quantile(q: float, cumulative: dict[float, float]) -> float | None:
    """The q-quantile of a histogram given as upper bound -> cumulative count, interpolated
    linearly within the bucket it falls in (as PromQL's `histogram_quantile`); beyond the last
    finite bound, that bound. None for no observations."""
    bounds = sorted(cumulative.items())
    total = bounds[-1][1] if bounds else 0.0
    if total <= 0:
        return None
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in bounds:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return lower_bound
