"""The drafter deployment: one per domain, a thin Serve wrapper around `speculation.inprocess.DrafterServer`."""

from __future__ import annotations

import asyncio

from ray import serve
from ray.serve import metrics

from config import DrafterSpec
from speculation.inprocess import DrafterServer
from speculation.messages import DrafterCall, DrafterReply


@serve.deployment(name="Drafter")
class DrafterDeployment:
    def __init__(self, spec: DrafterSpec):
        self.server = DrafterServer.from_spec(spec, actor_cpus=spec.deployment.ray_actor_options.get("num_cpus"))
        self.lock = asyncio.Lock()  # the engine is not re-entrant; concurrent callers queue up
        self.requests_gauge = metrics.Gauge("cosine_drafter_requests", "requests holding a KV cache in this "
                                            "drafter replica, by drafter", tag_keys=("drafter",))
        self.requests_gauge.set_default_tags({"drafter": spec.name})

    async def step(self, calls: list[DrafterCall]) -> DrafterReply:
        async with self.lock:
            reply = await self.server.run(calls)
            self.requests_gauge.set(len(self.server.engine.states))
            return reply

    async def release(self, rids: list[str]) -> None:
        async with self.lock:
            self.server.release(rids)
            self.requests_gauge.set(len(self.server.engine.states))

    def placement(self) -> dict:
        """Where this replica computes: its Ray node and device type."""
        import ray

        return {"node_id": ray.get_runtime_context().get_node_id(), "device": self.server.engine.runner.device.type}

    def num_requests(self) -> int:
        """Requests holding a KV cache here (0 once every request has finished or been cancelled)."""
        return len(self.server.engine.states)
