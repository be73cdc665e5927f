"""CoSine's routed drafting (Sec. 4.2-4.3): each request's drafters from its routing scores (Eq. 1-3), a new
request's prompt scored by every drafter for the cold start, the drafters' tokens fused (Eq. 4) in lockstep or
one-shot (speculation/fusion.py). It takes every request no other strategy claims."""

from __future__ import annotations

from speculation.messages import DraftRequest
from speculation.strategies.base import Choice, DraftingStrategy, RoundRecord, Setup, route


class CosineRouting(DraftingStrategy):
    name = "cosine"
    rank = 100
    routed = True

    @classmethod
    def build(cls, setup: Setup) -> CosineRouting | None:
        return cls(setup.roster) if setup.roster.router.config.chain_choice == "score" else None

    def choose(self, req: DraftRequest, up: list[str], last: RoundRecord | None) -> Choice:
        return route(self.roster, req, up)
