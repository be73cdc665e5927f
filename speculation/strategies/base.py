"""The drafting-strategy interface: what a mode of drafting decides, apart from the rounds that drive it.

A strategy, in the spirit of vLLM's spec-decode proposers and transformers' `CandidateGenerator`, does three
things for the requests it claims:

1. `choose`: the drafters of a request's round (with `Choice.scoring`, every drafter scores the prompt at depth
   0 and `scored` keeps the routed ones);
2. `draft`: the round's draft from the drafters' proposals (fused in lockstep as they came, or chain by chain);
3. `observe`: what the target committed after a round (every strategy sees every round; the one that drafted it
   is named in `RoundRecord.strategy`), and `observe_call` / `started` / `ended` for timings.

`SpeculationCoordinator` drives the rounds (depths, drafter calls, deadlines, drafter health and parking) and asks
the strategies in `rank` order which one claims a request this round. The state they share is the `Roster`: the
drafters, the routing matrix (`Router`, which every non-voting round teaches: `routing_feedback`) and the
requests whose prompt no drafter has scored yet. A strategy module imports only this one (import-linter's
independence contract); `speculation/strategies/__init__.py` finds the modules and keys the registry on `name`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from config import AppConfig, SpeculationSpec
from speculation.fusion import FusionTree, fuse_chains
from speculation.messages import Draft, DraftRequest, Participation, Proposal, SpeculationOverrides
from speculation.routing import Router, alignment
from speculation.voting import MajorityVote


@dataclass
class Roster:
    """What every strategy shares: the drafters, the routing matrix and routing's cold start."""

    drafters: list[str]
    router: Router
    embeddings: torch.Tensor | None = None  # the target's input embeddings (Eq. 1); None: exact matches only
    unscored: set[str] = field(default_factory=set)  # requests whose prompt no drafter has scored yet


@dataclass
class Setup:
    """What a strategy is built from: the roster and the configuration (in process, tests pass their own)."""

    roster: Roster
    speculation: SpeculationSpec
    fixed_drafters: list[str] | None = None
    vote: MajorityVote | None = None  # the voters and their weights (default: from speculation.vote)
    families: dict[str, str] = field(default_factory=dict)  # drafter -> its model


@dataclass
class Choice:
    drafters: list[str]
    scoring: bool = False  # every drafter scores the prompt at depth 0; `scored` keeps the routed ones
    ranked: bool = False  # the router's ranking (Eq. 3) picked them


@dataclass
class RoundRecord:
    """What a request's last round proposed, for feedback once the target has committed after it."""

    start: int  # committed context length when the round was drafted
    strategy: str  # the name of the strategy that drafted it
    proposals: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # drafter -> [(token, conf)]
    fused: bool = True  # were the drafters fed the fused token (Eq. 4) or their own?
    factors: dict[str, float] = field(default_factory=dict)  # model-free drafters' calibration (Router.calibrated)
    # model-free drafters' proposals with their raw confidences, before that calibration (what it learns from)
    claims: dict[str, list[tuple[int, float]]] = field(default_factory=dict)


class DraftingStrategy(ABC):
    name: ClassVar[str]  # the registry's key: a `speculation.mode`, or a per-request way of drafting
    rank: ClassVar[int]  # strategies are asked in rising rank which one claims a request
    # as the configured mode: several routed drafters per request (the planner's participation, the controller's
    # modes); otherwise a request drafts with one drafter unless it names its own
    routed: ClassVar[bool] = False

    def __init__(self, roster: Roster):
        self.roster = roster

    @classmethod
    @abstractmethod
    def build(cls, setup: Setup) -> DraftingStrategy | None:
        """The strategy for this configuration, or None where it does not take part."""

    @classmethod
    def participation(cls, cfg: AppConfig, o: SpeculationOverrides) -> Participation | None:
        """How a request in this mode drafts, where the mode decides it; None leaves it to the planner."""
        return None

    def claims(self, req: DraftRequest, up: list[str]) -> bool:
        """Does this strategy draft `req` this round (`up`: the drafters that can be called)?"""
        return True

    @abstractmethod
    def choose(self, req: DraftRequest, up: list[str], last: RoundRecord | None) -> Choice:
        """The round's drafters among `up`; `last`: the request's previous round."""

    def scored(self, req: DraftRequest, logliks: dict[str, float]) -> list[str]:
        """After a scoring depth: the prompt's log-likelihood per drafter starts its routing (cold start), and the
        routed drafters draft on."""
        rid = req.request_id
        self.roster.router.add_request(rid, logliks)
        return self.roster.router.route(rid, req.participation.drafters_per_request)

    def fused(self, req: DraftRequest) -> bool:
        """Are the drafters fed the fused token at each depth (lockstep), or each its own?"""
        return req.participation.lockstep

    def draft(self, req: DraftRequest, chains: dict[str, list[Proposal]], fuser: FusionTree) -> Draft | None:
        """The round's draft: the lockstep-fused tree, or each drafter's chain fused one-shot."""
        if self.fused(req):
            return fuser.build() if fuser.chain else None
        return fuse_chains({n: [(p.token, p.prob) for p in ch] for n, ch in chains.items()}, fuser.budget)

    def observe(self, rid: str, committed: list[int], rnd: RoundRecord) -> None:
        """The target committed `committed` after `rnd`: by default its drafters' routing scores learn from it."""
        if rnd.strategy == self.name:
            routing_feedback(self.roster, rid, committed, rnd)

    def observe_call(self, name: str, seconds: float, steps: int) -> None:
        """A drafter answered a call of `steps` tokens (prompt scoring excluded) in `seconds`."""

    def started(self, rid: str) -> None:
        """A request's round starts from committed tokens, after `observe`."""

    def ended(self, rid: str) -> None:
        """A request's round ended with its draft (or none)."""

    def release(self, rid: str) -> None:
        """The request finished."""

    def state(self) -> dict:
        """What operators see of the strategy (merged into the coordinator's state)."""
        return {}


def route(roster: Roster, req: DraftRequest, up: list[str]) -> Choice:
    """The routed drafters: a random pick, every drafter to score a new request's prompt, or Eq. 3."""
    rid, n = req.request_id, req.participation.drafters_per_request
    if req.routing == "random":
        return Choice(roster.router.rng.sample(up, min(len(up), n)))
    if rid in roster.unscored:
        roster.unscored.discard(rid)
        return Choice(up, scoring=True)
    return Choice(roster.router.route(rid, n, exclude=set(roster.drafters) - set(up)), ranked=True)


def accepted_prefix(committed: list[int], drafted: list[int]) -> int:
    n = 0
    while n < min(len(committed), len(drafted)) and committed[n] == drafted[n]:
        n += 1
    return n


def routing_feedback(roster: Roster, rid: str, committed: list[int], rnd: RoundRecord) -> None:
    """Eq. 1-2 for each drafter of the round (exact prefix matches without embeddings), into the routing matrix."""
    scores = {}
    for name, props in rnd.proposals.items():
        toks = [t for t, _ in props]
        if roster.embeddings is not None:
            scores[name] = alignment(committed, toks, [c for _, c in props], roster.embeddings, rnd.fused)
        else:
            scores[name] = accepted_prefix(committed, toks) / max(1, len(toks))
    roster.router.update(rid, float(len(committed)), scores)
