"""`sluice plan`: how many devices a load needs within its SLO (`scheduler.plan`), for a device
described by its latency profile, given or read from a running server's `/metrics`."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from sluice.exposition import Scrape
from sluice.gateway.traffic import version_order
from sluice.scheduler.plan import Plan

ALPHA = "sluice_latency_profile_alpha_seconds"
BETA = "sluice_latency_profile_beta_seconds"


def profile_from(scrape: Scrape, model: str, version: str | None) -> tuple[str, float, float]:
    """(version, alpha_s, beta_s) of `model` as its workers learned it: the slowest worker's (the
    largest alpha and beta), of `version` or else of the newest version any worker reports; a
    ValueError saying what the server does report when it has no profile of that model."""
    alphas: dict[str, list[float]] = {}
    betas: dict[str, list[float]] = {}
    for name, into in ((ALPHA, alphas), (BETA, betas)):
        for labels, value in scrape.samples.get(name, {}).items():
            found = dict(labels)
            if found.get("model") == model and math.isfinite(value):
                into.setdefault(found.get("version", ""), []).append(value)
    versions = sorted(alphas.keys() & betas.keys(), key=version_order)
    if not versions:
        known = sorted({dict(labels).get("model", "") for labels in scrape.samples.get(ALPHA, {})})
        raise ValueError(f"the server reports no latency profile of model {model!r} (it has: "
                         f"{', '.join(known) or 'none'}; a model's profile appears once a worker has loaded it)")
    if version is None:
        version = versions[-1]
    elif version not in versions:
        raise ValueError(f"the server reports no latency profile of {model!r} version {version!r} "
                         f"(versions: {', '.join(versions)})")
    return version, max(alphas[version]), max(betas[version])


def as_json(plan: Plan) -> str:
    return json.dumps(_finite(dataclasses.asdict(plan)), indent=2)


def as_text(plan: Plan, duration_s: float) -> str:
    load = plan.load
    item = f"{load.items_per_request} item{'s' if load.items_per_request > 1 else ''} of cost {load.cost_per_item}"
    lines = [
        f"load: {load.rate_per_s:,.1f} requests/s, {item} each, SLO {load.slo_s * 1e3:,.1f} ms, "
        f"{load.on_time_target:.1%} on time",
        f"device: a batch of padded cost C takes {load.alpha_s * 1e3:,.3f} ms + {load.beta_s * 1e3:,.6f} ms x C "
        f"(at most {load.max_batch_size} items, cost {load.max_batch_cost:,})",
        "",
    ]
    n = plan.largest_batch
    if plan.formula_devices is None:
        lines.append(f"formula: even a batch of one item takes {load.batch_s(1) * 1e3:,.1f} ms, so a request that "
                     f"waits out one batch and rides the next takes {2 * load.batch_s(1) * 1e3:,.1f} ms: more than "
                     "the SLO on any number of these devices")
        return "\n".join(lines)
    lines += [
        f"formula: batches of up to {n} items (waiting out one and riding the next: 2 x {load.batch_s(n) * 1e3:,.1f} "
        f"ms <= SLO) serve {plan.capacity_per_device:,.0f} items/s per device: about {plan.formula_devices} "
        f"device{'s' if plan.formula_devices > 1 else ''}",
        "",
        f"simulated (Poisson arrivals spread at random over the devices, at least {duration_s:g} s of them, sluice's "
        "scheduler on a virtual clock; one device's requests counted after 3 s):",
    ]
    rows = [("devices", "requests/s each", "requests", "on time", "refused", "p50", "p99", "busy", "mean batch")]
    for tried in plan.tried:
        rows.append((str(tried.devices), f"{tried.rate_per_device:,.1f}", f"{tried.num_requests:,}",
                     f"{tried.on_time_ratio:.2%}",
                     f"{tried.rejected_ratio:.2%}", _ms(tried.latency_p50_s), _ms(tried.latency_p99_s),
                     f"{tried.busy_ratio:.0%}", f"{tried.mean_batch_size:.1f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines += ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.append("")
    if plan.devices is None:
        lines.append(f"plan: none of {len(plan.tried)} device counts tried met the target")
    else:
        lines.append(f"plan: {plan.devices} device{'s' if plan.devices > 1 else ''} ({load.on_time_target:.1%} of "
                     "requests or more answered within the SLO; sluice's least-wait routing does at least "
                     "as well as the random spreading simulated)")
    return "\n".join(lines)


def _ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1e3:,.1f} ms"


def _finite(value: Any) -> Any:
    """JSON has no NaN: a percentile of no requests is null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value
