"""Where drafting runs (`speculation.drafting_tier`), decided once, and the `auto` tier's chooser.

`resolve` turns the configured value into what the graph builds (the Speculation and drafter deployments: the
remote tier) and what the verifier's replica holds (the coordinator and drafters in process: the colocated tier);
serve_app/graph.py, deployments/verifier.py and the simulator all read it, nothing infers the layout again.

With `auto` the replica holds both, and `TierChooser` routes each drafting round to the tier that predicts more
goodput at the current load (requests in the verifier's pool):

    goodput(tier, n) = max over k of  n * E(a_tier, k) / T_round(tier, n, k)

E is the goodput controller's expected tokens per verification (speculation/goodput.py), a_tier the tier's
per-token acceptance, and T_round the verify step of n (1 + k) tokens plus what of the tier's drafting round
(depth k, n requests, hops included) is not hidden behind verification: nothing on the verifier's own hardware; on
hardware of its own, drafting ahead (vLLM) hides a round only where every chain of the step was accepted whole
(probability a^(k n)), and otherwise costs a fresh round after the one drafted ahead (k + 1 deep), which the loop
awaits (a round longer than the step delays the next), and the pipeline halves (the torch engine) hide it behind the other half's step. Each tier's
round time is measured, not assumed: fitted on its own rounds (`RoundLatency`, t = a + depth (b + c requests)),
each tier drafting in turn at startup until it has `WARMUP` measured rounds (or seeded from a startup profile,
`seed`), and a round on the tier not in use every `PROBE_EVERY` rounds as it runs (never a round drafted ahead; `FAR` times as seldom while it
predicts less than `1 - FAR_BELOW` of the goodput of the tier in use). A tier must predict `HYSTERESIS` more goodput
to replace the one in use.
The goodput controller prices its participations by the rounds of the tier in use only (a warm-up's or a probe's
round is marked unpriced, `DraftRequest.priced`).
Either tier's drafts are verified by the target, so the output is the target's whichever drafts; a request that
moves between tiers is re-synced from its committed context by the drafter engines (`DrafterEngine.sync`).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from config import AppConfig
from speculation.goodput import GoodputController
from speculation.latency import RoundLatency, expected_tokens
from speculation.messages import DraftRequest, DraftRound

COLOCATED, REMOTE = "colocated", "deployments"
TIERS = (COLOCATED, REMOTE)
VERIFIER_REMOTE = "remote"  # autoscaling signal: share of drafting rounds the chooser put on the remote tier
WARMUP = 8  # measured rounds of each tier before the chooser trusts its fit (two fits of RoundLatency)
PROBE_EVERY = 128  # rounds between two rounds on the tier not in use
FAR, FAR_BELOW = 4, 0.25
HYSTERESIS = 0.03

Overlap = Literal["none", "ahead", "pipelined"]


@dataclass(frozen=True)
class TierPlan:
    """What the configuration builds: `remote`, the Speculation and drafter deployments (the graph builds them and
    hands their handle to the verifier); `local`, the coordinator and drafters inside the verifier's replica."""

    remote: bool
    local: bool

    @property
    def auto(self) -> bool:
        return self.remote and self.local

    @property
    def fixed(self) -> str | None:
        """The one tier drafting, or None (auto, or no speculation)."""
        return None if self.auto or not (self.remote or self.local) else REMOTE if self.remote else COLOCATED


def resolve(cfg: AppConfig) -> TierPlan:
    if cfg.speculation.mode == "off":
        return TierPlan(remote=False, local=False)
    tier = cfg.speculation.drafting_tier
    return TierPlan(remote=tier in (REMOTE, "auto"), local=tier in (COLOCATED, "auto"))


# ------------------------------------------------------------------------------------------------ the prediction
@dataclass(frozen=True)
class TierCost:
    """One tier's drafting: a round of depth k for n requests in seconds (hops included), the per-token acceptance
    of its drafts, and how its drafting overlaps verification (`Overlap`)."""

    draft_s: Callable[[int, int], float]
    acceptance: float
    overlap: Overlap = "none"


def round_seconds(verify_s: Callable[[float], float], cost: TierCost, batch: int, k: int) -> float:
    """A verify step of `batch` requests drafted `k` deep, with the drafting it waits for."""
    verify = verify_s(batch * (1 + k))
    if k == 0:
        return verify
    draft = cost.draft_s(k, batch)
    if cost.overlap == "pipelined":
        return verify + max(0.0, draft - verify)
    if cost.overlap == "ahead":
        # the round drafted ahead starts with the step, one token deeper (k + 1: the target's bonus token comes
        # first), and holds the drafters until it ends (the loop awaits it before drafting afresh): a step whose
        # chains were not all accepted waits for it, then for a fresh round of k
        whole = min(max(cost.acceptance, 0.0), 0.999) ** (k * batch)
        return max(verify, cost.draft_s(k + 1, batch)) + (1 - whole) * draft
    return verify + draft


