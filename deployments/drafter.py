"""The drafter deployment: one per domain, a thin Serve wrapper around `DrafterEngine`.

The fusion node calls `step` in lockstep for all requests routed to this drafter. Each item either carries the
request's full committed context (first step of a round: the engine keeps the agreeing cached prefix, so a
replica that never saw the request, or restarted, simply rebuilds it) or the token fusion chose to feed.
"""

from __future__ import annotations

import asyncio

from ray import serve

from deployments.engines.drafter import DrafterEngine
from deployments.engines.runner import CacheFull


def proposal_dict(p) -> dict:
    return {"token": p.token, "prob": p.prob, "top_tokens": p.top_tokens, "top_probs": p.top_probs,
            "context_loglik": p.context_loglik}


@serve.deployment(name="Drafter")
class DrafterDeployment:
    def __init__(self, name: str, model: str, max_requests: int = 64, max_len: int = 2048):
        from serve_app.paths import model_path

        self.name = name
        self.engine = DrafterEngine(str(model_path(model)), name=name, max_requests=max_requests, max_len=max_len)
        self.lock = asyncio.Lock()  # the engine is not re-entrant; steps of concurrent callers queue up

    async def step(self, items: list[dict]) -> dict[str, dict]:
        """items: {"rid", "context": [...]} or {"rid", "feed": [...]}, plus "temperature", "seed"."""
        async with self.lock:
            return await asyncio.get_running_loop().run_in_executor(None, self._step, items)

    def _step(self, items: list[dict]) -> dict[str, dict]:
        rids = []
        for it in items:
            rid = it["rid"]
            try:
                if "context" in it or rid not in self.engine:
                    if "context" not in it:
                        continue  # lost this request mid-round: sit the round out, rebuild next round
                    self.engine.sync(rid, it["context"], it.get("temperature", 0.0), it.get("seed"))
                else:
                    self.engine.feed(rid, it["feed"])
            except CacheFull:
                self.engine.release(rid)
                continue
            rids.append(rid)
        if not rids:
            return {}
        want_loglik = any(it.get("score_context") for it in items)
        return {r: proposal_dict(p) for r, p in self.engine.step(rids, want_loglik=want_loglik).items()}

    async def release(self, rids: list[str]) -> None:
        async with self.lock:
            for r in rids:
                if r in self.engine:
                    self.engine.release(r)

    def check_health(self) -> None:
        pass
