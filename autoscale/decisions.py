"""The drafter autoscaler's decisions, without Ray: one drafter deployment's replica count from its replicas' and
the verifier's signals (the rules are described in autoscale/policy.py, which feeds these from Serve's autoscaling
context). Pure, so the simulator (simulate/fleet.py) and the tests run the same decisions without a cluster."""

from __future__ import annotations

import math
from dataclasses import dataclass

from config import AutoscalerSpec


@dataclass
class DrafterLoad:
    """One drafter deployment's signals, summed over its replicas."""

    busy: float  # replicas' worth of computing
    queued: float  # calls waiting, time-averaged
    scalable: float | None = None  # the part of busy that grows with the requests served (None: not reported)
    generalist: bool = False  # a generalist drafter: it drafts the rounds the controller puts on it

    @property
    def demand(self) -> float:
        """Replicas' worth of drafting that more replicas would share: the calls waiting, and the compute that
        grows with the requests (a step's fixed cost does not shrink when its requests are split)."""
        return self.queued + (self.busy if self.scalable is None else self.scalable)


@dataclass
class VerifierLoad:
    draft_wait: float  # share of the verifier's time spent waiting for drafts
    speculating: float  # share of request rounds given drafts
    rounds: float | None = None  # request rounds per second (None: not reported)
    # the domain drafters retired (every round on the generalist) through the whole look-back window, on every
    # verifier replica
    retired: bool = False
    # `drafting_tier: auto`: share of drafting rounds the verifier put on the drafter deployments (None: another tier)
    remote: float | None = None
    requests: float | None = None  # requests in the verifier's pool (None: not reported)

    @property
    def idle(self) -> bool:
        """No traffic: no request rounds and no requests held (a verify step may outlast the look-back window on a
        busy machine: its requests are traffic all the same)."""
        return self.rounds is not None and self.rounds < 1e-9 and not (self.requests or 0.0) > 1e-9


@dataclass
class Decision:
    replicas: int
    kind: str  # demand | draft_wait | speculation_off | colocated | retired | idle | speculating | hold | no_signals
    reason: str
    demand: float  # smoothed replicas' worth of drafting wanted


class ReplicaPlanner:
    """The decision for one drafter deployment, without Serve: testable on synthetic loads."""

    def __init__(self, spec: AutoscalerSpec):
        self.spec = spec

    def decide(self, load: DrafterLoad | None, verifier: VerifierLoad | None, current: int, low: int, high: int,
               previous_demand: float | None, generalist: bool = False) -> Decision:
        """`generalist`: the deployment is a generalist drafter (its replicas say so; remembered while it has
        none)."""
        s = self.spec
        idle = verifier is not None and verifier.idle
        # a drafter at zero replicas is not called: while the verifier speculates for traffic, keep one
        floor = min(max(low, 0 if idle else 1), high)

        def clamp(n: int) -> int:
            return min(max(n, floor), high)

        if verifier is not None and not idle and verifier.speculating < s.speculation_off_below:
            return Decision(low, "speculation_off", f"speculation is off: the verifier drafts "
                            f"{verifier.speculating:.0%} of its request rounds", previous_demand or 0.0)
        if idle:
            return Decision(low, "idle", "the verifier has no requests", previous_demand or 0.0)
        if verifier is not None and verifier.remote is not None and verifier.remote < s.speculation_off_below:
            return Decision(low, "colocated", f"the verifier drafts {1 - verifier.remote:.0%} of its rounds on its "
                            "own hardware (drafting_tier auto: these drafters would cost more than they hide)",
                            previous_demand or 0.0)
        if verifier is not None and verifier.retired and not generalist:
            return Decision(low, "retired", "the verifier drafts every round on the generalist",
                            previous_demand or 0.0)
        if load is None:
            if current == 0 and verifier is not None:
                return Decision(clamp(1), "speculating", f"the verifier speculates in {verifier.speculating:.0%} "
                                "of its request rounds", previous_demand or 0.0)
            return Decision(clamp(current), "no_signals", "no signals from its replicas yet", previous_demand or 0.0)
        raw = load.demand
        demand = raw if previous_demand is None else s.smoothing * raw + (1 - s.smoothing) * previous_demand
        u = s.target_utilization
        need = math.ceil(demand / u - 1e-9)
        if need > current:
            return Decision(clamp(need), "demand", f"drafting {demand:.2f} replicas' worth, at most {u:.0%} each",
                            demand)
        if verifier is not None and verifier.draft_wait > s.draft_wait_above and demand >= u * current:
            return Decision(clamp(current + 1), "draft_wait", f"the verifier waits for drafts "
                            f"{verifier.draft_wait:.0%} of its time and this drafter computes {demand / current:.0%}"
                            " of each replica's", demand)
        fits = math.ceil(demand / (u * (1 - s.hysteresis)) - 1e-9)
        if fits < current:
            return Decision(clamp(fits), "demand", f"drafting {demand:.2f} replicas' worth fits in {clamp(fits)} "
                            f"below {u * (1 - s.hysteresis):.0%} each", demand)
        return Decision(clamp(current), "hold", f"drafting {demand:.2f} replicas' worth", demand)
