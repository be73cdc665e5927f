"""The generalist participation (`Participation.generalist`, chosen by the goodput controller): every request of
the round drafts with the generalist drafter, unrouted, so that the round's requests share one drafter's batched
steps. The prompt is not scored: the request's first routed round does it.

The model-free drafters (n-gram, suffix) join these rounds as they join routed ones: a lookup each, no forward, and
with `routing.model_free_alone` a request whose match is strong is drafted by them alone, without the generalist's
forwards. At a loaded verifier the controller drafts nearly every round here, so a roster's model-free drafters left
out of it went unused where output repeats its context most (greedy text at concurrency 8)."""

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
        return Choice(self._generalist(up) + [d for d in up if d in self.roster.router.model_free])
