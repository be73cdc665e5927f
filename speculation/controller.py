"""The draft-length controller interface: what the planner asks of a controller and tells it.

Two implement it: `goodput.GoodputController` (per-request lengths and the participation from the goodput
model, SmartSpec) and `hill_climb.HillClimbController` (one length hill-climbed on measured goodput, Minions);
`planner.make_controller` builds the one `speculation.controller.kind` names.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from types import MappingProxyType

from speculation.messages import Participation


class DraftLengthController(ABC):
    participation: Participation | None = None  # the participation the last `choose` picked (None: the configuration's)
    probing: bool = False  # the last `choose` tried a participation for its measurements, not for its goodput
    predicted_goodput: float | None = None  # tokens per second the last choice expects, where it predicts one

    @abstractmethod
    def choose(self, rids: list[str], k_caps: dict[str, int] | None = None, overlap_s: float = 0.0,
               ahead: bool = False, unscored: Mapping[str, int] = MappingProxyType({})) -> dict[str, int]:
        """Each request's draft length, within its cap; `overlap_s` of verification runs beside the drafting.
        `ahead`: the round is drafted ahead, one token deeper than the length chosen (the planner adds it).
        `unscored`: requests that drafted on the generalist only, whose first routed round scores their prompt,
        with the tokens of context that scoring reads."""

    def observe_round(self, requests: int, depth: int, participations: set[Participation | None],
                      seconds: float) -> None:
        """A drafting round of `requests` drafting up to `depth` took `seconds`; `participations`: how it drafted
        (None among them: a request's prompt was scored, so the round says nothing of a participation's cost)."""

    def observe_scoring(self, participation: Participation, requests: int, depth: int, scored_tokens: int,
                        seconds: float) -> None:
        """A round of `participation` that also scored `scored_tokens` tokens of new prompts took `seconds`."""

    @abstractmethod
    def observe_verify(self, tokens: int, seconds: float, wall_s: float) -> None:
        """A verify step of `tokens` took `seconds`; `wall_s` since the previous step ended (drafting included)."""

    @abstractmethod
    def observe_verified(self, rid: str, drafted: int, accepted: int, participation: Participation | None) -> None:
        """A request's verified round: `accepted` of a draft `drafted` deep (0: no draft), drafted with
        `participation`."""

    @abstractmethod
    def release(self, rid: str) -> None:
        """The request finished."""

    @abstractmethod
    def state(self) -> dict:
        """What operators see (`speculation_stats`)."""
