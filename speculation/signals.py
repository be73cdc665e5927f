"""What the deployments tell the drafter autoscaler, one name per signal (Serve's `record_autoscaling_stats`).

Serve calls a replica's `record_autoscaling_stats` every few seconds and averages each value over the
deployment's `look_back_period_s`; each signal here is a rate over the interval since the replica last reported.
"""

from __future__ import annotations

import time
from collections import Counter

DRAFTER_BUSY = "busy"  # share of wall time the drafter engine computed
DRAFTER_QUEUED = "queued"  # calls waiting for the engine, time-averaged: drafting asked of it but not yet served
# share of wall time computing in proportion to the requests served: the part of busy that more replicas would
# divide among them (a step's fixed cost is paid by every replica whatever its share of the requests)
DRAFTER_SCALABLE = "scalable"
DRAFTER_REQUESTS = "requests"  # requests holding a KV cache here (what removing the replica would move)
VERIFIER_DRAFT_WAIT = "draft_wait"  # share of wall time the verifier waited for drafts
VERIFIER_SPECULATING = "speculating"  # share of request rounds the controller gave drafts (k > 0); 1 when idle
VERIFIER_MEAN_K = "mean_k"  # mean chosen draft length over those rounds
VERIFIER_ROUNDS = "rounds"  # request rounds per second
# requests in the verifier's pool when it reports (the drafters' name for requests held): no rounds and no requests
# is no traffic; no rounds with requests held is a verify step slower than the interval, on a busy machine
VERIFIER_REQUESTS = DRAFTER_REQUESTS
# 1 when the verifier kept the domain drafters retired through the whole interval: every round drafted on the
# generalist, none called them (speculation/retirement.py); not reported where retirement is off
VERIFIER_RETIRED = "retired"
DRAFTER_GENERALIST = "generalist"  # 1 from a generalist drafter's replicas (trained on every domain), else 0


class IntervalMeter:
    """Sums of named amounts since the last `take`, with the wall time they were summed over."""

    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self.sums: Counter = Counter()
        self.since = clock()

    def add(self, name: str, amount: float = 1.0) -> None:
        self.sums[name] += amount

    def take(self) -> tuple[Counter, float]:
        now = self.clock()
        sums, elapsed = self.sums, max(now - self.since, 1e-9)
        self.sums, self.since = Counter(), now
        return sums, elapsed


def drafter_signals(meter: IntervalMeter, requests: int, generalist: bool = False) -> dict[str, float]:
    sums, elapsed = meter.take()
    return {DRAFTER_BUSY: sums["compute_s"] / elapsed, DRAFTER_QUEUED: sums["queued_s"] / elapsed,
            DRAFTER_SCALABLE: sums["scalable_s"] / elapsed, DRAFTER_REQUESTS: float(requests),
            DRAFTER_GENERALIST: float(generalist)}


def verifier_signals(meter: IntervalMeter, requests: int) -> dict[str, float]:
    sums, elapsed = meter.take()
    rounds = sums["rounds"]
    return {VERIFIER_DRAFT_WAIT: sums["draft_wait_s"] / elapsed,
            VERIFIER_SPECULATING: sums["speculated"] / rounds if rounds else 1.0,
            VERIFIER_MEAN_K: sums["k"] / rounds if rounds else 0.0, VERIFIER_ROUNDS: rounds / elapsed,
            VERIFIER_REQUESTS: float(requests)}
