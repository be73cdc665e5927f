"""The drafter autoscaler's decisions on synthetic signals, without Ray: up when drafting is short, down when
drafters idle or speculation is off, following the domain mix, no flapping on noise."""

from __future__ import annotations

import random

import numpy as np
import pytest
from ray.serve._private.common import DeploymentID
from ray.serve.config import AutoscalingConfig, AutoscalingContext
from ray.serve.request_router import ReplicaID

from autoscale.decisions import DrafterLoad, ReplicaPlanner, VerifierLoad
from autoscale.policy import DrafterAutoscaler, verifier_load
from config import AutoscalerSpec, DrafterSpec
from speculation.signals import (DRAFTER_BUSY, DRAFTER_GENERALIST, DRAFTER_QUEUED, DRAFTER_REQUESTS,
                                 DRAFTER_SCALABLE, VERIFIER_DRAFT_WAIT, VERIFIER_REQUESTS, VERIFIER_RETIRED,
                                 VERIFIER_ROUNDS, VERIFIER_SPECULATING, IntervalMeter, drafter_signals,
                                 verifier_signals)

SPEC = AutoscalerSpec(target_utilization=0.6, hysteresis=0.25, smoothing=1.0)
CALM = VerifierLoad(draft_wait=0.05, speculating=0.9)


def decide(busy: float, replicas: int, verifier: VerifierLoad | None = CALM, queued: float = 0.0, low: int = 1,
           high: int = 4, spec: AutoscalerSpec = SPEC, previous: float | None = None,
           scalable: float | None = None):
    return ReplicaPlanner(spec).decide(DrafterLoad(busy, queued, scalable), verifier, replicas, low, high,
                                       previous)


def test_scales_up_for_the_drafting_demand_and_when_the_verifier_waits_on_a_busy_drafter():
    assert decide(busy=0.9, replicas=1).replicas == 2  # 0.9 replicas' worth at 60% each
    assert decide(busy=0.6, replicas=1, queued=1.2).replicas == 3  # calls waiting are demand too
    waiting = VerifierLoad(draft_wait=0.5, speculating=1.0)
    d = decide(busy=0.6, replicas=1, verifier=waiting)
    assert (d.replicas, d.kind) == (2, "draft_wait")
    # waiting on drafts while the drafter idles is a hop or a slow model, not capacity: no replica for it
    assert decide(busy=0.2, replicas=1, verifier=waiting).replicas == 1
    assert decide(busy=5.0, replicas=2, high=4).replicas == 4  # max_replicas bounds it


def test_a_busy_drafter_whose_step_cost_does_not_grow_with_its_requests_gets_no_replica_more():
    """A GPU drafter's step costs about the same for 1 or 16 requests: splitting its requests over more replicas
    would not shorten a draft, so only the compute that grows with the requests, and calls waiting, count."""
    flat = decide(busy=0.9, replicas=1, scalable=0.03)
    assert (flat.replicas, flat.kind) == (1, "hold")
    waiting = VerifierLoad(draft_wait=0.5, speculating=1.0)
    assert decide(busy=0.9, replicas=1, scalable=0.03, verifier=waiting).replicas == 1
    assert decide(busy=0.9, replicas=3, scalable=0.03).replicas == 1  # replicas added for busy time go
    assert decide(busy=0.9, replicas=1, scalable=0.03, queued=0.8).replicas == 2  # calls queue: a replica helps
    assert decide(busy=0.9, replicas=1, scalable=0.8).replicas == 2  # compute grows with requests: as busy


def test_scales_down_when_drafters_idle_or_speculation_is_off():
    d = decide(busy=0.3, replicas=3)
    assert (d.replicas, d.kind) == (1, "demand")
    off = decide(busy=1.5, replicas=3, verifier=VerifierLoad(draft_wait=0.0, speculating=0.01), low=1)
    assert (off.replicas, off.kind) == (1, "speculation_off")
    assert decide(busy=0.0, replicas=2, low=0).replicas == 1  # traffic: a drafter at zero would never be called
    no_signals = ReplicaPlanner(SPEC).decide(None, CALM, 3, 1, 4, None)
    assert (no_signals.replicas, no_signals.kind) == (3, "no_signals")


