"""Fixed drafters, no routing (`speculation.mode: chain`, `speculation.fixed_drafters`, or a request's own
`drafters`): the named drafters draft every round, fused like routed ones where there are several. In mode chain
without fixed_drafters, the first configured drafter drafts alone."""

from __future__ import annotations

from speculation.messages import DraftRequest
from speculation.strategies.base import Choice, DraftingStrategy, RoundRecord, Setup


class FixedDrafters(DraftingStrategy):
    name = "chain"
    rank = 10

    def __init__(self, setup: Setup, fixed: list[str] | None):
        super().__init__(setup.roster)
        self.fixed = fixed

    @classmethod
    def build(cls, setup: Setup) -> FixedDrafters:
        chain = setup.roster.drafters[:1] if setup.speculation.mode == cls.name else None
        return cls(setup, setup.fixed_drafters or chain)  # a request may name its drafters in any mode

    def claims(self, req: DraftRequest, up: list[str]) -> bool:
        return bool(req.drafters or self.fixed)

    def choose(self, req: DraftRequest, up: list[str], last: RoundRecord | None) -> Choice:
        return Choice([d for d in req.drafters or self.fixed or [] if d in up])
