"""The drafter deployment: one per domain, a thin Serve wrapper around `DrafterServer` (plain, testable).

The fusion node calls `step` for all requests routed to this drafter that need proposals. Each item carries the
context the drafter must continue (the committed context, plus the fused prefix when fusion overrode the
drafter's own token): the engine keeps the agreeing cached prefix, so a replica that never saw the request, or
restarted, simply rebuilds it. An item asks for `steps` > 1 to get the drafter's whole chain from one call, each
proposal fed back as the next input: one hop instead of one per depth.
"""

from __future__ import annotations

import asyncio
import time

from ray import serve

from engines.drafter import DrafterEngine
from engines.runner import CacheFull


def proposal_dict(p) -> dict:
    return {"token": p.token, "prob": p.prob, "top_tokens": p.top_tokens, "top_probs": p.top_probs,
            "context_loglik": p.context_loglik}


class DrafterServer:
    def __init__(self, name: str, model, max_requests: int = 64, max_len: int = 2048, device: str | None = None):
        self.name = name
        self.engine = DrafterEngine(model, name=name, max_requests=max_requests, max_len=max_len, device=device)

    def step(self, items: list[dict]) -> dict[str, dict]:
        """items: {"rid", "context": [...]} (the cached prefix that agrees is kept); "score_context" asks for the
        context's log-likelihood (cold-start routing); "steps": n > 1 continues the chain from the drafter's own
        tokens and returns the n - 1 later proposals under "more"."""
        rids = []
        for it in items:
            rid = it["rid"]
            try:
                self.engine.sync(rid, it["context"])
            except CacheFull:
                self.engine.release(rid)
                continue
            rids.append(rid)
        if not rids:
            return {}
        want_loglik = any(it.get("score_context") for it in items)
        first = self.engine.step(rids, want_loglik=want_loglik)
        out = {r: proposal_dict(p) for r, p in first.items()}
        more = {it["rid"]: it["steps"] - 1 for it in items if it.get("steps", 1) > 1 and it["rid"] in first}
        if more:
            for r in more:
                self.engine.feed(r, [first[r].token])
            for r, chain in self.engine.draft(list(more), more).items():
                out[r]["more"] = [proposal_dict(p) for p in chain]
        return out

    def release(self, rids: list[str]) -> None:
        for r in rids:
            if r in self.engine:
                self.engine.release(r)


@serve.deployment(name="Drafter")
class DrafterDeployment:
    def __init__(self, name: str, model: str, max_requests: int = 64, max_len: int = 2048, device: str = "auto"):
        from model_family.paths import model_path

        from ray.serve import metrics

        self.server = DrafterServer(name, str(model_path(model)), max_requests, max_len, device)
        self.lock = asyncio.Lock()  # the engine is not re-entrant; concurrent callers queue up
        self.requests_gauge = metrics.Gauge("cosine_drafter_requests", "requests holding a KV cache in this "
                                            "drafter replica, by drafter", tag_keys=("drafter",))
        self.requests_gauge.set_default_tags({"drafter": name})

    async def step(self, items: list[dict]) -> dict:
        """{"proposals": {rid: proposal}, "compute_ms": time spent in the engine} (the rest of a call is hops)."""
        async with self.lock:
            t = time.perf_counter()
            proposals = await asyncio.to_thread(self.server.step, items)
            self.requests_gauge.set(len(self.server.engine.states))
            return {"proposals": proposals, "compute_ms": (time.perf_counter() - t) * 1000}

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

    def check_health(self) -> None:
        pass
