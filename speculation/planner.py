"""Draft planning: what each running request drafts this round, from the controller (the goodput model's or the
hill climber's), the request's own bounds and Gamma_max."""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Collection, Sequence

from config import AppConfig, SpeculationSpec
from speculation.controller import DraftLengthController
from speculation.goodput import GoodputController
from speculation.guard import SpeculationGuard
from speculation.hill_climb import HillClimbController
from speculation.messages import DraftRequest, Participation, SpeculationOverrides
from speculation.retirement import DomainDrafterRetirement
from speculation.strategies import strategy_class


def _routed(mode: str) -> bool:
    """Does the mode route several drafters per request (the strategy's `routed`)?"""
    cls = strategy_class(mode)
    return cls is not None and cls.routed


class DraftPlanner:
    def __init__(self, cfg: AppConfig):
        self.cfg = cfg
        self.controller = make_controller(cfg)
        spec = cfg.speculation
        # every method that speculates, fixed-k ones (`adaptive: false`) too: a fixed k can lose as any controller
        guarded = spec.guard.enabled and spec.mode != "off"
        self.guard = SpeculationGuard.from_spec(spec.guard) if guarded else None
        self.retirement = DomainDrafterRetirement.from_config(cfg)
        self.recent_k: deque = deque(maxlen=128)  # the chosen depths of requests that may speculate
        self.chosen: list[int] = []  # the last round's

    def plan(self, contexts: dict[str, list[int]], overrides: dict[str, SpeculationOverrides],
             overlap_s: float = 0.0, ahead: bool = False, unscored: Collection[str] = frozenset()) -> list[DraftRequest]:
        """This round's draft requests: per-request depth from the controller (within each request's own
        bounds; `overlap_s` of verification runs beside this drafting), Gamma_max over the batch, and how each
        request drafts (participation). `ahead`: the contexts end with drafts being verified (DraftRequest.ahead).
        `unscored`: requests that have drafted on the generalist only, whose first routed round scores their prompt
        with every drafter."""
        spec, rids = self.cfg.speculation, list(contexts)
        if self.guard is not None and not self.guard.allow(len(rids)):
            self.chosen = [0] * len(rids)  # plain decoding: switched off, or measuring plain steps
            self.recent_k.extend(self.chosen)
            return []
        caps = {r: 0 if not o.enabled else min(spec.k, spec.k if o.max_draft_tokens is None else o.max_draft_tokens)
                for r, o in overrides.items()}
        # a routed round would score these requests' contexts with every drafter
        ks = self.controller.choose(rids, caps, overlap_s=overlap_s, ahead=ahead,
                                    unscored={r: len(contexts[r]) for r in unscored if r in contexts}) \
            if self.controller else caps
        self.chosen = [ks[r] for r in rids if caps[r] > 0]  # the requests that may speculate
        self.recent_k.extend(self.chosen)
        while sum(ks.values()) > spec.gamma_max:  # Gamma_max: shorten the longest drafts (CoSine Alg. 2)
            ks[max(ks, key=ks.get)] -= 1
        batch = []
        for r in rids:
            if ks[r] <= 0:
                continue
            o, mode = overrides[r], self.participation(overrides[r])
            k = ks[r] + ahead  # drafted ahead: one more, for the token the target adds after the verified chain
            batch.append(DraftRequest(r, contexts[r], k,
                                      # up to n nodes per depth: the fused path and its branches
                                      budget=min(spec.tree_budget, mode.drafters_per_request * k),
                                      participation=mode, drafters=o.drafters, routing=o.routing, ahead=ahead,
                                      tenant=o.tenant))
        if self.retirement is not None:
            if not (self.controller and self.controller.probing):  # a probe of a routed mode only measures it
                self.retirement.observe(len(batch), sum(1 for d in batch if not d.participation.generalist))
            batch = self.retirement.apply(batch)
        return batch

    def participation(self, o: SpeculationOverrides) -> Participation:
        """How a request drafts this round: the controller's choice unless the request fixes its drafters, their
        number or lockstep (then lockstep is the configured one, or the controller's where the number matches)."""
        spec, mode = self.cfg.speculation, self.controller.participation if self.controller else None
        strategy = strategy_class(o.mode or spec.mode)
        fixed = strategy.participation(self.cfg, o) if strategy is not None else None
        if fixed is not None:
            return fixed
        if o.drafters:
            n = len(o.drafters)
        elif not _routed(spec.mode):
            n = 1
        elif mode is not None and mode.generalist and not o.drafters_per_request:
            return mode
        else:
            n = o.drafters_per_request or (mode.drafters_per_request if mode else
                                           self.cfg.routing.drafters_per_request)
        if n <= 1:
            return Participation(1)
        if o.lockstep is not None:
            lockstep = o.lockstep
        elif mode is not None and mode.drafters_per_request == n:
            lockstep = mode.lockstep
        else:
            lockstep = spec.lockstep
        return Participation(n, lockstep and _routed(spec.mode))

    def observe_round(self, batch: list[DraftRequest], participations: set[Participation | None],
                      seconds: float, faulted: bool = False, scored_tokens: int = 0) -> None:
        """Price a drafting round: per lockstep depth by the number of requests drafting, or, choosing the
        participation, per participation in the round's depth and requests (only a round of one participation
        without prompt scoring, marked None in `participations`, says what it costs; a round a drafting tier did not
        price, on a tier the plans do not draft on, says nothing, nor does a round `faulted` by a drafter's failed
        or late call: `DraftRound.faulted`). A round of one participation that also scored `scored_tokens` tokens
        of new prompts says what scoring adds to it."""
        if self.controller is not None and not faulted and all(d.priced for d in batch):
            depth, drafted = max(d.k for d in batch), {d.participation for d in batch}
            self.controller.observe_round(len(batch), depth, participations, seconds)
            if scored_tokens and len(drafted) == 1:
                self.controller.observe_scoring(drafted.pop(), len(batch), depth, scored_tokens, seconds)

    def observe_step(self, tokens: int, seconds: float, wall_s: float) -> None:
        """A verify step of `tokens` took `seconds`; `wall_s` since the previous step ended (drafting included)."""
        if self.controller is not None:
            self.controller.observe_verify(tokens, seconds, wall_s)

    def observe_committed(self, requests: int, committed: int, wall_s: float, speculated: bool,
                          prefill: bool) -> None:
        """A verify step of `requests` requests committed `committed` tokens, `wall_s` since the previous step ended;
        `speculated`: it waited for a drafting round; `prefill`: it fed a prompt (for the guard)."""
        if self.guard is not None:
            self.guard.observe(requests, committed, wall_s, speculated, prefill)

    def observe_acceptance(self, rid: str, depth: int, accepted: int, participation: Participation | None) -> None:
        """A verified round of `rid` (depth 0: it had no draft), drafted with `participation`."""
        if self.controller is not None:
            self.controller.observe_verified(rid, depth, accepted, participation)

    def state(self, drafting_overlaps_verification: bool) -> dict | None:
        """The controller's state for operators (`speculation_stats`)."""
        c = self.controller
        guard = {"guard": self.guard.state()} if self.guard is not None else {}
        if c is None:
            return guard or None
        ks = list(self.recent_k)
        common = {"kind": self.cfg.speculation.controller.kind, "mean_k_recent": sum(ks) / max(1, len(ks)),
                  "zero_k_share": ks.count(0) / max(1, len(ks)),
                  "drafting_overlaps_verification": drafting_overlaps_verification,
                  "participation": str(c.participation) if c.participation else None}
        if self.retirement is not None:
            common |= {"domain_drafters_retired": self.retirement.retired, "routed_share": self.retirement.share()}
        return common | guard | c.state()


