"""One fixed drafter (`speculation.mode: single`): `speculation.drafter` drafts every request's chain, one call per
round, with no routing at all: no prompt scoring, no routing scores to keep. A request that names its own
drafters or asks for a vote still gets them (those strategies rank first)."""

from __future__ import annotations

from speculation.messages import DraftRequest
from speculation.strategies.base import Choice, DraftingStrategy, RoundRecord, Setup


class SingleDrafter(DraftingStrategy):
    name = "single"
    rank = 20

    def __init__(self, setup: Setup):
        super().__init__(setup.roster)
        self.drafter = setup.speculation.drafter or setup.roster.drafters[0]

    @classmethod
    def build(cls, setup: Setup) -> SingleDrafter | None:
        return cls(setup) if setup.speculation.mode == cls.name else None

    def choose(self, req: DraftRequest, up: list[str], last: RoundRecord | None) -> Choice:
        return Choice([self.drafter] if self.drafter in up else [])

    def observe(self, rid: str, committed: list[int], rnd: RoundRecord) -> None:
        """Nothing is learnt: the drafter is fixed."""
