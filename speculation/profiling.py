"""Offline step-latency profiling: the goodput model's step models fitted from timed engine steps on this machine
(`cosine profile`'s drafter seed, the bench's seeds, a drafter replica's step-cost profile for the autoscaler).
The verifier engine as the loop drives it is profiled by autoscale/profiling.py."""

from __future__ import annotations

from engines.runner import step_seconds
from speculation.goodput import LinearLatency


def fit_verify_latency(model, batch: int, context: int = 128, news=(1, 3, 5, 9)) -> LinearLatency:
    """t(total tokens in the step) for a verifier running `batch` requests."""
    lat = LinearLatency()
    for b in sorted({1, batch}):
        for n in news:
            lat.samples.append((b * n, step_seconds(model, b, context, n)))
    lat.refit()
    return lat


def fit_draft_latency(model, batch: int, context: int = 128, make_runner=None) -> LinearLatency:
    """t(batch size) of one lockstep drafter step (one new token per request); `make_runner`: as `step_seconds`."""
    lat = LinearLatency()
    for b in sorted({1, max(1, batch // 2), batch}):
        lat.samples.append((b, step_seconds(model, b, context, 1, make_runner=make_runner)))
    lat.refit()
    return lat

