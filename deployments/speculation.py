"""The speculation deployment (CoSine's central node): a thin Serve wrapper around `SpeculationCoordinator`,
holding handles to the drafter deployments."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time

from ray import serve
from ray.serve import metrics

from config import AppConfig
from speculation.coordinator import SpeculationCoordinator
from speculation.messages import DrafterCall, DraftRequest, DraftRound, Proposal

logger = logging.getLogger("ray.serve")


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
        # drafters the autoscaler may take to zero replicas: a call to one at zero would wait at its handle until
        # the round's deadline, so those at zero are parked (not called) until Serve runs a replica again
        self.may_park = [d.name for d in config.drafters if (a := d.deployment.autoscaling_config) is not None
                         and a.min_replicas == 0]
        self.watch: asyncio.Task | None = None
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

    async def _watch_replicas(self, period_s: float = 1.0) -> None:
        app = serve.get_replica_context().app_name
        while True:
            try:
                deployments = (await asyncio.to_thread(serve.status)).applications[app].deployments
                running = {n for n in self.may_park if deployments[f"Drafter-{n}"].replica_states.get("RUNNING")}
                # Serve's status sees a new replica before this handle's router does: a drafter comes back once a
                # call through the handle reaches it, not before (a round would wait for it at the handle)
                back = [n for n in running if n in self.coordinator.parked]
                reached = await asyncio.gather(*(self._reaches(n, period_s) for n in back))
                parked = (set(self.may_park) - running) | {n for n, ok in zip(back, reached) if not ok}
                for n in parked ^ self.coordinator.parked:
                    logger.info("drafter %s %s", n, "has no replica: parked" if n in parked else "is back")
                self.coordinator.parked = parked
            except Exception as e:  # noqa: BLE001 - keep the last view; Serve's status answers again later
                logger.warning("drafter replicas unknown (%r); keeping the last view", e)
            await asyncio.sleep(period_s)

    async def _reaches(self, name: str, timeout_s: float) -> bool:
        try:
            await asyncio.wait_for(self.handles[name].placement.remote(), timeout_s)
            return True
        except Exception:  # noqa: BLE001 - not yet
            return False

    def _ensure_watch(self) -> None:
        if self.may_park and self.watch is None:  # the loop's own context: not cancelled with the calling request
            self.watch = asyncio.get_running_loop().create_task(self._watch_replicas(), context=contextvars.Context())

    async def draft(self, batch: list[DraftRequest]) -> DraftRound:
        self._ensure_watch()
        t = time.perf_counter()
        got = await self.coordinator.draft(batch, self._step)
        self.timing["rounds"] += 1
        self.timing["round_ms"] += (time.perf_counter() - t) * 1000
        self.timing["lockstep_depths"] += max((d.k for d in batch), default=0)
        return got

    def stats(self) -> dict:
        """Where a speculation round's time goes: drafter compute vs. the hops around it."""
        return dict(self.timing, **self.coordinator.state())

    async def release(self, rids: list[str]) -> None:
        per: dict[tuple[str, str | None], list[str]] = {}
        for r in rids:
            for n in self.coordinator.release(r):
                per.setdefault((n, self.homes.pop((n, r), None)), []).append(r)
        for (n, home), rs in per.items():
            if n not in self.coordinator.parked:  # a parked drafter's caches went with its replicas
                self.handles[n].release.remote(rs, home=home)

    async def placement(self, timeout_s: float = 10.0) -> dict[str, dict]:
        """Each drafter's node and device (one replica's: replicas of a deployment share their options); a drafter
        that does not answer in time (a hung replica) is left out."""
        self._ensure_watch()
        names = [n for n in self.handles if n not in self.coordinator.parked]

        async def one(n: str) -> dict:
            return await asyncio.wait_for(self.handles[n].placement.remote(), timeout_s)

        got = await asyncio.gather(*(one(n) for n in names), return_exceptions=True)
        return {n: p for n, p in zip(names, got) if isinstance(p, dict)}

    def routing_history(self) -> list[tuple[str, list[str]]]:
        """(request id, drafters by routing score) of recently finished requests."""
        return list(self.coordinator.routing_history)