def test_goes_to_zero_only_when_speculation_is_off_or_there_is_no_traffic_and_returns_with_speculation():
    off = VerifierLoad(draft_wait=0.0, speculating=0.01, rounds=40.0)
    idle = VerifierLoad(draft_wait=0.0, speculating=1.0, rounds=0.0)
    busy = VerifierLoad(draft_wait=0.1, speculating=0.9, rounds=40.0)
    assert (decide(busy=1.5, replicas=2, verifier=off, low=0).replicas,
            decide(busy=1.5, replicas=2, verifier=off, low=0).kind) == (0, "speculation_off")
    assert (decide(busy=0.0, replicas=1, verifier=idle, low=0).replicas,
            decide(busy=0.0, replicas=1, verifier=idle, low=0).kind) == (0, "idle")
    assert decide(busy=0.0, replicas=3, verifier=idle, low=1).replicas == 1  # min_replicas still holds
    planner = ReplicaPlanner(SPEC)
    # at zero a drafter reports nothing: the verifier's signals alone bring it back, or keep it at zero
    back = planner.decide(None, busy, 0, 0, 4, 0.3)
    assert (back.replicas, back.kind) == (1, "speculating")
    assert planner.decide(None, off, 0, 0, 4, 0.3).replicas == 0
    assert planner.decide(None, idle, 0, 0, 4, 0.3).replicas == 0
    # no round finished in the window but requests held: a verify step slower than the window (a busy machine),
    # not idleness; the drafters stay (and come back from zero)
    slow = VerifierLoad(draft_wait=0.0, speculating=1.0, rounds=0.0, requests=2.0)
    assert decide(busy=0.0, replicas=1, verifier=slow, low=0).kind != "idle"
    assert decide(busy=0.0, replicas=1, verifier=slow, low=0).replicas == 1
    assert planner.decide(None, slow, 0, 0, 4, 0.3).replicas == 1
    assert decide(busy=0.0, replicas=1, verifier=VerifierLoad(0.0, 1.0, 0.0, requests=0.0), low=0).kind == "idle"
    assert planner.decide(None, busy, 0, 0, 0, None).replicas == 0  # max_replicas 0 wins


def test_follows_a_domain_mix_shift():
    planner = ReplicaPlanner(SPEC)
    replicas = {"code": 1, "legal": 1}
    for busy in ({"code": 1.6, "legal": 0.1}, {"code": 0.1, "legal": 1.6}):
        for _ in range(3):
            for name in replicas:
                d = planner.decide(DrafterLoad(busy[name], 0.0), CALM, replicas[name], 1, 4,
                                   None)
                replicas[name] = d.replicas
        hot = max(busy, key=busy.get)
        assert replicas[hot] == 3 and replicas[min(busy, key=busy.get)] == 1


def test_no_flapping_on_a_noisy_signal():
    rng = random.Random(0)
    planner, replicas, demand, seen = ReplicaPlanner(AutoscalerSpec(smoothing=0.5)), 2, None, set()
    for _ in range(500):  # 2 replicas carry 0.75..1.05 replicas' worth at 60%, and would not fit in 1 at 45%
        d = planner.decide(DrafterLoad(rng.uniform(0.75, 1.05), 0.0), CALM, replicas, 1, 4, demand)
        replicas, demand = d.replicas, d.demand
        seen.add(replicas)
    assert seen == {2}


