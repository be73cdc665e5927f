"""The drafter deployment: one per domain, a thin Serve wrapper around `assembly.drafter_server.DrafterServer`."""

from __future__ import annotations

import asyncio
import time

from ray import serve
from ray.serve import metrics

from config import DrafterSpec
from engines.device_work import warmed_up
from assembly.drafter_server import DrafterServer
from speculation.messages import DrafterCall, DrafterReply
from speculation.signals import IntervalMeter, drafter_signals


@serve.deployment(name="Drafter")
class DrafterDeployment:
    def __init__(self, spec: DrafterSpec, vocab_limit: int | None = None):
        """`vocab_limit`: the token ids the target has (`engines.build.check_models`, run by the graph builder)."""
        self.server = DrafterServer.from_spec(spec, actor_cpus=spec.deployment.ray_actor_options.get("num_cpus"),
                                              vocab_limit=vocab_limit)
        self.server.capture()
        warmed_up()
        self.generalist = spec.generalist
        self.lock = asyncio.Lock()  # the engine is not re-entrant; concurrent callers queue up
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.meter = IntervalMeter()  # busy, queued and scalable time, for the autoscaler
        self.cost = self.server.batch_cost(min(spec.max_requests, 8))
        self.requests_gauge = metrics.Gauge("cosine_drafter_requests", "requests holding a KV cache in this "
                                            "drafter replica, by drafter", tag_keys=("drafter",))
        self.requests_gauge.set_default_tags({"drafter": spec.name})

    async def step(self, calls: list[DrafterCall], home: str | None = None) -> DrafterReply:
        """`home`: the replica the caller wants (deployments/replica_affinity.py routes on it)."""
        t = time.perf_counter()
        async with self.lock:
            self.meter.add("queued_s", time.perf_counter() - t)
            reply = await self.server.run(calls)
            self.meter.add("compute_s", reply.compute_ms / 1000)
            if reply.chains:  # the share of this call's compute that grows with its requests
                n = len(reply.chains)
                self.meter.add("scalable_s", reply.compute_ms / 1000 * self.cost.b * n / max(self.cost(n), 1e-9))
            self.requests_gauge.set(len(self.server.engine.states))
            reply.replica = self.replica
            return reply

    async def release(self, rids: list[str], home: str | None = None) -> None:
        await asyncio.wrap_future(self.server.release_later(rids))  # on the engine's thread, after its steps
        self.requests_gauge.set(len(self.server.engine.states))

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metrics hook (autoscale/policy.py reads them)."""
        return drafter_signals(self.meter, len(self.server.engine.states), self.generalist)

    def placement(self) -> dict:
        """Where this replica computes: its Ray node, device type (a model-free drafter's lookups: the CPU) and
        process."""
        import os

        import ray

        runner = self.server.engine.runner
        return {"node_id": ray.get_runtime_context().get_node_id(),
                "device": "cpu" if runner is None else runner.device.type, "pid": os.getpid()}

    def num_requests(self) -> int:
        """Requests holding a KV cache here (0 once every request has finished or been cancelled)."""
        return len(self.server.engine.states)
