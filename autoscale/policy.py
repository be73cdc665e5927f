"""The drafter autoscaler: an application-level Ray Serve autoscaling policy that sizes each domain's drafter
deployment for the drafting the goodput controller asks of it.

    applications:
      - name: cosine
        import_path: serve_app.graph:build_app
        autoscaling_policy:
          policy_function: autoscale.policy:DrafterAutoscaler
          policy_kwargs: {target_utilization: 0.6}      # config.AutoscalerSpec
        args: {... drafters: [{name: code, deployment: {autoscaling_config: {min_replicas: 1, max_replicas: 4}}}]}

Drafting demand is not traffic. The verifier's goodput controller (speculation/goodput.py) picks every request's
draft length each round: long drafts at light load, shorter ones as the verifier fills, none when verifying draft
tokens no longer pays (SmartSpec). What a drafter deployment must serve is the drafting those choices generate
for the requests routed to it: so each drafter replica reports how much of its time it computes and how long
calls wait for it (speculation/signals.py), and a deployment gets the replicas that carry that demand at
`target_utilization`. The verifier reports whether the controller is speculating at all (no: every drafter to its
minimum, whatever the traffic) and how long it waits for drafts (a busy drafter it waits on gets a replica more).
Every deployment of the application with an autoscaling_config takes part; those that are not drafters keep
Serve's default (queue-length) policy. Serve then applies each deployment's bounds and up/down delays.

Routing is not traffic either. Where drafters share hardware, a batch spread over every domain's drafter costs
a drafter step per domain and depth, and the controller puts whole rounds on the generalist drafter instead
(speculation/goodput.py, participation): at high load the domain drafters are then asked nearly nothing. The
verifier, not this policy, decides when they may go: it retires them (speculation/retirement.py), drafting the few
remaining routed rounds on the generalist too, and reports it; after a whole look-back window of that, every
drafter but the generalist goes to its minimum, and comes back as soon as the verifier routes again. Were the policy
to decide from the routed share itself, a routed call could reach a drafter after its last replica went, and Serve
starts a replica for a call waiting at a handle (measured: seconds of the cores the verifier uses, each time).

`speculation.drafting_tier: auto`: the verifier drafts each round on its own hardware or on the drafter
deployments, whichever its chooser predicts more goodput of at the current load (speculation/tiers.py), and reports
the share it puts on the deployments; below `speculation_off_below` (the chooser's probes of the unused tier stay
under it) every drafter goes to its minimum, and a round the chooser puts on a drafter at zero is drafted on the
verifier's hardware while the drafter comes back.

Zero replicas (`min_replicas: 0`): a drafter goes to zero only when no drafting is asked of it for a reason the
verifier states, speculation off, rounds on the generalist or no traffic at all, and comes back (Serve skips the
upscale delay from zero) as soon as the verifier has requests to speculate for (routed ones, for a domain
drafter). While it speculates for traffic every drafter keeps a replica: the speculation node does not call a
drafter at zero, so its demand could never show and it would stay out of the domain mix for good.
"""

from __future__ import annotations

import logging

from ray.serve.autoscaling_policy import replica_queue_length_autoscaling_policy
from ray.serve.config import AutoscalingContext

from autoscale.decisions import Decision, DrafterLoad, ReplicaPlanner, VerifierLoad
from config import AutoscalerSpec
from speculation.signals import (DRAFTER_BUSY, DRAFTER_GENERALIST, DRAFTER_QUEUED, DRAFTER_SCALABLE,
                                 VERIFIER_DRAFT_WAIT, VERIFIER_REQUESTS, VERIFIER_RETIRED, VERIFIER_ROUNDS,
                                 VERIFIER_SPECULATING)
from speculation.tiers import VERIFIER_REMOTE

logger = logging.getLogger("ray.serve")

DRAFTER_PREFIX = "Drafter-"  # serve_app/graph.py names each drafter deployment so
VERIFIER = "Verifier"


def _summed(ctx: AutoscalingContext, name: str) -> float | None:
    per_replica = (ctx.aggregated_metrics or {}).get(name)
    return sum(per_replica.values()) if per_replica else None


def drafter_load(ctx: AutoscalingContext) -> DrafterLoad | None:
    busy, queued = _summed(ctx, DRAFTER_BUSY), _summed(ctx, DRAFTER_QUEUED)
    if busy is None or queued is None:
        return None
    return DrafterLoad(busy, queued, _summed(ctx, DRAFTER_SCALABLE), bool(_summed(ctx, DRAFTER_GENERALIST)))


