"""Retiring the domain drafters while the rounds draft on the generalist, so that the autoscaler can take their
replicas safely.

Where drafters share hardware, the goodput controller puts whole rounds on the generalist drafter at high load
(speculation/goodput.py, participation); a few rounds stay routed (a lone request's, a probe's). The autoscaler
would take the domain drafters' replicas then, but a routed call that reaches a drafter after its last replica has
gone waits at the handle, and Serve starts a replica for it (seconds of the cores the verifier uses; measured
under load, docs/benchmarks.md). So the verifier decides, not the autoscaler: once fewer than `below` of the
window's drafted request rounds are routed by the controller's choice, it retires the domain drafters, drafting
those rounds on the generalist too, and tells the autoscaler (the `retired` signal), which lowers them only after
a whole look-back window of it. More than `above` routed by choice (a lone request's rounds, the controller
preferring routing again) brings them back.
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace

from config import AppConfig, RetirementSpec
from speculation.messages import DraftRequest, Participation


class DomainDrafterRetirement:
    def __init__(self, spec: RetirementSpec, tree_budget: int):
        self.spec, self.tree_budget = spec, tree_budget
        self.rounds: deque[tuple[int, int]] = deque()  # (drafted, routed by choice) per round, the newest last
        self.drafted = self.routed = 0  # their sums
        self.retired = False
        self.held_since_take = False  # retired through the whole interval since the last `take`

    @classmethod
    def from_config(cls, cfg: AppConfig) -> DomainDrafterRetirement | None:
        """Only where it is needed: a generalist to draft every round, and drafters the autoscaler can lower."""
        spec = cfg.speculation
        on = (spec.mode == "cosine" and spec.adaptive and spec.adaptive_drafters
              and spec.drafting_tier == "deployments" and any(d.generalist for d in cfg.drafters)
              and any(d.deployment.autoscaling_config is not None for d in cfg.drafters if not d.generalist))
        return cls(spec.retirement, spec.tree_budget) if on else None

    def share(self) -> float | None:
        """The routed share of the window's drafted request rounds (None: none drafted)."""
        return self.routed / self.drafted if self.drafted else None

    def observe(self, drafted: int, routed: int) -> None:
        """A round: `drafted` request rounds, `routed` of them routed by the controller's choice."""
        if not drafted:
            return
        self.rounds.append((drafted, routed))
        self.drafted, self.routed = self.drafted + drafted, self.routed + routed
        while self.drafted - self.rounds[0][0] >= self.spec.window_rounds:
            d, r = self.rounds.popleft()
            self.drafted, self.routed = self.drafted - d, self.routed - r
        share = self.routed / self.drafted
        if self.retired and share > self.spec.above:
            self.retired = self.held_since_take = False
        elif not self.retired and share < self.spec.below and self.drafted >= self.spec.min_rounds:
            self.retired = True

    def apply(self, batch: list[DraftRequest]) -> list[DraftRequest]:
        """While retired, the routed requests of a round draft on the generalist (fixed drafters and votes are
        the request's or the mode's own: left as asked)."""
        if not self.retired:
            return batch
        return [replace(d, participation=Participation(1, generalist=True), budget=min(self.tree_budget, d.k))
                if _routed(d) else d for d in batch]

    def take(self) -> float:
        """The autoscaler's signal for the interval since the last call: 1.0 if retired all through it."""
        out = 1.0 if self.retired and self.held_since_take else 0.0
        self.held_since_take = self.retired
        return out


def _routed(d: DraftRequest) -> bool:
    p = d.participation
    return not (p.generalist or p.vote or d.drafters)
