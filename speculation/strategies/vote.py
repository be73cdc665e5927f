"""Minions' majority vote (`speculation.mode: vote`, or a request's `mode: vote`): every voter (the request's own
drafters, else speculation.vote's) drafts its own chain, the weighted-majority path is verified
(speculation/voting.py `MajorityVote`), and what the target committed updates the voters' weights instead of
the routing scores."""

from __future__ import annotations

from config import AppConfig
from speculation.fusion import FusionTree
from speculation.messages import Draft, DraftRequest, Participation, Proposal, SpeculationOverrides
from speculation.strategies.base import Choice, DraftingStrategy, RoundRecord, Setup
from speculation.voting import GLOBAL, MajorityVote


class MinionsVote(DraftingStrategy):
    name = "vote"
    rank = 0

    def __init__(self, setup: Setup):
        super().__init__(setup.roster)
        spec = setup.speculation.vote
        self.vote = setup.vote or MajorityVote(spec.drafters or setup.roster.drafters,
                                               **spec.model_dump(exclude={"drafters"}))

    @classmethod
    def build(cls, setup: Setup) -> MinionsVote:
        return cls(setup)  # a request may ask for a vote in any mode

    @classmethod
    def participation(cls, cfg: AppConfig, o: SpeculationOverrides) -> Participation:
        """Every voter drafts its own chain; one chain is verified."""
        return Participation(len(o.drafters or cfg.speculation.vote.drafters or cfg.drafters), vote=True)

    def claims(self, req: DraftRequest, up: list[str]) -> bool:
        return req.participation.vote

    def choose(self, req: DraftRequest, up: list[str], last: RoundRecord | None) -> Choice:
        return Choice([d for d in req.drafters or self.vote.voters if d in up])

    def draft(self, req: DraftRequest, chains: dict[str, list[Proposal]], fuser: FusionTree) -> Draft | None:
        return self.vote.vote({n: [(p.token, p.prob) for p in ch] for n, ch in chains.items()}, req.request_id)

    def observe(self, rid: str, committed: list[int], rnd: RoundRecord) -> None:
        if rnd.strategy == self.name:
            self.vote.observe(rid, committed, {n: [t for t, _ in props] for n, props in rnd.proposals.items()})

    def release(self, rid: str) -> None:
        self.vote.release(rid)

    def state(self) -> dict:
        return {"vote_weights": dict(self.vote.weights[GLOBAL])} if GLOBAL in self.vote.weights else {}