def verifier_load(ctx: AutoscalingContext | None) -> VerifierLoad | None:
    if ctx is None:
        return None
    metrics = ctx.aggregated_metrics or {}
    wait, spec = metrics.get(VERIFIER_DRAFT_WAIT), metrics.get(VERIFIER_SPECULATING)
    if not wait or not spec:
        return None
    rounds, retired = metrics.get(VERIFIER_ROUNDS), metrics.get(VERIFIER_RETIRED)
    remote, requests = metrics.get(VERIFIER_REMOTE), metrics.get(VERIFIER_REQUESTS)
    return VerifierLoad(sum(wait.values()) / len(wait), sum(spec.values()) / len(spec),
                        sum(rounds.values()) if rounds else None,
                        # each report is 1 only for an interval retired all through: the window's mean is 1 only
                        # when it was retired through the whole window
                        bool(retired) and min(retired.values()) > 1 - 1e-6,
                        # the most any verifier replica drafts remotely: the drafters serve them all
                        max(remote.values()) if remote else None,
                        requests=sum(requests.values()) if requests else None)


class DrafterAutoscaler:
    """`policy_function` of the application's `autoscaling_policy`; `policy_kwargs` are `AutoscalerSpec`'s."""

    def __init__(self, **policy_kwargs):
        self.spec = AutoscalerSpec.model_validate(policy_kwargs)
        self.planner = ReplicaPlanner(self.spec)
        self.last: dict[str, tuple[int, str]] = {}  # drafter -> (target, kind) last logged
        self.last_demand: dict[str, float] = {}  # drafter -> demand last exported
        self._metrics = None

    def __call__(self, contexts: dict) -> tuple[dict, dict]:
        """Serve's application-level policy call: {DeploymentID: context} -> ({DeploymentID: replicas},
        {DeploymentID: state kept for the next call})."""
        verifier = verifier_load(next((c for d, c in contexts.items() if d.name == VERIFIER), None))
        decisions, states = {}, {}
        for dep, ctx in contexts.items():
            if not dep.name.startswith(DRAFTER_PREFIX):
                decisions[dep], states[dep] = replica_queue_length_autoscaling_policy(ctx)
                continue
            load = drafter_load(ctx)
            generalist = load.generalist if load is not None else ctx.policy_state.get("generalist", False)
            d = self.planner.decide(load, verifier, ctx.current_num_replicas,
                                    ctx.capacity_adjusted_min_replicas, ctx.capacity_adjusted_max_replicas,
                                    ctx.policy_state.get("demand"), generalist)
            decisions[dep], states[dep] = d.replicas, {"demand": d.demand, "generalist": generalist}
            self._report(dep.name[len(DRAFTER_PREFIX):], ctx, d)
        return decisions, states

    def _report(self, drafter: str, ctx: AutoscalingContext, d: Decision) -> None:
        """A log line and the target gauge when a drafter's target or its reason changes, the demand gauge when
        the demand moves: Serve calls the policy every control-loop tick (0.1 s), in its controller, on the
        cores the replicas share."""
        if self._metrics is None:
            from ray.util import metrics

            self._metrics = (
                metrics.Gauge("cosine_autoscaler_target_replicas", "drafter replicas the autoscaler wants (before "
                              "Serve's up/down delays), by drafter and reason", tag_keys=("drafter", "reason")),
                metrics.Gauge("cosine_autoscaler_drafting_demand", "replicas' worth of drafting asked of a drafter "
                              "deployment (smoothed)", tag_keys=("drafter",)))
        target, demand = self._metrics
        previous = self.last.get(drafter)
        if previous != (d.replicas, d.kind):
            if previous is not None and previous[1] != d.kind:
                target.set(0, tags={"drafter": drafter, "reason": previous[1]})
            target.set(d.replicas, tags={"drafter": drafter, "reason": d.kind})
            logger.info("drafter autoscaler: Drafter-%s %d -> %d replicas (running %d): %s", drafter,
                        ctx.target_num_replicas, d.replicas, ctx.current_num_replicas, d.reason)
            self.last[drafter] = (d.replicas, d.kind)
        if abs(d.demand - self.last_demand.get(drafter, -1.0)) > 0.005:
            demand.set(d.demand, tags={"drafter": drafter})
            self.last_demand[drafter] = d.demand