def predict(verify_s: Callable[[float], float], cost: TierCost, batch: int, k_max: int) -> tuple[float, int]:
    """(tokens per second, draft length) of the tier's best uniform draft length at `batch` requests."""
    best = (0.0, 0)
    for k in range(k_max + 1):
        g = batch * expected_tokens(cost.acceptance, k) / max(round_seconds(verify_s, cost, batch, k), 1e-9)
        if g > best[0] * (1 + 1e-9):
            best = (g, k)
    return best


def choose(verify_s: Callable[[float], float], costs: dict[str, TierCost], batch: int, k_max: int,
           held: str | None = None, hysteresis: float = HYSTERESIS) -> tuple[str, dict[str, tuple[float, int]]]:
    """The tier predicting the most goodput at `batch` requests (the `held` one unless another beats it by
    `hysteresis`), with every tier's (goodput, draft length)."""
    plans = {t: predict(verify_s, c, batch, k_max) for t, c in costs.items()}
    best = max(plans, key=lambda t: plans[t][0])
    if held in plans and plans[held][0] * (1 + hysteresis) >= plans[best][0]:
        best = held
    return best, plans


# ------------------------------------------------------------------------------------------------ the chooser
@dataclass
class TierChooser:
    """Per round, the tier to draft on, from each tier's measured rounds (`observe`), the verify step model and the
    acceptance the goodput controller measures; stateful only for warm-up, probes and hysteresis."""

    k_max: int
    overlap: dict[str, Overlap] = field(default_factory=lambda: {COLOCATED: "none", REMOTE: "ahead"})
    warmup: int = WARMUP
    probe_every: int = PROBE_EVERY
    hysteresis: float = HYSTERESIS
    rounds: dict[str, RoundLatency] = field(default_factory=lambda: {t: RoundLatency() for t in TIERS})
    measured: Counter = field(default_factory=Counter)  # rounds measured per tier
    picked: Counter = field(default_factory=Counter)  # rounds given to each tier (probes included)
    held: str | None = None
    since_probe: int = 0
    last: dict = field(default_factory=dict)  # the last prediction, for operators

    @classmethod
    def from_config(cls, cfg: AppConfig, remote_overlap: Overlap | None = None) -> TierChooser:
        """`remote_overlap`: how remote drafting overlaps verification (default: as the loop runs it with drafters
        on hardware of their own: ahead with vLLM where draft_ahead is on, pipelined halves with the torch engine)."""
        if remote_overlap is None:
            remote_overlap = ("ahead" if cfg.speculation.draft_ahead else "none") if cfg.verifier.engine == "vllm" \
                else "pipelined"
        return cls(k_max=cfg.speculation.k, overlap={COLOCATED: "none", REMOTE: remote_overlap})

    def observe(self, tier: str, depth: int, requests: int, seconds: float) -> None:
        """A drafting round of `tier` took `seconds` (a round that scored prompts is not its steady cost: skip it)."""
        if depth > 0:
            self.rounds[tier].observe(depth, requests, seconds)
            self.measured[tier] += 1

    def seed(self, tier: str, samples: list[tuple[int, int, float]]) -> None:
        """A startup profile of `tier`: (depth, requests, seconds) of rounds timed before serving."""
        for depth, requests, seconds in samples:
            self.observe(tier, depth, requests, seconds)
        self.rounds[tier].refit()
        self.measured[tier] = max(self.measured[tier], self.warmup)  # no warm-up rounds for a profiled tier

    def costs(self, acceptance: float | dict[str, float]) -> dict[str, TierCost]:
        acc = acceptance if isinstance(acceptance, dict) else {t: acceptance for t in TIERS}
        return {t: TierCost(self.rounds[t], acc[t], self.overlap[t]) for t in TIERS}

    def pick(self, batch: int, verify_s: Callable[[float], float], acceptance: float | dict[str, float],
             ahead: bool = False) -> str:
        """The tier for the next round at `batch` requests: while a tier has fewer than `warmup` measured rounds,
        the one with fewest (profiling); then the chooser's, the other tier once every `probe_every` rounds. A round
        drafted `ahead` (beside a verify step, while the remote tier is in use) stays on the tier in use."""
        cold = [t for t in TIERS if self.measured[t] < self.warmup]
        if ahead and self.held is not None:
            tier = self.held
            self.since_probe += 1
        elif cold:
            tier = min(cold, key=lambda t: (self.picked[t], TIERS.index(t)))
        elif verify_s(max(batch, 1)) <= 0:  # no verify step measured yet: the cheaper round
            tier = self.held = min(TIERS, key=lambda t: self.rounds[t](self.k_max, max(batch, 1)))
        else:
            self.held, plans = choose(verify_s, self.costs(acceptance), max(batch, 1), self.k_max, self.held,
                                      self.hysteresis)
            self.last = {"batch": batch, "goodput": {t: round(g, 2) for t, (g, _) in plans.items()},
                         "k": {t: k for t, (_, k) in plans.items()}}
            tier, other = self.held, next(t for t in TIERS if t != self.held)
            far = plans[other][0] < (1 - FAR_BELOW) * plans[self.held][0]
            self.since_probe += 1
            if self.since_probe >= self.probe_every * (FAR if far else 1):
                self.since_probe = 0
                tier = other
        self.picked[tier] += 1
        return tier

    def state(self) -> dict:
        return {"chosen": self.held, "rounds": dict(self.picked), "measured": dict(self.measured),
                "round_fit_ms": {t: [round(1000 * m.a, 3), round(1000 * m.b, 3), round(1000 * m.c, 3)]
                                 for t, m in self.rounds.items()},
                "overlap": dict(self.overlap), **({"predicted": self.last} if self.last else {})}


