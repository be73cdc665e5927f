"""The generalist participation (`Participation.generalist`, chosen by the goodput controller): every request of
the round drafts with the generalist drafter, unrouted, so that the round's requests share one drafter's batched
steps. The prompt is not scored: the request's first routed round does it."""

from __future__ import annotations

from speculation.messages import DraftRequest
from speculation.strategies.base import Choice, DraftingStrategy, RoundRecord, Setup


class Generalist(DraftingStrategy):
    name = "generalist"
    rank = 50

    @classmethod
    def build(cls, setup: Setup) -> Generalist:
        return cls(setup.roster)

    def _generalist(self, up: list[str]) -> list[str]:
        return [d for d in up if d in self.roster.router.generalists][:1]

    def claims(self, req: DraftRequest, up: list[str]) -> bool:
        return req.participation.generalist and bool(self._generalist(up))

    def choose(self, req: DraftRequest, up: list[str], last: RoundRecord | None) -> Choice:
        return Choice(self._generalist(up))