def make_controller(cfg: AppConfig) -> DraftLengthController | None:
    """The controller the configuration asks for: none without adaptive speculation; the hill climber (Minions)
    for `controller.kind: hill_climb`; else the goodput controller, which with several drafters per request also
    picks the participation: one drafter, or n fused in lockstep (if on) or one-shot."""
    spec = cfg.speculation
    if not spec.adaptive or spec.mode == "off":
        return None
    if spec.controller.kind == "hill_climb":
        return HillClimbController(spec.k, spec.controller.window, spec.controller.hold)
    # a multi-drafter round verifies up to drafters_per_request nodes per depth (the chain and its branches)
    per_depth = cfg.routing.drafters_per_request if _routed(spec.mode) else 1
    participations: tuple[Participation, ...] = ()
    if spec.adaptive_drafters and _routed(spec.mode):
        # the generalist instead of the routed drafter: one batched step per depth for the whole round, where
        # routing spreads a batch over several drafters (measured, 8 requests on two cores: 226 tok/s on the
        # generic drafter alone against 166 routed; routed wins alone, 97 against 90)
        shared = (Participation(1, generalist=True),) if any(d.generalist for d in cfg.drafters) else ()
        # (the generalist first: where the measurements tie, the round that uses fewer drafters)
        participations = shared + (Participation(1),) + tuple(Participation(n, lockstep)
                                                     for lockstep in ((True, False) if spec.lockstep else (False,))
                                                     for n in range(2, per_depth + 1))
        if len(participations) == 1:
            participations = ()
    not_its = {"verify_seed_ms", "draft_seed_ms", "kind", "window", "hold"}  # seeds set below; the hill climber's
    c = GoodputController(k_max=spec.k, drafters_per_request=per_depth, parallel_groups=True, participations=participations,
                              **spec.controller.model_dump(exclude=not_its))
    for model, seed in ((c.verify, spec.controller.verify_seed_ms), (c.draft, spec.controller.draft_seed_ms)):
        if seed is not None:
            model.a, model.b = seed[0] / 1000, seed[1] / 1000
    return c


def draft_timeout_s(spec: SpeculationSpec, recent_verify_s: Sequence[float], scoring: bool) -> float:
    """How long the loop waits for a round's drafts: `draft_timeout_share` times the median of the recent verify
    steps, within `draft_timeout_ms` (the bound alone before any step is measured, and for a round that scores a
    new request's prompt: its prefill is the prompt's cost, and routing needs it once)."""
    bound = spec.draft_timeout_ms / 1000
    if scoring or spec.draft_timeout_share is None or not recent_verify_s:
        return bound
    return min(bound, spec.draft_timeout_share * statistics.median(recent_verify_s))