def test_signals_are_rates_over_the_reporting_interval():
    now = [0.0]
    meter = IntervalMeter(clock=lambda: now[0])
    meter.add("compute_s", 1.5)
    meter.add("queued_s", 0.5)
    meter.add("scalable_s", 0.25)
    now[0] = 5.0
    assert drafter_signals(meter, 7) == {DRAFTER_BUSY: 0.3, DRAFTER_QUEUED: 0.1, DRAFTER_SCALABLE: 0.05,
                                         DRAFTER_REQUESTS: 7.0, DRAFTER_GENERALIST: 0.0}
    now[0] = 10.0
    assert drafter_signals(meter, 0)[DRAFTER_BUSY] == 0.0
    v = IntervalMeter(clock=lambda: now[0])
    for k in (0, 0, 3, 4):
        v.add("rounds")
        v.add("speculated", k > 0)
        v.add("k", k)
    v.add("draft_wait_s", 2.0)
    now[0] = 20.0
    assert verifier_signals(v, 3) == {VERIFIER_DRAFT_WAIT: 0.2, VERIFIER_SPECULATING: 0.5, "mean_k": 1.75,
                                      VERIFIER_ROUNDS: 0.4, VERIFIER_REQUESTS: 3.0}
    idle = verifier_signals(v, 0)
    assert idle[VERIFIER_SPECULATING] == 1.0 and idle[VERIFIER_ROUNDS] == 0.0  # idle: not "speculation off"


def _context(name: str, replicas: int, metrics: dict[str, list[float]], state: dict | None = None,
             ongoing: float = 0.0, low: int = 1) -> tuple[DeploymentID, AutoscalingContext]:
    dep = DeploymentID(name=name, app_name="cosine")
    ids = [ReplicaID(f"{name}-{i}", dep) for i in range(replicas)]
    ctx = AutoscalingContext(
        deployment_id=dep, deployment_name=name, app_name="cosine", current_num_replicas=replicas,
        target_num_replicas=replicas, running_replicas=ids, total_num_requests=ongoing, total_queued_requests=0.0,
        aggregated_metrics={m: dict(zip(ids, vals)) for m, vals in metrics.items()}, raw_metrics=None,
        capacity_adjusted_min_replicas=low, capacity_adjusted_max_replicas=4, policy_state=state or {},
        last_scale_up_time=None, last_scale_down_time=None, current_time=0.0,
        config=AutoscalingConfig(min_replicas=low, max_replicas=4))
    return dep, ctx


def test_the_serve_policy_reads_every_replica_and_keeps_its_state():
    policy = DrafterAutoscaler(target_utilization=0.5, smoothing=0.5)
    contexts = dict([
        _context("Verifier", 1, {VERIFIER_DRAFT_WAIT: [0.1], VERIFIER_SPECULATING: [0.8]}, ongoing=3),
        _context("Drafter-code", 2, {DRAFTER_BUSY: [0.7, 0.6], DRAFTER_QUEUED: [0.0, 0.1], DRAFTER_REQUESTS: [3, 2]},
                 state={"demand": 1.2}),
        _context("Drafter-legal", 1, {DRAFTER_BUSY: [0.1], DRAFTER_QUEUED: [0.0], DRAFTER_REQUESTS: [1]}),
        _context("Drafter-new", 1, {}),
        # busy, but its step costs the same for all its requests: nothing more replicas would share
        _context("Drafter-flat", 2, {DRAFTER_BUSY: [0.9, 0.8], DRAFTER_QUEUED: [0.0, 0.0],
                                     DRAFTER_SCALABLE: [0.02, 0.01], DRAFTER_REQUESTS: [4, 4]}),
    ])
    decisions, state = policy(contexts)
    by_name = {d.name: n for d, n in decisions.items()}
    assert by_name["Drafter-flat"] == 1
    assert by_name["Drafter-code"] == 3  # 0.5 * 1.4 + 0.5 * 1.2 = 1.3 replicas' worth, at most 50% each
    assert by_name["Drafter-legal"] == 1 and by_name["Drafter-new"] == 1
    assert {d.name: s.get("demand") for d, s in state.items()}["Drafter-code"] == pytest.approx(1.3)
    assert by_name["Verifier"] == pytest.approx(1.5)  # Serve's queue-length policy: 3 ongoing, target 2 per replica


