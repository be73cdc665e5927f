"""Goodput-driven speculation length (SmartSpec): choose each request's draft length, 0..k_max, to maximise

    goodput = sum_i E_i(k_i) / (T_draft(k) + T_verify(sum_i (1 + k_i)))

where E_i(k) = (1 - a_i^(k+1)) / (1 - a_i) is the expected number of tokens a verification commits for request i
with per-token acceptance a_i (bonus token included), T_verify is a fitted linear model of the verifier's step time
in the number of tokens it processes, and T_draft the lockstep drafting time (one drafter step per depth, over the
requests still drafting at that depth). k = 0 for everyone is plain decoding, so the choice is never worse than
no speculation under the model: speculation is only switched on where it pays, e.g. not at large batches on a
CPU where verifying k tokens costs almost k times one.

Acceptance is only observed where drafts are verified, so a request held at k = 0 would never learn that its
drafter had become good (or that the prior was too pessimistic). Two things keep the estimates alive: a new request
starts from the pool's recent acceptance rather than a fixed prior, and a request held at k = 0 for
`probe_interval` rounds drafts `probe_k` tokens once (exploration; a probe never changes the output, it only costs
a little verify work).

Participation (CoSine Alg. 2: "when the verifier is idle, more drafter nodes participate; when it is overloaded,
fewer"): given `participations`, the controller also picks how every request drafts this round: with how many
drafters, and whether they are fused in lockstep (the fused token fed back) or each drafts its own chain in one call,
fused at the divergences (speculation/fusion.py). n drafters put up to n nodes per depth in the verify batch (the
fused path and its branches), so n multiplies the verify work per draft token. Given a generalist drafter, one more
participation has every request of the round draft with it instead of its routed drafter: one batched step per depth,
where routing spreads the batch over as many drafters as it has domains (offered only with two or more requests
drafting). What a participation buys is measured, not assumed: acceptance is counted per participation over the pool
(a request's own estimate is shifted by the difference between the participations), and drafting time per
participation is fitted from the rounds drafted in it (lockstep pays its hops per depth, one-shot once). Where verify
tokens are nearly free (batch 1 on a GPU, or small batches here) extra drafters pay; at a loaded verifier one drafter
per request does. A participation not tried for `participation_probe` rounds is tried once; a participation the model
puts well behind the one chosen (outside `participation_hysteresis`) waits twice as long after each probe, up to
`participation_probe_max` rounds, and is back to `participation_probe` as soon as the model puts it within reach:
probes of two-drafter participations that cannot win on a 2-core CPU cost drafting time (docs/benchmarks.md, `cosine
bench rounds`, measured with and without the backoff side by side)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from speculation.controller import DraftLengthController
from speculation.latency import LinearLatency, RoundLatency, expected_row, expected_tokens
from speculation.messages import Participation


@dataclass
class GoodputController(DraftLengthController):
    """Per-request draft lengths from acceptance estimates and fitted step-latency models."""

    k_max: int = 8
    prior_acceptance: float = 0.6
    ema: float = 0.3
    verify: LinearLatency = field(default_factory=LinearLatency)
    draft: LinearLatency = field(default_factory=LinearLatency)  # one lockstep drafter step, in batch size
    drafters_per_request: int = 1  # draft work scales with the number of drafters in lockstep
    # drafter groups (requests served by different drafter models) step one after another in one process;
    # in the serving graph each domain's drafters are their own deployment and step in parallel
    parallel_groups: bool = False
    probe_interval: int = 8
    probe_k: int = 2
    participations: tuple[Participation, ...] = ()  # participations to choose from each round (none: not adaptive)
    participation_probe: int = 32
    participation_probe_max: int = 256
    # a participation replaces the one in use only when it predicts this much more goodput
    participation_hysteresis: float = 0.03
    acceptance: dict[str, float] = field(default_factory=dict)
    pool_acceptance: float | None = None  # over every request's recent rounds: the start of new requests
    pool_counts: tuple = (0.0, 0.0)
    counts: dict[str, tuple] = field(default_factory=dict)
    idle_rounds: dict[str, int] = field(default_factory=dict)
    participation: Participation | None = None  # chosen by the last `choose` when adaptive
    # per participation: decayed (accepted, trials); the one a request's estimate was formed under; rounds since each
    # was last used; rounds unused before its next probe; a round's drafting time
    participation_counts: dict[Participation, tuple] = field(default_factory=dict)
    participation_of: dict[str, Participation] = field(default_factory=dict)
    participation_age: dict[Participation, int] = field(default_factory=dict)
    participation_wait: dict[Participation, int] = field(default_factory=dict)
    participation_draft: dict[Participation, RoundLatency] = field(default_factory=dict)
    predicted_goodput: float = 0.0  # tokens per second the last choice expects (the model's, for operators)
    probing: bool = False  # the last `choose` tried a participation for its measurements, not for its goodput
    held_participation: Participation | None = None  # the participation chosen for its goodput last (not a probe)
    # per participation: the last plan, and what it was planned from (`_plan_inputs`)
    last_plans: dict[Participation | None, tuple] = field(default_factory=dict, repr=False)
    # seconds per context token a routed round spends scoring new prompts with every drafter, beyond its
    # participation's round model (None: not measured yet)
    scoring_s_per_token: float | None = None

    def observe_acceptance(self, rid: str, drafted: int, accepted: int,
                           participation: Participation | None = None) -> None:
        """Per-token acceptance under the geometric model: the maximum-likelihood estimate is accepted tokens over
        (accepted tokens + rejections), a chain having one rejection unless it was accepted whole; exponentially
        decayed counts (weight `ema` on the newest round) follow drifting acceptance. `drafted` is the draft's
        depth (a tree's longest path), not its node count: counting sibling branches as rejections would make
        short drafts look worse and keep them short."""
        if drafted <= 0:
            return
        trials = accepted + (1 if accepted < drafted else 0)

        def decayed(counts: tuple, keep: float) -> tuple:
            return keep * counts[0] + accepted, keep * counts[1] + trials

        # the starting estimate weighs two trials
        s, t = self.counts[rid] = decayed(self.counts.get(rid, (2 * self._start(), 2.0)), 1 - self.ema)
        self.acceptance[rid] = s / t
        self.pool_counts = decayed(self.pool_counts, 0.95)
        self.pool_acceptance = self.pool_counts[0] / self.pool_counts[1]
        if participation is not None:
            counts = self.participation_counts.get(participation, (0.0, 0.0))
            self.participation_counts[participation] = decayed(counts, 0.95)
            self.participation_of[rid] = participation

    def observe_verified(self, rid: str, drafted: int, accepted: int, participation: Participation | None) -> None:
        self.observe_acceptance(rid, drafted, accepted, participation if self.participations else None)

    def observe_verify(self, tokens: int, seconds: float, wall_s: float) -> None:
        self.verify.observe(tokens, seconds)

    def observe_round(self, requests: int, depth: int, participations: set[Participation | None],
                      seconds: float) -> None:
        """Without participations, one lockstep step per depth; with them, the round in its participation, where
        it was one."""
        if not self.participations:
            self.draft.observe(requests, seconds / depth)
        elif len(participations) == 1 and None not in participations:
            self.draft_model(next(iter(participations))).observe(depth, requests, seconds)

    def observe_scoring(self, participation: Participation, requests: int, depth: int, scored_tokens: int,
                        seconds: float) -> None:
        """What scoring new prompts added to a routed round: its time beyond the participation's round model, per
        context token scored (weight `ema` on the newest). Once the model is fitted, the time a routed plan's
        round would spend scoring is priced into the plan where the generalist is on offer (`choose`), as the loop
        waits for it: on a CPU it is a forward per drafter and prompt, and unpriced it kept routed rounds in play at
        concurrency 8 where the generalist alone drafted faster. A lone request is scored whatever it drafts with:
        priced there, the one-time cost tilted its first round's plan toward two-drafter modes, which the
        participation held then kept (measured: 0.93x at concurrency 1)."""
        model = self.priced(participation)
        if participation.generalist or scored_tokens <= 0 or depth <= 0 or not (model.a or model.b or model.c):
            return
        rate = max(seconds - model(depth, requests), 0.0) / scored_tokens
        old = self.scoring_s_per_token
        self.scoring_s_per_token = rate if old is None else (1 - self.ema) * old + self.ema * rate

    def state(self) -> dict:
        return {"verify_fit_ms": [1000 * self.verify.a, 1000 * self.verify.b],
                "scoring_ms_per_token": None if self.scoring_s_per_token is None else 1000 * self.scoring_s_per_token,
                "draft_round_fit_ms": {str(p): [1000 * m.a, 1000 * m.b, 1000 * m.c]
                                       for p, m in self.participation_draft.items()},
                "pool_acceptance": self.pool_acceptance,
                "acceptance_by_participation": {str(p): self.participation_acceptance(p)
                                                for p in self.participation_counts}}

    def draft_model(self, participation: Participation) -> RoundLatency:
        """A round's drafting time in its depth and requests, per participation: t = a + k (b + c n). Lockstep
        fusion pays a round trip per depth (large b), one-shot drafting one call for the whole chain (the hop in a,
        engine steps in b and c)."""
        return self.participation_draft.setdefault(participation, RoundLatency())

    def priced(self, participation: Participation) -> RoundLatency:
        """The model a plan prices a participation's rounds by: its own once it has a fit; before, the most observed
        fitted participation's, scaled by drafters per request. An empty model prices drafting at nothing and won
        the plan: at concurrency 8 every two-drafter participation was chosen for its first rounds (87 ms a round
        against the generalist's 26 on the 2-core CPU). The generalist's rounds (one batched forward per depth)
        cost less than any other's, so it is measured at no price, as is every participation before any has a
        fit: their first rounds draft and are measured."""
        own = self.draft_model(participation)
        if own.seen >= 4 or own.a or own.b or own.c or participation.generalist:
            return own
        fitted = [(m.seen, p) for p, m in self.participation_draft.items() if m.seen >= 4]
        if not fitted:
            return own
        source = max(fitted, key=lambda sp: sp[0])[1]
        m, scale = self.participation_draft[source], participation.drafters_per_request / source.drafters_per_request
        return RoundLatency(m.a * scale, m.b * scale, m.c * scale)

    def participation_acceptance(self, participation: Participation) -> float | None:
        s, t = self.participation_counts.get(participation, (0.0, 0.0))
        return s / t if t >= 1.0 else None

    def _start(self) -> float:
        return self.prior_acceptance if self.pool_acceptance is None else self.pool_acceptance

    def release(self, rid: str) -> None:
        self.acceptance.pop(rid, None)
        self.counts.pop(rid, None)
        self.idle_rounds.pop(rid, None)
        self.participation_of.pop(rid, None)

    def _time(self, ks: list[int], groups: list | None = None, participation: Participation | None = None,
              overlap: float = 0.0, ahead: bool = False) -> float:
        """Seconds per round. `overlap`: verify work of other requests that the drafting runs alongside (the
        serving graph's pipeline), so only drafting beyond it costs time. `ahead`: a round drafted ahead drafts
        one token deeper than it verifies, and the loop awaits it whether or not its chains are accepted."""
        n = participation.drafters_per_request if participation else self.drafters_per_request
        verify = self.verify(sum(1 + k * n for k in ks))
        drafted = [k + ahead if k > 0 else 0 for k in ks]
        if participation is not None:  # measured per participation, the hops included
            depth, drafting = max(drafted, default=0), sum(1 for k in ks if k > 0)
            return verify + (max(0.0, self.priced(participation)(depth, drafting) - overlap) if depth else 0.0)
        groups = groups or [0] * len(ks)
        combine = max if self.parallel_groups else sum
        model = self.draft
        draft = 0.0
        for depth in range(1, max(drafted, default=0) + 1):
            per_group: dict = {}
            for k, g in zip(drafted, groups):
                if k >= depth:
                    per_group[g] = per_group.get(g, 0) + 1
            draft += combine(model(m) for m in per_group.values())
        # drafters of one request step one after another in one process, in parallel as separate deployments
        draft *= 1 if self.parallel_groups else n
        return verify + max(0.0, draft - overlap)

    def choose(self, rids: list[str], k_caps: dict[str, int] | None = None,
               groups: dict[str, object] | None = None, overlap_s: float = 0.0, ahead: bool = False,
               unscored: Mapping[str, int] = MappingProxyType({})) -> dict[str, int]:
        """Greedy allocation: repeatedly set the one draft length (to any longer value) that raises goodput
        most, while any does. Jumps, not unit steps, because a drafter's fixed per-step cost can make k = 1
        worse than k = 0 while k = 4 is better. `groups` names each request's drafter model(s). Given `participations`,
        the allocation is made for every participation and the best plan is kept; the participation is left in
        `self.participation`. `unscored`: requests whose first routed round would score their prompt, with the
        context tokens it reads (the time to score them priced into routed plans, `observe_scoring`)."""
        # one request drafts with one drafter either way: the generalist would share nothing, only draft worse
        participations = [m for m in self.participations if len(rids) > 1 or not m.generalist]
        # what a routed round would spend scoring the prompts not scored yet, priced where a plan can avoid it:
        # beside the generalist (a lone request is scored either way)
        scoring = (self.scoring_s_per_token or 0.0) * sum(unscored.get(r, 0) for r in rids) \
            if any(m.generalist for m in participations) else 0.0
        plans = {p: self._allocate(rids, k_caps, groups, p, overlap_s, ahead,
                                   0.0 if p is None or p.generalist else scoring)
                 for p in participations or [None]}
        best = max(plans, key=lambda m: plans[m][1])  # ties: the first listed
        # participations that measure alike (a routed round whose drafters are parked routes to the generalist) must not
        # alternate: the autoscaler reads the participations chosen
        held = self.held_participation
        if held in plans and held != best and plans[held][1] * (1 + self.participation_hysteresis) >= plans[best][1]:
            best = held
        # a lone request's routed round (no generalist offered) holds nothing
        if len(participations) == len(self.participations):
            self.held_participation = best
        participation = best
        ks, self.predicted_goodput = plans[best]
        if participations and any(ks.values()):
            for m in participations:
                self.participation_age[m] = self.participation_age.get(m, 0) + 1
                if plans[m][1] * (1 + self.participation_hysteresis) >= plans[best][1]:  # within reach: the base rate
                    self.participation_wait[m] = self.participation_probe
            stale = max(participations, key=lambda m: self.participation_age[m] - self._wait(m))  # the most overdue
            if self.participation_age[stale] > self._wait(stale):
                # keep every participation's acceptance and cost measured (a probe never changes the output)
                participation = stale
                self.participation_wait[stale] = min(2 * self._wait(stale), self.participation_probe_max)
            self.participation_age[participation] = 0
            # a routed probe beside the generalist waits (its wait grown as after any probe) for a round without
            # prompts to score: it would score them with every drafter (0.4-0.6 s a round at concurrency 8 on the
            # 2-core CPU, every request of the batch waiting: ours' p99 inter-token latency there) and price nothing
            if best.generalist and not participation.generalist and any(r in unscored for r in rids):
                participation = best
        self.probing = participation != best
        self.participation = participation
        for r in rids:  # exploration: a request held at k = 0 for long drafts a little once
            if ks[r] > 0:
                self.idle_rounds[r] = 0
                continue
            self.idle_rounds[r] = self.idle_rounds.get(r, 0) + 1
            cap = min(self.k_max, (k_caps or {}).get(r, self.k_max))
            if self.idle_rounds[r] > self.probe_interval and cap > 0:
                ks[r] = min(self.probe_k, cap)
                self.idle_rounds[r] = 0
        return ks

    def _wait(self, participation: Participation) -> int:
        return self.participation_wait.get(participation, self.participation_probe)

    def _acceptance_at(self, rid: str, participation: Participation | None) -> float:
        """The request's acceptance, moved to `participation` by the pool's difference between participations."""
        if participation is None:
            return self.acceptance.get(rid, self._start())
        here = self.participation_acceptance(participation)
        if rid not in self.acceptance:  # a new request starts from the participation's pool acceptance
            return here if here is not None else self._start()
        a = self.acceptance[rid]
        there = self.participation_acceptance(self.participation_of.get(rid, participation))
        if here is None or there is None:
            return a
        return min(max(a + here - there, 0.0), 0.999)

    def _allocate(self, rids, k_caps, groups, participation: Participation | None = None,
                  overlap: float = 0.0, ahead: bool = False, scoring: float = 0.0) -> tuple[dict[str, int], float]:
        """The plan for `participation`: the last one where what it is planned from is unchanged (a copy: `choose`
        adds its probes to it), the greedy search's otherwise. `scoring`: seconds its round would spend scoring
        prompts."""
        caps = {r: min(self.k_max, (k_caps or {}).get(r, self.k_max)) for r in rids}
        if not rids:
            return {}, 0.0
        acc = {r: self._acceptance_at(r, participation) for r in rids}
        group_list = [(groups or {}).get(r, 0) for r in rids]
        inputs = self._plan_inputs(rids, caps, acc, group_list, participation, overlap, ahead) + (scoring,)
        last = self.last_plans.get(participation)
        if last is None or last[0] != inputs:
            last = self.last_plans[participation] = (inputs, self._search(rids, caps, acc, group_list, participation,
                                                                     overlap, ahead, scoring))
        ks, g = last[1]
        return dict(ks), g

    def _plan_inputs(self, rids, caps, acc, group_list, participation: Participation | None, overlap: float,
                     ahead: bool) -> tuple:
        """Everything a plan depends on: the requests in order (the search breaks ties by it), their caps and
        acceptances, the latency models' coefficients, the overlap and drafting ahead."""
        if participation is not None:
            model = self.priced(participation)
            drafting = (model.a, model.b, model.c)
        else:
            drafting = (self.draft.a, self.draft.b, tuple(group_list), self.drafters_per_request, self.parallel_groups)
        return (tuple(rids), tuple(caps[r] for r in rids), tuple(acc[r] for r in rids), self.verify.a, self.verify.b,
                drafting, overlap, ahead)

    def _search(self, rids, caps, acc, group_list, participation: Participation | None, overlap: float,
                ahead: bool, scoring: float = 0.0) -> tuple[dict[str, int], float]:
        if participation is not None:
            return self._allocate_fast(rids, caps, acc, participation, overlap, ahead, scoring)
        ks = {r: 0 for r in rids}

        def goodput(kv: dict[str, int]) -> float:
            t = self._time(list(kv.values()), group_list, participation, overlap, ahead)
            return sum(expected_tokens(acc[r], k) for r, k in kv.items()) / max(t, 1e-9)

        best = goodput(ks)
        while True:
            # candidate moves: one request to a longer draft, or every request to at least j (drafting steps in
            # lockstep, so their fixed cost is shared: all requests together can pay where one alone cannot)
            cand = None
            for r in rids:
                old = ks[r]
                for j in range(old + 1, caps[r] + 1):
                    ks[r] = j
                    g = goodput(ks)
                    if g > best * (1 + 1e-3) and (cand is None or g > cand[1]):
                        cand = ({**ks}, g)
                ks[r] = old
            for j in range(1, max(caps.values()) + 1):
                kv = {r: max(ks[r], min(j, caps[r])) for r in rids}
                if kv != ks:
                    g = goodput(kv)
                    if g > best * (1 + 1e-3) and (cand is None or g > cand[1]):
                        cand = (kv, g)
            if cand is None:
                return ks, best
            ks, best = cand

    def _allocate_fast(self, rids, caps: dict[str, int], acc: dict[str, float], participation: Participation,
                       overlap: float, ahead: bool, scoring: float = 0.0) -> tuple[dict[str, int], float]:
        """`_allocate`'s greedy search, the same moves in the same order, for a participation's round model: there a
        plan's goodput depends on the draft lengths only through their sum, maximum, count above zero and the sum of
        expected tokens, so each move is priced from running totals instead of a pass over the plan (the search
        priced ~360 plans per round at batch 8, 6-8 ms of the loop's thread per round on this CPU)."""
        n, model, verify = participation.drafters_per_request, self.priced(participation), self.verify
        expected = {r: expected_row(acc[r], caps[r]) for r in rids}
        requests = len(rids)

        def rate(tokens: float, total_k: int, depth: int, drafting: int) -> float:
            t = verify(requests + n * total_k)
            if depth:
                t += max(0.0, model(depth + ahead, drafting) + scoring - overlap)
            return tokens / max(t, 1e-9)

        ks = {r: 0 for r in rids}
        tokens, total_k, drafting = float(sum(e[0] for e in expected.values())), 0, 0
        best = rate(tokens, 0, 0, 0)
        top_k = max(caps.values())
        while True:
            ordered = sorted(ks.values(), reverse=True)
            first, second = ordered[0], ordered[1] if requests > 1 else 0
            cand = None
            for r in rids:
                old, e = ks[r], expected[r]
                others_max = second if old == first else first
                for j in range(old + 1, caps[r] + 1):
                    g = rate(tokens - e[old] + e[j], total_k - old + j, max(others_max, j),
                             drafting - (old > 0) + 1)
                    if g > best * (1 + 1e-3) and (cand is None or g > cand[1]):
                        cand = ({**ks, r: j}, g)
            for j in range(1, top_k + 1):
                kv = {r: max(ks[r], min(j, caps[r])) for r in rids}
                if kv != ks:
                    g = rate(sum(expected[r][k] for r, k in kv.items()), sum(kv.values()), max(kv.values()),
                             sum(1 for k in kv.values() if k > 0))
                    if g > best * (1 + 1e-3) and (cand is None or g > cand[1]):
                        cand = (kv, g)
            if cand is None:
                return ks, best
            ks, best = cand
            tokens = sum(expected[r][k] for r, k in ks.items())
            total_k, drafting = sum(ks.values()), sum(1 for k in ks.values() if k > 0)
