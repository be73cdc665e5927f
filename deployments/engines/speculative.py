"""A single-process speculative generator: one verifier engine, one or more drafter engines.

Each round every running request gets a draft — a chain from one drafter, or a tree merged from several
drafters' chains — and the verifier checks all of them in one batched forward pass. This measures the engines
before (and without) the serving graph; the Ray Serve graph runs the same engines on separate deployments.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from deployments.engines.draft import Draft, TreeBuilder
from deployments.engines.drafter import DrafterEngine
from deployments.engines.runner import CacheFull
from deployments.engines.sampling import SamplingParams
from deployments.engines.verifier import TorchVerifierEngine


@dataclass
class GenerationResult:
    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    finish_reason: str | None
    stats: dict = field(default_factory=dict)
    text: str | None = None


class SpeculativeGenerator:
    def __init__(self, verifier: TorchVerifierEngine, drafters: list[DrafterEngine] | None = None, k: int = 4,
                 tree_budget: int | None = None, controller=None):
        """`k` is the draft length per drafter (the maximum when a goodput `controller` chooses per request)."""
        self.verifier = verifier
        self.drafters = drafters or []
        self.k = k
        self.tree_budget = tree_budget or k * max(1, len(self.drafters))
        self.controller = controller  # autoscale.goodput.SpeculationController or None (fixed k)
        self.draft_seconds = 0.0
        self.verify_seconds = 0.0

    def _drafts(self, params: dict[str, SamplingParams], assigned: dict[str, set[str]]) -> dict[str, Draft]:
        self.verifier.admit()  # draft for the requests this step verifies, never for queued ones
        rids = list(self.verifier.running)
        if not self.drafters or self.k <= 0 or not rids:
            return {}
        builders = {r: TreeBuilder(merge=params[r].greedy) for r in rids}
        if self.controller:
            ks = self.controller.choose(rids, groups={r: frozenset(assigned[r]) for r in rids})
        else:
            ks = {r: self.k for r in rids}
        for d in self.drafters:
            ok = []
            for r in rids:
                if d.name not in assigned[r]:
                    continue
                try:
                    d.sync(r, self.verifier.context(r), params[r].temperature, params[r].seed)
                    ok.append(r)
                except CacheFull:
                    pass
            sampling = any(not params[r].greedy for r in ok)
            ok = [r for r in ok if ks[r] > 0]
            if not ok:
                continue
            t = time.perf_counter()
            chains = d.draft(ok, {r: ks[r] for r in ok}, want_q=sampling)
            if self.controller and d.last_draft_steps:
                self.controller.draft.observe(len(ok), (time.perf_counter() - t) / d.last_draft_steps)
            for r, chain in chains.items():
                builders[r].add_chain([p.token for p in chain], [p.q for p in chain], d.name,
                                      [p.prob for p in chain], budget=self.tree_budget)
        return {r: b.build() for r, b in builders.items() if b.tokens}

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 drafters_per_request: list[list[str]] | None = None) -> list[GenerationResult]:
        """Generate for all prompts with continuous batching. `drafters_per_request` names the drafters of each
        request (a chain from one, a tree from several); by default every request uses every drafter."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        rids = [self.verifier.add_request(p, sp) for p, sp in zip(prompts, plist)]
        by_rid = dict(zip(rids, plist))
        names = [d.name for d in self.drafters]
        assigned = {r: set(drafters_per_request[i] if drafters_per_request else names) for i, r in enumerate(rids)}
        results = {r: GenerationResult(r, list(p), [], None) for r, p in zip(rids, prompts)}
        while self.verifier.has_unfinished():
            t0 = time.perf_counter()
            drafts = self._drafts(by_rid, assigned)
            t1 = time.perf_counter()
            outs = self.verifier.step(drafts)
            t2 = time.perf_counter()
            self.verify_seconds += t2 - t1
            if self.controller:
                self.controller.verify.observe(self.verifier.last_step_tokens, self.verifier.last_verify_seconds)
            self.draft_seconds += t1 - t0
            for o in outs:
                if self.controller:
                    self.controller.observe_acceptance(o.request_id, o.num_draft_tokens, o.num_accepted_tokens)
                res = results[o.request_id]
                res.token_ids.extend(o.new_token_ids)
                if o.finished:
                    res.finish_reason = o.finish_reason
                    res.text = o.text
                    res.stats = self.verifier.finished_stats(o.request_id) or {}
                    for d in self.drafters:
                        if o.request_id in d:
                            d.release(o.request_id)
                    if self.controller:
                        self.controller.release(o.request_id)
        return [results[r] for r in rids]
