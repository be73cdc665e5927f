"""The speculation deployment (CoSine's central node): a thin Serve wrapper around `SpeculationCoordinator`,
holding handles to the drafter deployments."""

from __future__ import annotations

from ray import serve

from deployments.coordinator import SpeculationCoordinator
from deployments.routing import RoutingConfig
from deployments.verifier import draft_to_dict


@serve.deployment(name="Speculation")
class SpeculationDeployment:
    def __init__(self, config: dict, drafters: dict):
        from serve_app.config import AppConfig
        from serve_app.engines import target_input_embeddings

        cfg = AppConfig.model_validate(config)
        self.handles = drafters  # name -> DeploymentHandle
        spec = cfg.speculation
        fixed = spec.fixed_drafters
        if spec.mode == "chain" and not fixed:
            fixed = [cfg.drafters[0].name]
        self.coordinator = SpeculationCoordinator(
            list(drafters), RoutingConfig(**cfg.routing.model_dump()), target_input_embeddings(cfg),
            fusion=spec.fusion and spec.mode == "cosine", fixed_drafters=fixed)
        self.budget = spec.tree_budget

    async def _step(self, name: str, items: list[dict]) -> dict:
        return await self.handles[name].step.remote(items)

    async def draft(self, batch: list[dict]) -> dict[str, dict]:
        drafts = await self.coordinator.draft(batch, self._step, self.budget)
        return {r: draft_to_dict(d) for r, d in drafts.items()}

    async def release(self, rids: list[str]) -> None:
        per: dict[str, list[str]] = {}
        for r in rids:
            for n in self.coordinator.release(r):
                per.setdefault(n, []).append(r)
        for n, rs in per.items():
            self.handles[n].release.remote(rs)

    def routing_ranking(self, rid: str) -> list[str] | None:
        r = self.coordinator.router
        return r.ranking(rid) if rid in r.requests else None
