"""The speculation deployment (CoSine's central node): a thin Serve wrapper around `SpeculationCoordinator`,
holding handles to the drafter deployments."""

from __future__ import annotations

import asyncio
import time

from ray import serve
from ray.serve import metrics

from config import AppConfig
from speculation.coordinator import SpeculationCoordinator
from speculation.messages import Draft, DrafterCall, DraftRequest, Proposal


class DrafterFailures:
    """`cosine_drafter_failures{drafter}`: drafter calls that failed or timed out, counted by the coordinator in
    either drafting-tier layout (its `on_failure`)."""

    def __init__(self):
        self.counter = metrics.Counter("cosine_drafter_failures", "drafter calls that failed or timed out, by "
                                       "drafter", tag_keys=("drafter",))

    def __call__(self, drafter: str) -> None:
        self.counter.inc(tags={"drafter": drafter})


@serve.deployment(name="Speculation")
class SpeculationDeployment:
    def __init__(self, config: AppConfig, drafters: dict):
        self.handles = drafters  # name -> DeploymentHandle
        self.coordinator = SpeculationCoordinator.from_config(config)
        self.coordinator.on_failure = DrafterFailures()
        self.homes: dict[tuple[str, str], str] = {}  # (drafter, request) -> the replica holding its cache
        self.timing = {"rounds": 0, "round_ms": 0.0, "drafter_calls": 0, "drafter_call_ms": 0.0,
                       "drafter_compute_ms": 0.0, "lockstep_depths": 0, "rehomed": 0}
        bounds = [0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500]
        self.step_ms = metrics.Histogram("cosine_drafter_step_ms", "one drafter call as seen by the speculation "
                                         "node (hops included), by drafter", boundaries=bounds, tag_keys=("drafter",))
        self.compute_ms = metrics.Histogram("cosine_drafter_compute_ms", "the drafter engine's share of a call, by "
                                            "drafter", boundaries=bounds, tag_keys=("drafter",))

    async def _step(self, name: str, calls: list[DrafterCall]) -> dict[str, list[Proposal]]:
        """One drafter's share of a round: a call per replica holding some of the requests (their home), plus one
        for requests without a home yet (deployments/replica_affinity.py)."""
        groups: dict[str | None, list[DrafterCall]] = {}
        for c in calls:
            groups.setdefault(self.homes.get((name, c.request_id)), []).append(c)
        replies = await asyncio.gather(*(self._call(name, home, cs) for home, cs in groups.items()))
        chains: dict[str, list[Proposal]] = {}
        for (home, cs), reply in zip(groups.items(), replies):
            for c in cs:
                if c.request_id not in reply.chains:  # the drafter could not hold it
                    continue
                if home is not None and reply.replica != home:
                    self.timing["rehomed"] += 1  # its replica is gone: rebuilt on another from the full context
                self.homes[(name, c.request_id)] = reply.replica
            chains.update(reply.chains)
        return chains

    async def _call(self, name: str, home: str | None, calls: list[DrafterCall]):
        t = time.perf_counter()
        reply = await self.handles[name].step.remote(calls, home=home)
        ms = (time.perf_counter() - t) * 1000
        self.timing["drafter_calls"] += 1
        self.timing["drafter_call_ms"] += ms
        self.timing["drafter_compute_ms"] += reply.compute_ms
        self.step_ms.observe(ms, tags={"drafter": name})
        self.compute_ms.observe(reply.compute_ms, tags={"drafter": name})
        return reply

    async def draft(self, batch: list[DraftRequest]) -> dict[str, Draft]:
        t = time.perf_counter()
        drafts = await self.coordinator.draft(batch, self._step)
        self.timing["rounds"] += 1
        self.timing["round_ms"] += (time.perf_counter() - t) * 1000
        self.timing["lockstep_depths"] += max((d.k for d in batch), default=0)
        return drafts

    def stats(self) -> dict:
        """Where a speculation round's time goes: drafter compute vs. the hops around it."""
        return dict(self.timing, **self.coordinator.state())

    async def release(self, rids: list[str]) -> None:
        per: dict[tuple[str, str | None], list[str]] = {}
        for r in rids:
            for n in self.coordinator.release(r):
                per.setdefault((n, self.homes.pop((n, r), None)), []).append(r)
        for (n, home), rs in per.items():
            self.handles[n].release.remote(rs, home=home)

    async def placement(self, timeout_s: float = 10.0) -> dict[str, dict]:
        """Each drafter's node and device (one replica's: replicas of a deployment share their options); a drafter
        that does not answer in time (a hung replica) is left out."""
        names = list(self.handles)

        async def one(n: str) -> dict:
            return await asyncio.wait_for(self.handles[n].placement.remote(), timeout_s)

        got = await asyncio.gather(*(one(n) for n in names), return_exceptions=True)
        return {n: p for n, p in zip(names, got) if isinstance(p, dict)}

    def routing_history(self) -> list[tuple[str, list[str]]]:
        """(request id, drafters by routing score) of recently finished requests."""
        return list(self.coordinator.routing_history)
