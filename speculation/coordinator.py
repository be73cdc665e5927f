"""The speculation cluster's central node, without Ray: routing, lockstep drafting, fusion, feedback.

`SpeculationCoordinator.draft` takes the verifier's batch of `DraftRequest`s (per request: the committed context,
the draft depth and tree budget it may use, how many drafters and whether in lockstep) and an async
`step_fn(drafter_name, [DrafterCall]) -> {request id: [Proposal]}` that reaches one drafter (a Serve handle in the
deployment, a local `DrafterServer` in process). Per round:

1. feedback: compare each drafter's proposals of the previous round with what the target committed since
   (Eq. 1-2) and update the router (accepted length and per-drafter scores);
2. routing: the request's drafters (Eq. 3), or all drafters on a request's first routed round, which score the
   prompt (mean log-likelihood) for the cold start; with `routing.chain_choice: latency`, a request drafting with
   one drafter takes the one with the least predicted time per accepted token (SpecRouter, `ChainCosts`); a
   request in the generalist participation drafts with the generalist drafter, unrouted;
3. drafting: in `vote` mode (Minions) every voter drafts its own chain and the weighted majority path is the
   draft (`MajorityVote`; feedback updates the voters' weights instead of routing scores). With lockstep fusion,
   at each depth every chosen drafter proposes and the most confident token is fed back to all of them (Eq. 4),
   losers become branches; a drafter returns its whole chain from one call, and is
   only called again where its token lost (then its chain no longer follows the fused prefix). Without fusion
   each drafter drafts its own chain in one call and the chains are fused one-shot (`fuse_chains`);
4. the tree, trimmed to the request's budget, goes back to the verifier.
A drafter that fails or is late just drops out of the round, and sits out the next rounds for a while
(`DrafterHealth`); the verifier decodes without a draft if none is left. A round that reaches its deadline (a share
of the verifier's `draft_timeout_ms`) returns the drafts it has so far rather than none.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import torch

from config import AppConfig, RoutingSpec
from engines.build import target_input_embeddings
from speculation.chains import ChainCosts
from speculation.fusion import FusionTree, fuse_chains
from speculation.health import DrafterHealth
from speculation.messages import Draft, DrafterCall, DraftRequest, Proposal
from speculation.routing import Router, alignment
from speculation.voting import GLOBAL, MajorityVote

StepFn = Callable[[str, list[DrafterCall]], Awaitable[dict[str, list[Proposal]]]]

# a round ends at this share of the verifier's draft_timeout_ms, so that what it drafted reaches the verifier in time
# (through the Speculation deployment's handle in the deployments layout)
ROUND_SHARE = 0.8


@dataclass
class _Round:
    """What a request's last round proposed, for the next round's routing feedback."""

    start: int  # committed context length when the round was drafted
    proposals: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # drafter -> [(token, conf)]
    fused: bool = True  # were the drafters fed the fused token (Eq. 4) or their own?
    voted: bool = False  # a majority vote (its feedback goes to the voters' weights, not to routing)


@dataclass
class _Drafting:
    """One request's round in progress.

    Every call asks a drafter for its whole remaining chain. A chain stays valid while the drafter's own tokens
    are what it would have been fed: always one-shot, and in lockstep while its token is the fused one. A drafter
    whose token lost is called again at the next depth with the fused prefix. So the drafts are lockstep fusion's
    at one round trip plus one per depth where a drafter disagreed, instead of one per depth."""

    req: DraftRequest
    chosen: list[str]
    scoring: bool  # first round: every drafter scores the prompt, most are dropped after
    fuser: FusionTree
    vote: MajorityVote | None = None  # mode vote: the chains are voted on rather than fused
    chains: dict[str, list[Proposal]] = field(default_factory=dict)  # every drafter's proposals, in order
    ahead: dict[str, dict[int, Proposal]] = field(default_factory=dict)  # drafter -> depth -> proposal received
    path: dict[str, list[int]] = field(default_factory=dict)  # drafter -> tokens fed after the context
    alive: set[str] = field(default_factory=set)  # drafters still in the round

    def __post_init__(self):
        for n in self.chosen:
            self.chains[n], self.ahead[n], self.path[n] = [], {}, []
        self.alive = set(self.chosen)

    @property
    def lockstep(self) -> bool:
        return self.req.participation.lockstep

    def calls(self, depth: int) -> dict[str, DrafterCall]:
        """The drafters that must be called at `depth` (their chain does not reach it)."""
        if depth >= self.req.k:
            return {}
        first = depth == 0 and self.scoring
        return {n: DrafterCall(self.req.request_id, self.req.context + self.path[n],
                               steps=1 if first else self.req.k - depth, score_context=first)
                for n in self.alive if depth not in self.ahead[n]}

    def receive(self, depth: int, name: str, chain: list[Proposal]) -> None:
        self.ahead[name] = {depth + i: p for i, p in enumerate(chain)}

    def advance(self, depth: int, router: Router) -> None:
        """Fuse `depth`: after cold-start scoring keep the routed drafters, feed every drafter its next token."""
        rid = self.req.request_id
        if depth >= self.req.k:
            return
        if rid not in router.requests:  # released while the round ran: nothing more to draft for it
            self.alive = set()
            return
        props = {n: self.ahead[n][depth] for n in self.alive if depth in self.ahead[n]}
        if depth == 0 and self.scoring:
            ll = {n: p.context_loglik for n, p in props.items() if p.context_loglik is not None}
            if ll:
                router.add_request(rid, ll)
                keep = router.route(rid, self.req.participation.drafters_per_request)
                props = {n: p for n, p in props.items() if n in keep}
                self.chosen = [n for n in self.chosen if n in keep]
        self.alive = set(props)  # a drafter that failed or ran out of room sits the rest of the round out
        if not props:
            return
        for n, p in props.items():
            self.chains[n].append(p)
        tok = self.fuser.step(props) if self.lockstep else None
        for n, p in props.items():
            self.path[n].append(p.token if tok is None else tok)
            if tok is not None and p.token != tok:
                self.ahead[n] = {}  # its chain went on from its own token: call it again

    def draft(self) -> Draft | None:
        if self.vote is not None:
            d = self.vote.vote({n: [(p.token, p.prob) for p in ch] for n, ch in self.chains.items()},
                               self.req.request_id)
        elif self.lockstep:
            d = self.fuser.build() if self.fuser.chain else None
        else:  # each drafter followed its own tokens: fuse the chains one-shot
            d = fuse_chains({n: [(p.token, p.prob) for p in ch] for n, ch in self.chains.items()},
                            self.fuser.budget)
        return d if d is not None and len(d) else None

    def record(self) -> _Round:
        return _Round(len(self.req.context), {n: [(p.token, p.prob) for p in ch]
                                              for n, ch in self.chains.items() if ch}, self.lockstep,
                      self.vote is not None)


class SpeculationCoordinator:
    def __init__(self, drafters: list[str], routing: RoutingSpec | None = None,
                 embeddings: torch.Tensor | None = None, fixed_drafters: list[str] | None = None,
                 step_timeout_s: float = 5.0, generalists: set[str] | frozenset[str] = frozenset(),
                 round_budget_s: float | None = None, health: DrafterHealth | None = None,
                 vote: MajorityVote | None = None, families: dict[str, str] | None = None):
        """`vote`: Minions' majority vote, for the requests drafting by vote (default: every drafter votes).
        `families`: each drafter's model, for chain choice (drafters of one model draft the same chains)."""
        self.drafters = list(drafters)
        self.vote = vote or MajorityVote(self.drafters)
        self.router = Router(self.drafters, routing or RoutingSpec(), frozenset(generalists))
        self.embeddings = embeddings
        self.fixed = fixed_drafters
        self.step_timeout_s = step_timeout_s
        self.round_budget_s = round_budget_s
        self.health = health or DrafterHealth()
        self.parked: set[str] = set()  # drafters scaled to zero replicas: not called until they are back
        self.rounds: dict[str, _Round] = {}
        self.unscored: set[str] = set()  # requests whose prompt no drafter has scored yet (routing's cold start)
        self.where: dict[str, set[str]] = {}  # drafters holding a cache for the request
        self.stats = {"rounds": 0, "drafter_failures": 0, "step_seconds": 0.0}
        self.on_failure: Callable[[str], None] | None = None  # told the drafter's name when a call fails
        self.routing_history: deque = deque(maxlen=1024)  # (rid, drafters ranked first..last) at release
        self.costs = ChainCosts(families=dict(families or {})) if self.router.config.chain_choice == "latency" \
            else None
        self.round_end: dict[str, float] = {}  # chain choice: when a request's last round ended (its cycle's start)

    @classmethod
    def from_config(cls, cfg: AppConfig) -> SpeculationCoordinator:
        spec = cfg.speculation
        fixed = spec.fixed_drafters or ([cfg.drafters[0].name] if spec.mode == "chain" else None)
        vote = MajorityVote(spec.vote.drafters or [d.name for d in cfg.drafters],
                            **spec.vote.model_dump(exclude={"drafters"}))
        return cls([d.name for d in cfg.drafters], cfg.routing, target_input_embeddings(cfg), fixed_drafters=fixed,
                   step_timeout_s=spec.drafter_timeout_ms / 1000,
                   generalists={d.name for d in cfg.drafters if d.generalist},
                   round_budget_s=ROUND_SHARE * spec.draft_timeout_ms / 1000,
                   health=DrafterHealth(*spec.drafter_backoff_s), vote=vote,
                   families={d.name: d.model for d in cfg.drafters})

    def state(self) -> dict:
        """Counters and timings, how many requests drafters hold a cache for (what a soak watches), and the
        drafters sitting out after failures or parked at zero replicas."""
        out = dict(self.stats, requests_held=len(self.where), drafters_sitting_out=self.health.sitting_out(),
                   drafters_parked=sorted(self.parked))
        if GLOBAL in self.vote.weights:
            out["vote_weights"] = dict(self.vote.weights[GLOBAL])
        if self.costs is not None:
            out["chain_token_ms"] = {n: round(1000 * t, 3) for n, t in self.costs.token_s.items()}
            out["chain_cycle_ms"] = None if self.costs.cycle_s is None else round(1000 * self.costs.cycle_s, 3)
        return out

    def release(self, rid: str) -> set[str]:
        """Forget the request; returns the drafters that must free its cache."""
        if rid in self.router.requests:
            self.routing_history.append((rid, self.router.ranking(rid)))
        self.router.release(rid)
        self.vote.release(rid)
        if self.costs is not None:
            self.costs.release(rid)
        self.round_end.pop(rid, None)
        self.rounds.pop(rid, None)
        self.unscored.discard(rid)
        return self.where.pop(rid, set())

    def _feedback(self, rid: str, context: list[int]) -> None:
        rnd = self.rounds.get(rid)
        if rnd is None or rid not in self.router.requests:
            return
        committed = context[rnd.start:]
        if not committed:
            return
        if self.costs is not None:
            for name, props in rnd.proposals.items():
                toks = [t for t, _ in props]
                self.costs.observe_acceptance(rid, name, _accepted_prefix(committed, toks), len(toks))
        if rnd.voted:
            self.vote.observe(rid, committed, {n: [t for t, _ in props] for n, props in rnd.proposals.items()})
            return
        scores = {}
        for name, props in rnd.proposals.items():
            toks = [t for t, _ in props]
            confs = [c for _, c in props]
            scores[name] = alignment(committed, toks, confs, self.embeddings, rnd.fused) \
                if self.embeddings is not None else _exact_alignment(committed, toks)
        self.router.update(rid, float(len(committed)), scores)

    def _start(self, req: DraftRequest) -> _Drafting:
        """Routing feedback from the last round, then this round's drafters: fixed, random, everyone (a new
        request's prompt scoring) or routed (Eq. 3)."""
        rid, n = req.request_id, req.participation.drafters_per_request
        if rid not in self.router.requests:
            self.router.add_request(rid)
            self.unscored.add(rid)
        elif not req.ahead:
            self._feedback(rid, req.context)
            if self.costs is not None and rid in self.round_end:
                self.costs.observe_cycle(time.perf_counter() - self.round_end[rid])
        vote = req.participation.vote
        fixed = req.drafters or (self.vote.voters if vote else self.fixed)
        up = [d for d in self.drafters if d not in self.parked and self.health.available(d)]
        generalist = [d for d in up if d in self.router.generalists][:1] if req.participation.generalist else []
        if fixed:
            chosen = [d for d in fixed if d in up]
        elif generalist:  # the prompt is scored on the request's first routed round
            chosen = generalist
        elif req.routing == "random":
            chosen = self.router.rng.sample(up, min(len(up), n))
        elif rid in self.unscored:
            chosen = up
        else:
            chosen = self.router.route(rid, n, exclude=set(self.drafters) - set(up))
            if self.costs is not None and n == 1 and chosen:  # the routed chain, or a tried one that is cheaper
                tried = self.costs.tried(rid, up)
                last = self.rounds.get(rid)
                current = next(iter(last.proposals)) if last is not None and len(last.proposals) == 1 else None
                chosen = [self.costs.best(rid, list(dict.fromkeys(chosen + tried)), req.k, current) or chosen[0]]
        scoring = rid in self.unscored and not fixed and not generalist and req.routing != "random"
        if scoring:
            self.unscored.discard(rid)
        return _Drafting(req, chosen, scoring=scoring,
                         fuser=FusionTree(budget=req.budget), vote=self.vote if vote else None)

    async def _call(self, step_fn: StepFn, name: str, calls: list[DrafterCall],
                    timeout_s: float) -> dict[str, list[Proposal]]:
        t0 = time.perf_counter()
        try:
            got = await asyncio.wait_for(step_fn(name, calls), timeout_s)
        except Exception as e:  # noqa: BLE001 - a failed drafter only loses its proposals for this round
            self.stats["drafter_failures"] += 1
            self.health.failed(name, f"no answer in {timeout_s * 1000:.0f} ms" if isinstance(e, TimeoutError)
                               else f"call failed ({type(e).__name__})")
            if self.on_failure is not None:
                self.on_failure(name)
            return {}
        self.health.succeeded(name)
        if self.costs is not None and not any(c.score_context for c in calls):  # a prompt's prefill is no measure
            self.costs.observe_call(name, time.perf_counter() - t0, max(c.steps for c in calls))
        return got

    async def draft(self, batch: list[DraftRequest], step_fn: StepFn) -> dict[str, Draft]:
        t0 = time.perf_counter()
        deadline = t0 + self.round_budget_s if self.round_budget_s is not None else float("inf")
        rounds = {req.request_id: self._start(req) for req in batch if req.k > 0}
        if not rounds:
            return {}
        for depth in range(max(r.req.k for r in rounds.values())):
            left = deadline - time.perf_counter()
            if left <= 0 or not any(r.alive for r in rounds.values() if depth < r.req.k):
                break  # out of time: the drafts so far
            per_drafter: dict[str, list[DrafterCall]] = {}
            for r in rounds.values():
                for name, call in r.calls(depth).items():
                    per_drafter.setdefault(name, []).append(call)
            names = list(per_drafter)
            for name in names:  # a drafter may build a cache even for a call that fails or times out here
                for call in per_drafter[name]:
                    self.where.setdefault(call.request_id, set()).add(name)
            timeout = min(self.step_timeout_s, left)
            answers = await asyncio.gather(*(self._call(step_fn, n, per_drafter[n], timeout) for n in names))
            for name, got in zip(names, answers):
                for call in per_drafter[name]:
                    if call.request_id in got:
                        rounds[call.request_id].receive(depth, name, got[call.request_id])
            for r in rounds.values():
                r.advance(depth, self.router)
        drafts = {}
        for rid, r in rounds.items():
            if rid not in self.router.requests:  # released while this round ran: its drafters were told already
                self.where.pop(rid, None)
                continue
            d = r.draft()
            if d is not None:
                drafts[rid] = d
            if not r.req.ahead or rid not in self.rounds:
                self.rounds[rid] = r.record()
            if self.costs is not None:
                self.round_end[rid] = time.perf_counter()
        self.stats["rounds"] += 1
        self.stats["step_seconds"] += time.perf_counter() - t0
        return drafts


def _accepted_prefix(committed: list[int], drafted: list[int]) -> int:
    n = 0
    while n < min(len(committed), len(drafted)) and committed[n] == drafted[n]:
        n += 1
    return n


def _exact_alignment(committed: list[int], drafted: list[int]) -> float:
    return _accepted_prefix(committed, drafted) / max(1, len(drafted))