class AutoDraftingTier:
    """`VerifyLoop`'s drafting tier for `drafting_tier: auto`: the colocated tier and the remote one, each round on
    the tier `TierChooser` picks for the loop's current pool. Set `loop` (`attach`) before the first round: the
    chooser reads the goodput controller's verify model and acceptance, and the loop's
    `drafting_overlaps_verification` follows the tier in use. A remote round that brings no drafts (its drafters
    parked at zero replicas, or failing) is drafted on the colocated tier instead."""

    def __init__(self, local, remote, cfg: AppConfig):
        self.tiers = {COLOCATED: local, REMOTE: remote}
        self.chooser = TierChooser.from_config(cfg)
        self.loop = None
        self.remote_overlaps = True  # False where the remote drafters share the verifier's CPU (placement)
        self.seen: dict[str, set[str]] = {t: set() for t in TIERS}  # requests each tier has drafted for
        self.interval: Counter = Counter()  # rounds per tier wanted since the last `remote_share`

    def attach(self, loop) -> None:
        self.loop = loop
        self._follow(COLOCATED)

    def _follow(self, tier: str) -> None:
        if self.loop is not None:
            self.loop.drafting_overlaps_verification = tier == REMOTE and self.remote_overlaps

    def set_remote_overlaps(self, overlaps: bool) -> None:
        self.remote_overlaps = overlaps
        if not overlaps:
            self.chooser.overlap[REMOTE] = "none"
        self._follow(self.chooser.held or COLOCATED)

    def _model(self) -> tuple[Callable[[float], float], float]:
        c = self.loop.controller if self.loop is not None else None
        if not isinstance(c, GoodputController):  # config validation requires the goodput controller
            raise TypeError("drafting_tier auto needs the goodput controller")
        return c.verify, c.pool_acceptance if c.pool_acceptance is not None else c.prior_acceptance

    async def draft(self, batch: list[DraftRequest]) -> DraftRound:
        verify_s, acceptance = self._model()
        load = len(self.loop.requests) if self.loop is not None else len(batch)
        tier = self.chooser.pick(load, verify_s, acceptance, ahead=any(d.ahead for d in batch))
        self.interval[tier] += 1
        if tier != self.chooser.held:  # warm-up or a probe: the goodput controller prices the tier in use only
            for d in batch:
                d.priced = False
        got = await self._measured(tier, batch)
        if tier == REMOTE and not got.drafts:
            got = await self._measured(COLOCATED, batch)
        self._follow(self.chooser.held or COLOCATED)
        return got

    async def _measured(self, tier: str, batch: list[DraftRequest]) -> DraftRound:
        """A round on `tier`, its time observed (also when the loop stops waiting for it: then at least that long);
        a round that scored a prompt, drafted nothing or waited for a fault is not the tier's steady cost."""
        scored = any(d.request_id not in self.seen[tier] for d in batch)
        self.seen[tier].update(d.request_id for d in batch)
        t = time.perf_counter()
        try:
            got = await self.tiers[tier].draft(batch)
        except asyncio.CancelledError:
            self.chooser.observe(tier, max(d.k for d in batch), len(batch), time.perf_counter() - t)
            raise
        if got.drafts and not scored and not got.faulted:
            self.chooser.observe(tier, max(d.k for d in batch), len(batch), time.perf_counter() - t)
        return got

    def release(self, request_ids: list[str]) -> None:
        for tier, t in self.tiers.items():
            t.release(request_ids)
            self.seen[tier].difference_update(request_ids)

    def remote_share(self) -> float:
        """Share of rounds the chooser put on the remote tier since the last call (the autoscaler's signal); 1 before
        any round, so that the remote drafters keep their replicas until the chooser has measured them."""
        rounds, remote = sum(self.interval.values()), self.interval[REMOTE]
        self.interval = Counter()
        return remote / rounds if rounds else (0.0 if self.chooser.held == COLOCATED else 1.0)

    async def stats(self) -> dict:
        out = {"drafting_tier": self.chooser.state()}
        for tier, t in self.tiers.items():
            try:
                out[tier] = await t.stats()
            except Exception as e:  # noqa: BLE001 - one tier's stats must not hide the other's
                out[tier] = {"error": repr(e)}
        return out
