"""SpecRouter's chains (`routing.chain_choice: latency`): CoSine's routing, except that a request drafting with one
drafter takes the chain with the least predicted time per accepted token among the router's pick and the chains it
has drafted with (speculation/chains.py `ChainCosts`). The costs are measured on every round and call, whoever
drafted it: each drafter's time per token, the verify cycle between a request's rounds, and the request's
acceptance of each chain's model."""

from __future__ import annotations

import time

from speculation.chains import ChainCosts
from speculation.messages import DraftRequest
from speculation.strategies.base import Choice, DraftingStrategy, RoundRecord, Setup, accepted_prefix, route


class SpecRouterChains(DraftingStrategy):
    name = "specrouter"
    rank = 100

    def __init__(self, setup: Setup):
        super().__init__(setup.roster)
        self.costs = ChainCosts(families=dict(setup.families))
        self.round_end: dict[str, float] = {}  # when a request's last round ended (its verify cycle's start)

    @classmethod
    def build(cls, setup: Setup) -> SpecRouterChains | None:
        return cls(setup) if setup.roster.router.config.chain_choice == "latency" else None

    def choose(self, req: DraftRequest, up: list[str], last: RoundRecord | None) -> Choice:
        choice = route(self.roster, req, up)
        rid, free = req.request_id, self.roster.router.model_free
        models = [d for d in choice.drafters if d not in free]
        if choice.ranked and req.participation.drafters_per_request == 1 and models:
            # the routed chain, or a tried one that is cheaper (model-free drafters join either, as routed)
            tried = [d for d in self.costs.tried(rid, up) if d not in free]
            last_models = [n for n in last.proposals if n not in free] if last is not None else []
            current = last_models[0] if len(last_models) == 1 else None
            candidates = list(dict.fromkeys(models + tried))
            best = self.costs.best(rid, candidates, req.k, current) or models[0]
            choice.drafters = [best] + [d for d in choice.drafters if d in free]
        return choice

    def observe(self, rid: str, committed: list[int], rnd: RoundRecord) -> None:
        for name, props in rnd.proposals.items():
            toks = [t for t, _ in props]
            self.costs.observe_acceptance(rid, name, accepted_prefix(committed, toks), len(toks))
        super().observe(rid, committed, rnd)

    def observe_call(self, name: str, seconds: float, steps: int) -> None:
        self.costs.observe_call(name, seconds, steps)

    def started(self, rid: str) -> None:
        if rid in self.round_end:
            self.costs.observe_cycle(time.perf_counter() - self.round_end[rid])

    def ended(self, rid: str) -> None:
        self.round_end[rid] = time.perf_counter()

    def release(self, rid: str) -> None:
        self.costs.release(rid)
        self.round_end.pop(rid, None)

    def state(self) -> dict:
        c = self.costs
        return {"chain_token_ms": {n: round(1000 * t, 3) for n, t in c.token_s.items()},
                "chain_cycle_ms": None if c.cycle_s is None else round(1000 * c.cycle_s, 3)}
