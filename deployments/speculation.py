"""The speculation deployment (CoSine's central node): a thin Serve wrapper around `SpeculationCoordinator`,
holding handles to the drafter deployments."""

from __future__ import annotations

import asyncio
import time

from ray import serve

from speculation.coordinator import SpeculationCoordinator
from speculation.routing import RoutingConfig
from deployments.verifier import draft_to_dict


@serve.deployment(name="Speculation")
class SpeculationDeployment:
    def __init__(self, config: dict, drafters: dict):
        from config import AppConfig
        from engines.build import target_input_embeddings

        cfg = AppConfig.model_validate(config)
        self.handles = drafters  # name -> DeploymentHandle
        spec = cfg.speculation
        fixed = spec.fixed_drafters
        if spec.mode == "chain" and not fixed:
            fixed = [cfg.drafters[0].name]
        self.coordinator = SpeculationCoordinator(
            list(drafters), RoutingConfig(**cfg.routing.model_dump()), target_input_embeddings(cfg),
            fusion=spec.fusion and spec.mode == "cosine", fixed_drafters=fixed,
            generalists={d.name for d in cfg.drafters if d.generalist})
        self.budget = spec.tree_budget
        self.timing = {"rounds": 0, "round_ms": 0.0, "drafter_calls": 0, "drafter_call_ms": 0.0,
                       "drafter_compute_ms": 0.0, "lockstep_depths": 0}
        from ray.serve import metrics

        bounds = [0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500]
        self.step_ms = metrics.Histogram("cosine_drafter_step_ms", "one lockstep drafter step as seen by the "
                                         "fusion node (hops included), by drafter", boundaries=bounds,
                                         tag_keys=("drafter",))
        self.compute_ms = metrics.Histogram("cosine_drafter_compute_ms", "the drafter engine's share of a step, by "
                                            "drafter", boundaries=bounds, tag_keys=("drafter",))

    async def _step(self, name: str, items: list[dict]) -> dict:
        t = time.perf_counter()
        out = await self.handles[name].step.remote(items)
        self.timing["drafter_calls"] += 1
        self.timing["drafter_call_ms"] += (time.perf_counter() - t) * 1000
        self.timing["drafter_compute_ms"] += out["compute_ms"]
        self.step_ms.observe((time.perf_counter() - t) * 1000, tags={"drafter": name})
        self.compute_ms.observe(out["compute_ms"], tags={"drafter": name})
        return out["proposals"]

    async def draft(self, batch: list[dict]) -> dict[str, dict]:
        t = time.perf_counter()
        drafts = await self.coordinator.draft(batch, self._step, self.budget)
        self.timing["rounds"] += 1
        self.timing["round_ms"] += (time.perf_counter() - t) * 1000
        self.timing["lockstep_depths"] += max((it.get("k", 0) for it in batch), default=0)
        return {r: draft_to_dict(d) for r, d in drafts.items()}

    def stats(self) -> dict:
        """Where a speculation round's time goes: drafter compute vs. the hops around it."""
        return dict(self.timing, **self.coordinator.stats)

    async def release(self, rids: list[str]) -> None:
        per: dict[str, list[str]] = {}
        for r in rids:
            for n in self.coordinator.release(r):
                per.setdefault(n, []).append(r)
        for n, rs in per.items():
            self.handles[n].release.remote(rs)

    async def placement(self) -> dict[str, dict]:
        """Each drafter's node and device (one replica's: replicas of a deployment share their options)."""
        names = list(self.handles)
        got = await asyncio.gather(*(self.handles[n].placement.remote() for n in names), return_exceptions=True)
        return {n: p for n, p in zip(names, got) if isinstance(p, dict)}

    def routing_history(self) -> list[tuple[str, list[str]]]:
        """(request id, drafters by routing score) of recently finished requests."""
        return list(self.coordinator.routing_history)
