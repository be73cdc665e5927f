"""The speculation cluster's central node, without Ray: it drives the drafting rounds.

`SpeculationCoordinator.draft` takes the verifier's batch of `DraftRequest`s (per request: the committed context,
the draft depth and tree budget it may use, how many drafters and whether in lockstep) and an async
`step_fn(drafter_name, [DrafterCall]) -> {request id: [Proposal]}` that reaches one drafter (a Serve handle in the
deployment, a local `DrafterServer` in process). Per round:

1. feedback: each strategy observes what the target committed since the request's previous round (routing scores,
   vote weights, chain costs);
2. the first strategy (speculation/strategies/, in rank order) that claims the request chooses its drafters among
   those that can be called: voters (Minions), fixed drafters, the generalist, or routed ones (CoSine, SpecRouter's
   chain choice), or every drafter to score a new request's prompt (routing's cold start: its first
   `routing.score_tokens` tokens, in calls of their own where the context is longer, then the routed drafters);
3. drafting: every call asks a drafter for its whole remaining chain. In lockstep (the strategy's `fused`), at each
   depth the most confident token is fed back to every drafter (Eq. 4) and losers become branches; a drafter is
   only called again where its token lost (then its chain no longer follows the fused prefix). Otherwise each
   drafter drafts its own chain in one call;
4. the strategy builds the draft (the fused tree, the chains fused one-shot, the voted chain), trimmed to the
   request's budget, and it goes back to the verifier.
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

from config import AppConfig, RoutingSpec, SpeculationSpec
from engines.build import target_input_embeddings
from speculation.fusion import FusionTree
from speculation.health import DrafterHealth
from speculation.messages import Draft, DrafterCall, DraftRequest, DraftRound, Proposal
from speculation.routing import Router
from speculation.strategies import strategies
from speculation.strategies.base import DraftingStrategy, Roster, RoundRecord, Setup
from speculation.voting import MajorityVote

StepFn = Callable[[str, list[DrafterCall]], Awaitable[dict[str, list[Proposal]]]]

# a round ends at this share of the verifier's draft_timeout_ms, so that what it drafted reaches the verifier in time
# (through the Speculation deployment's handle in the deployments layout)
ROUND_SHARE = 0.8
# a context at most this many tokens longer than `routing.score_tokens` is scored whole: scoring a prefix costs each
# routed drafter one forward more (~1 ms for a bench drafter on the 2-core CPU), reading a token ~0.03-0.05 ms
PREFIX_MARGIN = 16


@dataclass
class _Drafting:
    """One request's round in progress.

    Every call asks a drafter for its whole remaining chain. A chain stays valid while the drafter's own tokens
    are what it would have been fed: always one-shot, and in lockstep while its token is the fused one. A drafter
    whose token lost is called again at the next depth with the fused prefix. So the drafts are lockstep fusion's
    at one round trip plus one per depth where a drafter disagreed, instead of one per depth."""

    req: DraftRequest
    strategy: DraftingStrategy
    chosen: list[str]
    scoring: bool  # first round: every drafter scores the prompt, most are dropped after
    fuser: FusionTree
    # scoring reads only the context's first `prefix` tokens, in calls of their own before depth 0 (`routing.
    # score_tokens`; 0 once scored); None: every drafter scores the whole context at depth 0 and drafts on from it
    prefix: int | None = None
    chains: dict[str, list[Proposal]] = field(default_factory=dict)  # every drafter's proposals, in order
    ahead: dict[str, dict[int, Proposal]] = field(default_factory=dict)  # drafter -> depth -> proposal received
    path: dict[str, list[int]] = field(default_factory=dict)  # drafter -> tokens fed after the context
    alive: set[str] = field(default_factory=set)  # drafters still in the round
    factors: dict[str, float] = field(default_factory=dict)  # model-free drafter -> its confidences' calibration
    raw: dict[str, dict[int, float]] = field(default_factory=dict)  # model-free drafter -> depth -> raw confidence
    faulted: bool = False  # a drafter's call for the request failed or came late (`DraftRound.faulted`)

    def __post_init__(self):
        for n in self.chosen:
            self.chains[n], self.ahead[n], self.path[n] = [], {}, []
        self.alive = set(self.chosen)
        self.lockstep = self.strategy.fused(self.req)

    @property
    def scoring_at_depth_0(self) -> bool:
        return self.scoring and self.prefix is None

    def calls(self, depth: int) -> dict[str, DrafterCall]:
        """The drafters that must be called at `depth` (their chain does not reach it); at depth -1 each drafter's
        call scoring the context's prefix."""
        if depth < 0:
            return {n: DrafterCall(self.req.request_id, self.req.context[:self.prefix], steps=1, score_context=True,
                                   tenant=self.req.tenant) for n in self.alive}
        if depth >= self.req.k:
            return {}
        first = depth == 0 and self.scoring_at_depth_0
        return {n: DrafterCall(self.req.request_id, self.req.context + self.path[n],
                               steps=1 if first else self.req.k - depth, score_context=first,
                               tenant=self.req.tenant, alternatives=self.lockstep)
                for n in self.alive if depth not in self.ahead[n]}

    def receive(self, depth: int, name: str, chain: list[Proposal]) -> None:
        self.ahead[name] = {depth + i: p for i, p in enumerate(chain)}

    def advance(self, depth: int, router: Router) -> None:
        """Fuse `depth`: after cold-start scoring keep the routed drafters, feed every drafter its next token."""
        if depth >= self.req.k:
            return
        if self.req.request_id not in router.requests:  # released while the round ran: nothing more to draft
            self.alive = set()
            return
        props = {n: self.ahead[n][depth] for n in self.alive if depth in self.ahead[n]}
        if depth == 0 and self.scoring_at_depth_0 and (keep := self._route(props)) is not None:
            props = {n: p for n, p in props.items() if n in keep}
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

    def _route(self, scores: dict[str, Proposal]) -> set[str] | None:
        """After a scoring call: the drafters the likelihoods in `scores` route to, `chosen` cut to them (None, and
        `chosen` kept, where no likelihood came back)."""
        ll = {n: p.context_loglik for n, p in scores.items() if p.context_loglik is not None}
        if not ll:
            return None
        keep = set(self.strategy.scored(self.req, ll))
        self.chosen = [n for n in self.chosen if n in keep]
        return keep

    def scored_prefix(self, router: Router) -> None:
        """After the prefix's scoring calls: the routed drafters (of the models that answered, and the model-free
        ones) draft from depth 0, from the whole context."""
        scores = {n: self.ahead[n][-1] for n in self.alive if -1 in self.ahead[n]}
        if self.req.request_id in router.requests:  # not released while the round ran
            self._route(scores)
        answered = set(scores) | (self.alive & router.model_free)
        self.chosen = [n for n in self.chosen if n in answered]
        self.alive = set(self.chosen)
        self.ahead = {n: {} for n in self.chosen}
        self.prefix = 0

    def draft(self) -> Draft | None:
        d = self.strategy.draft(self.req, self.chains, self.fuser)
        return d if d is not None and len(d) else None

    def record(self) -> RoundRecord:
        return RoundRecord(len(self.req.context), self.strategy.name,
                           {n: [(p.token, p.prob) for p in ch] for n, ch in self.chains.items() if ch},
                           self.lockstep, dict(self.factors),
                           {n: [(p.token, self.raw[n][i]) for i, p in enumerate(self.chains[n])]
                            for n in self.raw if self.chains.get(n)})


