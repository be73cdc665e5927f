"""The speculation cluster's central node, without Ray: routing, lockstep drafting, fusion, feedback.

`SpeculationCoordinator.draft` takes the verifier's batch (per request: full committed context and the draft
length it may use) and an async `step_fn(drafter_name, items) -> {rid: proposal}` that reaches one drafter
(a Serve handle in the deployment, a local engine in tests). Per round:

1. feedback: compare each drafter's proposals of the previous round with what the target committed since
   (Eq. 1-2) and update the router (accepted length and per-drafter scores);
2. routing: the request's drafters (Eq. 3), or all drafters on a request's first round, which score the prompt
   (mean log-likelihood) for the cold start;
3. drafting: with lockstep fusion, at each depth every chosen drafter proposes and the most confident token is fed
   back to all of them (Eq. 4), losers become branches; a drafter returns its whole chain from one call, and is
   only called again where its token lost (then its chain no longer follows the fused prefix). Without fusion
   each drafter drafts its own chain in one call and the chains are fused one-shot (`fuse_chains`);
4. the tree, trimmed to the request's budget, goes back to the verifier.
A drafter that fails or times out just drops out of the round; the verifier decodes without a draft if none is left.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import torch

from engines.draft import Draft
from engines.drafter import Proposal
from speculation.fusion import FusionTree, fuse_chains
from speculation.routing import Router, RoutingConfig, alignment

StepFn = Callable[[str, list[dict]], Awaitable[dict[str, dict]]]


@dataclass
class _Round:
    start: int  # committed context length when the round was drafted
    proposals: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # drafter -> [(token, conf)]
    fused: bool = True  # were the drafters fed the fused token (Eq. 4) or their own?


def _proposal(d: dict) -> Proposal:
    return Proposal(d["token"], d["prob"], d["top_tokens"], d["top_probs"], None, d.get("context_loglik"))


class SpeculationCoordinator:
    def __init__(self, drafters: list[str], routing: RoutingConfig | None = None, embeddings: torch.Tensor | None = None,
                 fusion: bool = True, fixed_drafters: list[str] | None = None, step_timeout_s: float = 5.0,
                 generalists: set[str] | frozenset[str] = frozenset()):
        self.drafters = list(drafters)
        self.router = Router(self.drafters, routing or RoutingConfig(), frozenset(generalists))
        self.embeddings = embeddings
        self.fusion = fusion
        self.fixed = fixed_drafters
        self.step_timeout_s = step_timeout_s
        self.rounds: dict[str, _Round] = {}
        self.where: dict[str, set[str]] = {}  # drafters holding a cache for the request
        self.stats = {"rounds": 0, "drafter_failures": 0, "step_seconds": 0.0}
        self.routing_history: deque = deque(maxlen=1024)  # (rid, drafters ranked first..last) at release

    def release(self, rid: str) -> set[str]:
        """Forget the request; returns the drafters that must free its cache."""
        if rid in self.router.requests:
            self.routing_history.append((rid, self.router.ranking(rid)))
        self.router.release(rid)
        self.rounds.pop(rid, None)
        return self.where.pop(rid, set())

    def _feedback(self, rid: str, context: list[int]) -> None:
        rnd = self.rounds.get(rid)
        if rnd is None or rid not in self.router.requests:
            return
        committed = context[rnd.start:]
        if not committed:
            return
        scores = {}
        for name, props in rnd.proposals.items():
            toks = [t for t, _ in props]
            confs = [c for _, c in props]
            scores[name] = alignment(committed, toks, confs, self.embeddings, rnd.fused) \
                if self.embeddings is not None else _exact_alignment(committed, toks)
        self.router.update(rid, float(len(committed)), scores)

    async def _call(self, step_fn: StepFn, name: str, items: list[dict]) -> dict[str, list[Proposal]]:
        """{rid: [proposal, ...]}: one proposal, or the whole chain when the item asked for several steps."""
        try:
            raw = await asyncio.wait_for(step_fn(name, items), self.step_timeout_s)
        except Exception:  # noqa: BLE001 - a failed drafter only loses its proposals for this round
            self.stats["drafter_failures"] += 1
            return {}
        return {r: [_proposal(d)] + [_proposal(m) for m in d.get("more", [])] for r, d in raw.items()}

    async def draft(self, batch: list[dict], step_fn: StepFn, budget: int = 8) -> dict[str, Draft]:
        """batch items: {"rid", "context": [...], "k": int} and optionally "budget" (tree nodes), "participants"
        (how many routed drafters, else routing.drafters_per_request), and the per-request overrides "drafters"
        (fixed list, no routing), "routing" ("router" | "random"), "fusion"."""
        t0 = time.perf_counter()
        ks, contexts, chosen, first, fuse = {}, {}, {}, set(), {}
        for it in batch:
            rid, ctx, k = it["rid"], it["context"], it.get("k", 4)
            if k <= 0:
                continue
            ks[rid], contexts[rid] = k, ctx
            if rid not in self.router.requests:
                self.router.add_request(rid)
                first.add(rid)
            else:
                self._feedback(rid, ctx)
            fuse[rid] = it.get("fusion", self.fusion)
            fixed = it.get("drafters") or self.fixed
            if fixed:
                chosen[rid] = [n for n in fixed if n in self.drafters]
                first.discard(rid)  # no cold start scoring when the drafters are fixed
            elif it.get("routing") == "random":
                chosen[rid] = self.router.rng.sample(self.drafters, min(len(self.drafters), it.get(
                    "participants") or self.router.config.drafters_per_request))
                first.discard(rid)
            elif rid in first:
                chosen[rid] = list(self.drafters)  # cold start: everyone scores the prompt
            else:
                chosen[rid] = self.router.route(rid, it.get("participants"))
        if not ks:
            return {}
        items = {it["rid"]: it for it in batch}
        fusers = {r: FusionTree(budget=items[r].get("budget", budget)) for r in ks}
        chains: dict[str, dict[str, list[Proposal]]] = {r: {n: [] for n in chosen[r]} for r in ks}
        # Every call asks a drafter for its whole remaining chain. A chain stays valid while the drafter's own
        # tokens are what it would have been fed: always without fusion, and with fusion while its token is the
        # fused one. A drafter whose token lost is called again at the next depth with the fused prefix. The
        # drafts are lockstep fusion's, at one round trip plus one per depth where a drafter disagreed, instead
        # of one per depth.
        ahead: dict[str, dict[str, dict[int, Proposal]]] = {r: {n: {} for n in chosen[r]} for r in ks}
        path: dict[str, dict[str, list[int]]] = {r: {n: [] for n in chosen[r]} for r in ks}  # fed after context
        alive = {r: set(chosen[r]) for r in ks}  # drafters still in the request's round
        for depth in range(max(ks.values())):
            if not any(alive[r] for r in ks if depth < ks[r]):
                break
            per_drafter: dict[str, list[dict]] = {}
            for r in ks:
                if depth >= ks[r]:
                    continue
                for n in alive[r]:
                    if depth in ahead[r][n]:
                        continue
                    item = {"rid": r, "context": contexts[r] + path[r][n]}
                    if depth == 0 and r in first:  # cold start: everyone scores the prompt, most are dropped
                        item["score_context"] = True
                    elif ks[r] - depth > 1:
                        item["steps"] = ks[r] - depth
                    per_drafter.setdefault(n, []).append(item)
            names = list(per_drafter)
            answers = await asyncio.gather(*(self._call(step_fn, n, per_drafter[n]) for n in names))
            for n, got in zip(names, answers):
                for it in per_drafter[n]:
                    r = it["rid"]
                    if r in got:
                        ahead[r][n] = {depth + i: p for i, p in enumerate(got[r])}
                        self.where.setdefault(r, set()).add(n)
            for r in ks:
                if depth >= ks[r]:
                    continue
                props = {n: ahead[r][n][depth] for n in alive[r] if depth in ahead[r][n]}
                if depth == 0 and r in first:
                    ll = {n: p.context_loglik for n, p in props.items() if p.context_loglik is not None}
                    if ll:
                        self.router.add_request(r, ll)
                        keep = self.router.route(r, items[r].get("participants"))
                        props = {n: p for n, p in props.items() if n in keep}
                        chosen[r] = [n for n in chosen[r] if n in keep]
                alive[r] = set(props)  # a drafter that failed or ran out of room sits the rest of the round out
                if not props:
                    continue
                for n, p in props.items():
                    chains[r][n].append(p)
                tok = fusers[r].step(props) if fuse[r] else None
                for n, p in props.items():
                    path[r][n].append(p.token if tok is None else tok)
                    if tok is not None and p.token != tok:
                        ahead[r][n] = {}  # its chain went on from its own token: call it again
        drafts = {}
        for r in ks:
            if fuse[r]:
                d = fusers[r].build() if fusers[r].chain else None
            else:  # each drafter followed its own tokens: fuse the chains one-shot
                d = fuse_chains({n: [(p.token, p.prob) for p in ch] for n, ch in chains[r].items()},
                                fusers[r].budget)
            if d is not None and len(d):
                drafts[r] = d
            self.rounds[r] = _Round(len(contexts[r]), {n: [(p.token, p.prob) for p in ch]
                                                       for n, ch in chains[r].items() if ch}, fuse[r])
        self.stats["rounds"] += 1
        self.stats["step_seconds"] += time.perf_counter() - t0
        return drafts


def _exact_alignment(committed: list[int], drafted: list[int]) -> float:
    n = 0
    while n < min(len(committed), len(drafted)) and committed[n] == drafted[n]:
        n += 1
    return n / max(1, len(drafted))