def test_the_serve_policy_brings_a_drafter_back_from_zero_when_the_verifier_speculates_for_traffic():
    policy = DrafterAutoscaler()

    def decisions(speculating: float, rounds: float, requests: float = 0.0) -> dict[str, int]:
        contexts = dict([
            _context("Verifier", 1, {VERIFIER_DRAFT_WAIT: [0.0], VERIFIER_SPECULATING: [speculating],
                                     VERIFIER_ROUNDS: [rounds], VERIFIER_REQUESTS: [requests]}),
            _context("Drafter-code", 0, {}, low=0),
            _context("Drafter-legal", 1, {DRAFTER_BUSY: [0.2], DRAFTER_QUEUED: [0.0], DRAFTER_REQUESTS: [2]},
                     low=0)])
        return {d.name: n for d, n in policy(contexts)[0].items() if d.name.startswith("Drafter-")}

    assert decisions(speculating=0.8, rounds=30.0) == {"Drafter-code": 1, "Drafter-legal": 1}
    assert decisions(speculating=0.0, rounds=30.0) == {"Drafter-code": 0, "Drafter-legal": 0}
    assert decisions(speculating=1.0, rounds=0.0) == {"Drafter-code": 0, "Drafter-legal": 0}
    # a verify step longer than the look-back window, requests held: traffic, the drafters stay or come back
    assert decisions(speculating=1.0, rounds=0.0, requests=2.0) == {"Drafter-code": 1, "Drafter-legal": 1}


def test_domain_drafters_go_to_their_minimum_once_the_verifier_retired_them_for_a_whole_window():
    """The verifier retires the domain drafters while the controller puts (nearly) every round on the generalist
    (speculation/retirement.py): after a whole look-back window of that on every verifier replica they go to
    min_replicas (zero here), and they come back as soon as one interval was not retired; the generalist keeps what
    its demand asks, also while it has no replica to say it is the generalist (the policy's state remembers)."""
    policy = DrafterAutoscaler(smoothing=1.0)
    state: dict = {}

    def decisions(retired: list[float], replicas: dict[str, int]) -> dict[str, int]:
        # `retired`: each verifier replica's mean of its interval reports over the look-back window
        n = len(retired)
        contexts = dict([_context("Verifier", n, {VERIFIER_DRAFT_WAIT: [0.05] * n, VERIFIER_SPECULATING: [0.9] * n,
                                                  VERIFIER_ROUNDS: [60.0] * n, VERIFIER_RETIRED: retired})])
        for name, r in replicas.items():
            busy = 1.0 if name == "generic" else 0.0
            metrics = {DRAFTER_BUSY: [busy] * r, DRAFTER_QUEUED: [0.0] * r, DRAFTER_REQUESTS: [4] * r,
                       DRAFTER_GENERALIST: [float(name == "generic")] * r} if r else {}
            contexts.update([_context(f"Drafter-{name}", r, metrics, low=0,
                                      state=state.get(f"Drafter-{name}"))])
        out, new_state = policy(contexts)
        state.update({d.name: st for d, st in new_state.items()})
        return {d.name[len("Drafter-"):]: r for d, r in out.items() if d.name.startswith("Drafter-")}

    # retired for part of the window, or on one replica only: not yet
    assert decisions([0.8], {"code": 1, "legal": 1, "generic": 1}) == {"code": 1, "legal": 1, "generic": 2}
    assert decisions([1.0, 0.9], {"code": 1, "legal": 1, "generic": 1}) == {"code": 1, "legal": 1, "generic": 2}
    assert decisions([1.0], {"code": 1, "legal": 1, "generic": 1}) == {"code": 0, "legal": 0, "generic": 2}
    assert decisions([1.0], {"code": 0, "legal": 0, "generic": 0}) == {"code": 0, "legal": 0, "generic": 1}
    assert decisions([0.9], {"code": 0, "legal": 0, "generic": 1}) == {"code": 1, "legal": 1, "generic": 2}
    # a verifier that does not report it (retirement off) never retires them
    assert verifier_load(_context("Verifier", 1, {VERIFIER_DRAFT_WAIT: [0.0], VERIFIER_SPECULATING: [1.0]})[1]) \
        .retired is False
    d = ReplicaPlanner(SPEC).decide(DrafterLoad(0.0, 0.0), VerifierLoad(0.05, 0.9, 60.0, retired=True), 1, 1, 4, None)
    assert (d.replicas, d.kind) == (1, "retired")  # min_replicas still holds


