"""A single-process speculative generator: one verifier engine, one or more drafter engines.

Each round every running request gets a draft — a chain from one drafter, or a tree merged from several
drafters' chains — and the verifier checks all of them in one batched forward pass. This measures the engines
before (and without) the serving graph; the Ray Serve graph runs the same engines on separate deployments.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from engines.draft import Draft, TreeBuilder
from engines.drafter import DrafterEngine
from engines.runner import CacheFull
from engines.sampling import SamplingParams
from engines.verifier import TorchVerifierEngine


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
        self.controller = controller  # speculation.goodput.SpeculationController or None (fixed k)
        self.draft_seconds = 0.0
        self.verify_seconds = 0.0

    def _drafts(self, params: dict[str, SamplingParams], assigned: dict[str, set[str]]) -> dict[str, Draft]:
        self.verifier.admit()  # draft for the requests this step verifies, never for queued ones
        rids = list(self.verifier.running)
        if not self.drafters or self.k <= 0 or not rids:
            return {}
        builders = {r: TreeBuilder(merge=params[r].greedy) for r in rids}
        if self.controller:
            groups = {r: frozenset(i for i, d in enumerate(self.drafters) if assigned[r] & set(d.model_names))
                      for r in rids}
            ks = self.controller.choose(rids, groups=groups)
        else:
            ks = {r: self.k for r in rids}
        for d in self.drafters:
            owner = {}  # engine key -> request
            for r in rids:
                for name in d.model_names:
                    if name not in assigned[r]:
                        continue
                    key = d.key(r, name)
                    try:
                        d.sync(key, self.verifier.context(r), params[r].temperature, params[r].seed, model=name)
                        owner[key] = r
                    except CacheFull:
                        pass
            sampling = any(not params[r].greedy for r in owner.values())
            keys = [key for key, r in owner.items() if ks[r] > 0]
            if not keys:
                continue
            t = time.perf_counter()
            chains = d.draft(keys, {key: ks[owner[key]] for key in keys}, want_q=sampling)
            if self.controller and d.last_draft_steps:
                self.controller.draft.observe(len(keys), (time.perf_counter() - t) / d.last_draft_steps)
            for key, chain in chains.items():
                builders[owner[key]].add_chain([p.token for p in chain], [p.q for p in chain], d.model_of(key),
                                               [p.prob for p in chain], budget=self.tree_budget)
        return {r: b.build() for r, b in builders.items() if b.tokens}

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 drafters_per_request: list[list[str]] | None = None) -> list[GenerationResult]:
        """Generate for all prompts with continuous batching. `drafters_per_request` names the drafters of each
        request (a chain from one, a tree from several); by default every request uses every drafter."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        rids = [self.verifier.add_request(p, sp) for p, sp in zip(prompts, plist)]
        by_rid = dict(zip(rids, plist))
        names = [n for d in self.drafters for n in d.model_names]
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
                    self.controller.observe_acceptance(o.request_id, o.draft_depth, o.num_accepted_tokens)
                res = results[o.request_id]
                res.token_ids.extend(o.new_token_ids)
                if o.finished:
                    res.finish_reason = o.finish_reason
                    res.text = o.text
                    res.stats = self.verifier.finished_stats(o.request_id) or {}
                    for d in self.drafters:
                        for key in d.keys_of(o.request_id):
                            d.release(key)
                    if self.controller:
                        self.controller.release(o.request_id)
        return [results[r] for r in rids]