def expected_accepted(chain) -> float:
    """A chain's expected accepted tokens, its proposals' probabilities taken as the chance each is accepted once
    the ones before it were: the sum over depths of their running product."""
    total, run = 0.0, 1.0
    for p in chain:
        run *= p.prob
        total += run
    return total


class SpeculationCoordinator:
    def __init__(self, drafters: list[str], routing: RoutingSpec | None = None,
                 embeddings: torch.Tensor | None = None, fixed_drafters: list[str] | None = None,
                 step_timeout_s: float = 5.0, generalists: set[str] | frozenset[str] = frozenset(),
                 round_budget_s: float | None = None, health: DrafterHealth | None = None,
                 vote: MajorityVote | None = None, families: dict[str, str] | None = None,
                 speculation: SpeculationSpec | None = None, model_free: set[str] | frozenset[str] = frozenset()):
        """`vote`: Minions' majority vote, for the requests drafting by vote (default: speculation.vote's).
        `families`: each drafter's model, for chain choice (drafters of one model draft the same chains).
        `speculation`: the mode and its settings (default: SpeculationSpec's). `model_free`: the n-gram and
        suffix drafters, which join every routed round beside the routed models (speculation/routing.py)."""
        self.drafters = list(drafters)
        self.router = Router(self.drafters, routing or RoutingSpec(), frozenset(generalists), frozenset(model_free))
        roster = Roster(self.drafters, self.router, embeddings)
        self.unscored = roster.unscored  # requests whose prompt no drafter has scored yet (routing's cold start)
        self.strategies = strategies(Setup(roster, speculation or SpeculationSpec(), fixed_drafters, vote,
                                           dict(families or {})))
        self.step_timeout_s = step_timeout_s
        self.round_budget_s = round_budget_s
        self.health = health or DrafterHealth()
        self.parked: set[str] = set()  # drafters scaled to zero replicas: not called until they are back
        self.rounds: dict[str, RoundRecord] = {}
        self.where: dict[str, set[str]] = {}  # drafters holding a cache for the request
        self.stats = {"rounds": 0, "drafter_failures": 0, "step_seconds": 0.0}
        self.on_failure: Callable[[str], None] | None = None  # told the drafter's name when a call fails
        self.routing_history: deque = deque(maxlen=1024)  # (rid, drafters ranked first..last) at release
        # seconds of a round's model phase (its depths, after the model-free lookups), by the number of requests
        # the models drafted for (bit length): the price of a round's drafter forwards (`_models_pay`)
        self.model_phase_s: dict[int, float] = {}
        self.model_phases_skipped = 0  # rounds drafted by the model-free drafters alone because the models did not pay

    @classmethod
    def from_config(cls, cfg: AppConfig) -> SpeculationCoordinator:
        spec = cfg.speculation
        return cls([d.name for d in cfg.drafters], cfg.routing, target_input_embeddings(cfg),
                   fixed_drafters=spec.fixed_drafters, step_timeout_s=spec.drafter_timeout_ms / 1000,
                   generalists={d.name for d in cfg.drafters if d.generalist},
                   round_budget_s=ROUND_SHARE * spec.draft_timeout_ms / 1000,
                   health=DrafterHealth(*spec.drafter_backoff_s),
                   families={d.name: d.model or d.name for d in cfg.drafters}, speculation=spec,
                   model_free={d.name for d in cfg.drafters if d.model_free})

    def state(self) -> dict:
        """Counters and timings, how many requests drafters hold a cache for (what a soak watches), the
        drafters sitting out after failures or parked at zero replicas, each model-free drafter's calibration over
        every request (accepted over claimed), and the strategies' own."""
        out = dict(self.stats, requests_held=len(self.where), drafters_sitting_out=self.health.sitting_out(),
                   drafters_parked=sorted(self.parked), model_phases_skipped=self.model_phases_skipped,
                   model_free_calibration={n: round(h / c, 3) for n, (h, c) in self.router.matched_all.items()})
        for s in self.strategies:
            out |= s.state()
        return out

    def release(self, rid: str) -> set[str]:
        """Forget the request; returns the drafters that must free its cache."""
        if rid in self.router.requests:
            self.routing_history.append((rid, self.router.ranking(rid)))
        self.router.release(rid)
        for s in self.strategies:
            s.release(rid)
        self.rounds.pop(rid, None)
        self.unscored.discard(rid)
        return self.where.pop(rid, set())

    def _feedback(self, rid: str, context: list[int]) -> None:
        rnd = self.rounds.get(rid)
        if rnd is None or rid not in self.router.requests:
            return
        committed = context[rnd.start:]
        if committed:
            for s in self.strategies:
                s.observe(rid, committed, rnd)
            self.router.observe_matches(rid, committed, rnd.claims, rnd.fused)

    def _start(self, req: DraftRequest) -> _Drafting:
        """Feedback from the request's last round, then this round's strategy and drafters."""
        rid = req.request_id
        if rid not in self.router.requests:
            self.router.add_request(rid)
            self.unscored.add(rid)
        elif not req.ahead:
            self._feedback(rid, req.context)
            for s in self.strategies:
                s.started(rid)
        up = [d for d in self.drafters if d not in self.parked and self.health.available(d)]
        strategy = next(s for s in self.strategies if s.claims(req, up))
        choice = strategy.choose(req, up, self.rounds.get(rid))
        cap = self.router.config.score_tokens
        prefix = cap if choice.scoring and cap is not None and len(req.context) > cap + PREFIX_MARGIN else None
        return _Drafting(req, strategy, choice.drafters, scoring=choice.scoring, fuser=FusionTree(budget=req.budget),
                         prefix=prefix)

    async def _call(self, step_fn: StepFn, name: str, calls: list[DrafterCall],
                    timeout_s: float) -> dict[str, list[Proposal]] | None:
        """The drafter's chains, or None where its call failed or came late."""
        t0 = time.perf_counter()
        try:
            got = await asyncio.wait_for(step_fn(name, calls), timeout_s)
        except Exception as e:  # noqa: BLE001 - a failed drafter only loses its proposals for this round
            self.stats["drafter_failures"] += 1
            self.health.failed(name, f"no answer in {timeout_s * 1000:.0f} ms" if isinstance(e, TimeoutError)
                               else f"call failed ({type(e).__name__})")
            if self.on_failure is not None:
                self.on_failure(name)
            return None
        self.health.succeeded(name)
        if not any(c.score_context for c in calls):  # a prompt's prefill is no measure of the drafter's speed
            for s in self.strategies:
                s.observe_call(name, time.perf_counter() - t0, max(c.steps for c in calls))
        return got

    async def _ask(self, rounds: dict[str, _Drafting], asking, depth: int, step_fn: StepFn, timeout: float,
                   only: frozenset[str] | None = None) -> None:
        """The calls `asking`'s rounds need at `depth` (of the drafters in `only`, if given), one batched call per
        drafter at once; each answer received by its round."""
        per_drafter: dict[str, list[DrafterCall]] = {}
        for r in asking:
            for name, call in r.calls(depth).items():
                if only is None or name in only:
                    per_drafter.setdefault(name, []).append(call)
                    # a drafter may build a cache even for a call that fails or times out
                    self.where.setdefault(call.request_id, set()).add(name)
        names = list(per_drafter)
        answers = await asyncio.gather(*(self._call(step_fn, n, per_drafter[n], timeout) for n in names))
        free = self.router.model_free
        for name, got in zip(names, answers):
            for call in per_drafter[name]:
                if got is None:
                    rounds[call.request_id].faulted = True
                elif call.request_id in got:
                    chain, r = got[call.request_id], rounds[call.request_id]
                    if name in free:  # a match's frequency, scaled by what the target accepted of this drafter's
                        r.raw.setdefault(name, {}).update((depth + i, p.prob) for i, p in enumerate(chain))
                        chain, r.factors[name] = self.router.calibrated(call.request_id, name, chain)
                    r.receive(depth, name, chain)

    async def _score_prefixes(self, rounds: dict[str, _Drafting], step_fn: StepFn, deadline: float) -> None:
        """Routing's cold start for contexts longer than `routing.score_tokens`: every drafter scores the first
        tokens, in calls of their own, then only the routed drafters draft, from the whole context (at depth 0)."""
        long = [r for r in rounds.values() if r.prefix]
        left = deadline - time.perf_counter()
        if not long or left <= 0:
            return
        models = frozenset(self.drafters) - self.router.model_free  # the model-free drafters have no likelihood
        await self._ask(rounds, long, -1, step_fn, min(self.step_timeout_s, left), only=models)
        for r in long:
            r.scored_prefix(self.router)

    async def _model_free_first(self, rounds: dict[str, _Drafting], step_fn: StepFn, deadline: float) -> None:
        """`routing.model_free_alone`: the model-free drafters' chains first (a lookup each), and the drafter
        models left out of the round of each request where one of those chains is expected to have that many tokens
        accepted. The chains are the round's depth-0 answers either way: the models, where they draft, are called
        as before, the model-free drafters not again."""
        free, alone = self.router.model_free, self.router.config.model_free_alone
        mixed = [r for r in rounds.values() if not r.scoring and r.alive & free and r.alive - free] \
            if free and alone is not None else []
        left = deadline - time.perf_counter()
        if not mixed or left <= 0:
            return
        await self._ask(rounds, mixed, 0, step_fn, min(self.step_timeout_s, left), only=free)
        expect = {r.req.request_id: max((expected_accepted(r.ahead[n].values()) for n in r.alive & free),
                                        default=0.0) for r in mixed}
        weak = [r for r in mixed if expect[r.req.request_id] < alone]
        # the models draft anyway for a request not asked first (a prompt being scored, no model-free drafter)
        others = [r for rid, r in rounds.items() if rid not in expect and r.alive - free]
        dropped = [r for r in mixed if expect[r.req.request_id] >= alone]
        if weak and not others and not self._models_pay(rounds.values(), weak, expect):
            dropped, self.model_phases_skipped = mixed, self.model_phases_skipped + 1
        for r in dropped:
            r.alive &= free
            r.chosen = [n for n in r.chosen if n in free]

    def _models_pay(self, rounds, weak: list[_Drafting], expect: dict[str, float]) -> bool:
        """Are the drafter models worth their forwards this round, for the requests whose model-free match is weak?
        Tokens per second of the verify step that follows, with the models (each weak request's drafted tokens
        accepted as in its recent rounds with models, the others' as their matches expect; the step waits for the
        model phase as recently measured at this many requests, less the verify step it overlaps when drafted
        ahead) against without (every request's match alone, no wait). Anything not measured yet: they pay."""
        rounds = list(rounds)
        verify_s = next((r.req.verify_s for r in rounds if r.req.verify_s), None)
        phase_s = self.model_phase_s.get(len(weak).bit_length())
        worth = [self.router.requests[r.req.request_id].model_accepted if r.req.request_id in self.router.requests
                 else None for r in weak]
        if verify_s is None or phase_s is None or any(m is None for m in worth):
            return True
        alone = sum(1 + expect.get(r.req.request_id, 0.0) for r in rounds)
        gain = sum(max(0.0, m - expect[r.req.request_id]) for r, m in zip(weak, worth))
        wait = max(0.0, phase_s - verify_s) if any(r.req.ahead for r in rounds) else phase_s
        return (alone + gain) / (verify_s + wait) > alone / verify_s

    async def draft(self, batch: list[DraftRequest], step_fn: StepFn) -> DraftRound:
        t0 = time.perf_counter()
        waits = [d.wait_s for d in batch if d.wait_s is not None]
        budgets = ([self.round_budget_s] if self.round_budget_s is not None else []) + [ROUND_SHARE * w for w in waits]
        budget = min(budgets, default=None)
        deadline = t0 + budget if budget is not None else float("inf")
        rounds = {req.request_id: self._start(req) for req in batch if req.k > 0}
        if not rounds:
            return DraftRound()
        await self._score_prefixes(rounds, step_fn, deadline)
        await self._model_free_first(rounds, step_fn, deadline)
        free, t_models = self.router.model_free, time.perf_counter()
        with_models = sum(1 for r in rounds.values() if r.alive - free) if free else 0
        for depth in range(max(r.req.k for r in rounds.values())):
            left = deadline - time.perf_counter()
            if left <= 0 or not any(r.alive for r in rounds.values() if depth < r.req.k):
                break  # out of time: the drafts so far
            await self._ask(rounds, rounds.values(), depth, step_fn, min(self.step_timeout_s, left))
            for r in rounds.values():
                r.advance(depth, self.router)
        faulted = any(r.faulted for r in rounds.values())
        # a prompt's scoring is not a round's cost, nor a fault's wait
        if with_models and not faulted and not any(r.scoring for r in rounds.values()):
            key, seconds = with_models.bit_length(), time.perf_counter() - t_models
            last = self.model_phase_s.get(key)
            self.model_phase_s[key] = seconds if last is None else 0.8 * last + 0.2 * seconds
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
            for s in self.strategies:
                s.ended(rid)
        self.stats["rounds"] += 1
        self.stats["step_seconds"] += time.perf_counter() - t0
        return DraftRound(drafts, faulted)