def test_policy_kwargs_are_validated():
    with pytest.raises(ValueError, match="target_utilization"):
        DrafterAutoscaler(target_utilization=2.0)
    with pytest.raises(ValueError, match="extra"):
        DrafterAutoscaler(target_utilisation=0.5)


def test_a_drafter_measures_the_part_of_its_step_that_grows_with_its_requests():
    """`DrafterServer.batch_cost`, what a drafter replica's `scalable` signal is computed from: a fixed part and a
    part per request, both measured on the drafter's own thread and hardware."""
    from assembly.drafter_server import DrafterServer

    server = DrafterServer.from_spec(DrafterSpec(name="code", model="drafter-code"))
    cost = server.batch_cost(8)
    assert cost.a > 0 and cost.b >= 0
    assert [n for n, _ in cost.samples] == [1, 4, 8]  # measured at 1, batch / 2 and batch requests
    b, a = np.polyfit(*zip(*cost.samples), 1)  # the least-squares line through them (kept non-negative)
    assert (cost.a, cost.b) == pytest.approx((max(a, 0.0), max(b, 0.0)), rel=1e-9, abs=1e-12)
    server.executor.shutdown()


def test_drafters_go_to_their_minimum_while_the_auto_tier_drafts_on_the_verifiers_hardware():
    """`speculation.drafting_tier: auto` (speculation/tiers.py): the verifier reports the share of rounds its chooser
    put on the drafter deployments. Below speculation_off_below (the chooser's probes of the unused tier stay
    under it) every drafter goes to min_replicas, zero included; a verifier drafting remotely gets the usual
    demand-driven replicas, and a drafter at zero comes back once the chooser puts rounds on it again."""
    from speculation.tiers import VERIFIER_REMOTE

    policy = DrafterAutoscaler()

    def decisions(remote: list[float], code: int) -> dict[str, int]:
        n = len(remote)
        contexts = dict([
            _context("Verifier", n, {VERIFIER_DRAFT_WAIT: [0.05] * n, VERIFIER_SPECULATING: [0.9] * n,
                                     VERIFIER_ROUNDS: [60.0] * n, VERIFIER_REMOTE: remote}),
            _context("Drafter-code", code, {DRAFTER_BUSY: [0.9] * code, DRAFTER_QUEUED: [0.0] * code,
                                            DRAFTER_REQUESTS: [4] * code} if code else {}, low=0)])
        return {d.name: r for d, r in policy(contexts)[0].items() if d.name.startswith("Drafter-")}

    assert decisions([0.01], code=2) == {"Drafter-code": 0}  # probes only: the drafters would cost more than hide
    # one verifier replica drafts remotely: its demand decides (1.8 replicas' worth, at most 60% each)
    assert decisions([0.01, 0.6], code=2) == {"Drafter-code": 3}
    assert decisions([0.5], code=0) == {"Drafter-code": 1}  # back from zero
    assert verifier_load(_context("Verifier", 1, {VERIFIER_DRAFT_WAIT: [0.0], VERIFIER_SPECULATING: [1.0]})[1]) \
        .remote is None  # a fixed tier does not report it
    d = ReplicaPlanner(SPEC).decide(DrafterLoad(0.9, 0.0), VerifierLoad(0.05, 0.9, 60.0, remote=0.0), 2, 1, 4, None)
    assert (d.replicas, d.kind) == (1, "colocated")
