"""The simulated cluster: a verifier (continuous batching, CoSine's pipeline halves or whole-batch steps), drafter
replicas on GPUs behind network hops, and the drafter autoscaler, on simpy's clock. This module holds the run
(`Simulation`: its workload's arrivals, the verify loop, the drafting rounds' planning); fleet.py the drafter
replicas and the autoscaler; result.py what a run returns.

What decides is the project's own code, driven as the service drives it: `StepGrouping` (which requests each verify
step takes and which drafting rounds run beside it: CoSine's pipeline halves, drafting ahead, as speculation/loop.py
groups its steps), `DraftPlanner` (the goodput controller, participation, Gamma_max), `SpeculationCoordinator`
(routing with its cold start and feedback, lockstep or one-shot fusion, tree budget) over the replayed drafters
(replay.py), the engines' greedy verification rule, and the autoscaler's `ReplicaPlanner` fed the signals the
replicas would report. What is modelled: time (hardware.py),
queueing at the drafter GPUs and the verifier, and replicas' start-up. Not modelled: KV-cache limits beyond
max_batch, a rehomed request's cache rebuild on its new drafter replica, stragglers and failures.
"""

from __future__ import annotations

import asyncio
import random
from collections import defaultdict, deque
from dataclasses import dataclass

import simpy

from autoscale.policy import VerifierLoad
from config import AppConfig
from speculation.coordinator import SpeculationCoordinator
from speculation.messages import SpeculationOverrides
from speculation.planner import DraftPlanner, draft_timeout_s
from speculation.stepping import StepGrouping, carried
from speculation.tiers import COLOCATED, REMOTE, TierChooser, resolve
from simulate.fleet import Autoscaling, DrafterFleet
from simulate.hardware import Hardware
from simulate.replay import Replayer, ReplayRequest, ReplayState
from simulate.result import Finished, Result


@dataclass
class Workload:
    """closed: `concurrency` clients, each sending its next request when the last one finished, `count` in all;
    offline: `count` requests at time 0; poisson: arrivals at `rate` (or a piecewise rate [(until_s, rate)...])
    for `duration` s. Requests are drawn from the replayed ones, in order for closed/offline when `count` fits."""

    kind: str = "closed"
    count: int = 12
    concurrency: int = 1
    rate: float | list[tuple[float, float]] = 1.0
    duration: float = 60.0
    seed: int = 0
    prompt_tokens: int | None = None  # prefill cost per request (the paper's 256), else the prompt's length

    def rate_at(self, t: float) -> float:
        if isinstance(self.rate, (int, float)):
            return float(self.rate)
        return next((r for until, r in self.rate if t < until), self.rate[-1][1])


class Simulation:
    """One run of one configuration (`cfg`: the same AppConfig the service takes) on `hw`."""

    def __init__(self, cfg: AppConfig, hw: Hardware, requests: list[ReplayRequest],
                 replicas: int = 1, drafter_gpus: int | None = None, colocated: bool = False,
                 autoscaling: Autoscaling | None = None):
        """`replicas`: per drafter deployment at the start, placed round-robin on `drafter_gpus` GPUs (default:
        one GPU each); `colocated`: drafters run on the verifier's GPUs (vanilla speculation; so does
        `speculation.drafting_tier: colocated`, and `auto` picks per round, speculation/tiers.py)."""
        self.cfg, self.hw, self.requests = cfg, hw, requests
        plan = resolve(cfg)
        self.colocated = colocated or plan.fixed == COLOCATED
        # `auto`: each round on the tier the chooser picks (its rounds measured here, as the verifier measures them)
        self.tiers = TierChooser.from_config(cfg) if plan.auto and not colocated and hw.draft_round is None else None
        if self.tiers is not None:
            self._profile(cfg, hw)
        self.tier_rounds: dict[str, int] = defaultdict(int)
        # the torch engine may verify part of its pool in a step (pipeline halves); vLLM steps it whole
        self.grouping = StepGrouping(partial_steps=cfg.verifier.engine == "torch")
        self.own_hardware = cfg.speculation.mode != "off" and not self.colocated and hw.draft_round is None
        self.autoscaling = autoscaling
        self.env = simpy.Environment()
        self.verifier = simpy.Resource(self.env, 1)
        self.replayer = Replayer()
        self.planner = DraftPlanner(cfg)
        self.coordinator = SpeculationCoordinator.from_config(cfg) if cfg.speculation.mode != "off" else None
        self.aio = asyncio.new_event_loop()
        uses_drafters = self.coordinator is not None and not self.colocated and hw.draft_round is None
        self.fleet = DrafterFleet(self.env, hw, self.verifier, [d.name for d in cfg.drafters], replicas, drafter_gpus,
                                  metered=uses_drafters)
        # request pool
        self.queue: list[ReplayState] = []
        self.running: dict[str, ReplayState] = {}
        self.prefill: set[str] = set()
        self.drafted: set[str] = set()
        self.participation: dict = {}  # how each request's last draft was made
        self.ahead_counts = [0, 0]  # drafts made ahead, and of them still extending their context after the step
        self.on_finish = None
        self.arrived: dict[str, float] = {}
        self.first: dict[str, float] = {}
        self.started: dict[str, float] = {}
        self.finished: list[Finished] = []
        self.wakeup = self.env.event()
        self.last_verify = 0.0  # the last step's
        self.verify_recent: deque = deque(maxlen=32)  # the recent steps' (for the loop's draft timeout)
        self.steps = self.step_tokens = 0
        self.signals = defaultdict(float)  # the verifier's autoscaling signals since the last period
        self.done = self.env.event()
        self.expected = 0
        self.prompt_tokens: int | None = None

    def _profile(self, cfg: AppConfig, hw: Hardware) -> None:
        """`auto`'s startup profile of both tiers: a round of each depth for one to max_batch requests, each request
        drafting with routing.drafters_per_request drafters spread over the configured ones: one after another on
        the verifier's GPUs, in parallel behind a hop on the drafters'."""
        per, names = cfg.routing.drafters_per_request if cfg.speculation.mode == "cosine" else 1, len(cfg.drafters)

        def colocated(n: int) -> float:
            used = min(n * per, names)
            return used * hw.colocated_draft(n * per / used)

        def remote(n: int) -> float:
            return hw.hop_ms / 1000 + hw.draft(n * per / min(n * per, names))

        b = cfg.verifier.max_batch
        for tier, step in ((COLOCATED, colocated), (REMOTE, remote)):
            self.tiers.seed(tier, [(k, n, k * step(n)) for k in range(1, cfg.speculation.k + 1)
                                   for n in sorted({1, max(1, b // 2), b})])

    # ------------------------------------------------------------------ requests
    def _arrive(self, req: ReplayRequest, tag: str):
        """A request sent now; it reaches the verifier's queue half the request overhead later."""
        rid = f"{req.rid}#{tag}"
        st = ReplayState(ReplayRequest(rid, req.prompt, req.output, req.preds, req.domain))
        self.arrived[rid] = self.env.now
        yield self.env.timeout(self.hw.request_overhead_ms / 2000)
        self.replayer.states[rid] = st
        self.queue.append(st)
        self.grouping.join(rid)
        if not self.wakeup.triggered:
            self.wakeup.succeed()

    def _send(self, req: ReplayRequest, tag: str) -> None:
        self.env.process(self._arrive(req, tag))

    def _finish(self, rid: str):
        """The response reaches its client half the request overhead after the last token."""
        st = self.replayer.states.pop(rid)
        self.grouping.leave(rid)
        if self.planner.controller:
            self.planner.controller.release(rid)
        if self.coordinator:
            self.coordinator.release(rid)
        self.fleet.release(rid)
        half = self.hw.request_overhead_ms / 2000
        yield self.env.timeout(half)
        self.finished.append(Finished(rid, st.output, self.arrived.pop(rid), self.started.pop(rid),
                                      self.first.pop(rid) + half, self.env.now, st.committed, st.passes, st.rounds,
                                      st.accepted))
        if self.on_finish:
            self.on_finish()
        if len(self.finished) >= self.expected and not self.done.triggered:
            self.done.succeed()

    def _workload(self, w: Workload):
        rng = random.Random(w.seed)
        pick = (lambda i: self.requests[i % len(self.requests)]) if w.kind != "poisson" else (
            lambda i: rng.choice(self.requests))
        self.on_finish = None
        if w.kind == "offline":
            self.expected = w.count
            for i in range(w.count):
                self._send(pick(i), str(i))
        elif w.kind == "closed":
            self.expected = w.count
            sent = iter(range(w.count))

            def next_one():
                i = next(sent, None)
                if i is not None:
                    self._send(pick(i), str(i))

            self.on_finish = next_one
            for _ in range(min(w.concurrency, w.count)):
                next_one()
        else:
            self.expected, i = float("inf"), 0
            while self.env.now < w.duration:
                yield self.env.timeout(rng.expovariate(max(w.rate_at(self.env.now), 1e-9)))
                if self.env.now < w.duration:
                    self._send(pick(i), str(i))
                    i += 1
            self.expected = i
            if len(self.finished) >= i and not self.done.triggered:
                self.done.succeed()
        yield self.env.timeout(0)

    # ------------------------------------------------------------------ the verifier loop
    def _admit(self) -> int:
        """Queued requests into the running pool, up to max_batch; how many joined."""
        joined = 0
        while self.queue and len(self.running) < self.cfg.verifier.max_batch:
            st = self.queue.pop(0)
            self.running[st.req.rid] = st
            self.prefill.add(st.req.rid)
            self.started[st.req.rid] = self.env.now
            joined += 1
        return joined

    def _overlaps(self) -> bool:
        """The loop's `drafting_overlaps_verification`: drafting on hardware of its own (`auto`: while the remote
        tier is held, as AutoDraftingTier sets it)."""
        return self.own_hardware and (self.tiers is None or self.tiers.held == REMOTE)

    def _plan(self, contexts: dict[str, list[int]], overlap: float, ahead: bool = False):
        """Plan and replay one drafting round (instantly); returns (drafts, the round's batch, how it drafted)."""
        batch = self.planner.plan(contexts, {r: SpeculationOverrides() for r in contexts}, overlap_s=overlap,
                                  ahead=ahead)
        if not ahead:
            self.signals["rounds"] += len(contexts)
            self.signals["speculated"] += len(batch)
        participations = set()
        for d in batch:  # a request's first round scores its prompt: it says nothing of its participation's cost
            participations.add(d.participation if d.request_id in self.drafted else None)
            self.drafted.add(d.request_id)
            self.participation[d.request_id] = d.participation
        if not batch:
            return {}, batch, participations
        self.replayer.start_round(batch)
        got = self.aio.run_until_complete(self.coordinator.draft(batch, self.replayer.step_fn))
        return got.drafts, batch, participations

    def _round(self, contexts: dict[str, list[int]], overlap: float, ahead: bool = False):
        """A drafting round in simulated time: its drafts, or none if they come later than draft_timeout_ms (the
        loop stops waiting then and decodes without them; the drafters finish their calls regardless)."""
        scored = sum(len(c) for r, c in contexts.items() if r not in self.drafted)
        drafts, batch, participations = self._plan(contexts, overlap, ahead)
        if not batch:
            return {}
        colocated, tier = self.colocated, None
        if self.tiers is not None:
            c = self.planner.controller
            tier = self.tiers.pick(len(self.running), c.verify,
                                   c.pool_acceptance if c.pool_acceptance is not None else c.prior_acceptance, ahead)
            self.tier_rounds[tier] += 1
            self.signals["tier_rounds"] += 1
            self.signals["remote_rounds"] += tier == REMOTE
            colocated = tier == COLOCATED
        t0 = self.env.now
        drafting = self.env.process(self.fleet.drafting(batch, scored, list(self.replayer.calls), colocated))
        yield drafting | self.env.timeout(draft_timeout_s(self.cfg.speculation, self.verify_recent, scored > 0))
        if tier is not None and not scored:  # as the verifier's auto tier: late rounds count at least that long
            self.tiers.observe(tier, max(d.k for d in batch), len(batch), self.env.now - t0)
        if not drafting.triggered:
            return {}
        if tier is None or tier == self.tiers.held:  # the controller prices the tier in use (warm-up, probes: not)
            self.planner.observe_round(batch, participations, self.env.now - t0)
        return drafts

    def _contexts(self, rids) -> dict[str, list[int]]:
        return {r: self.running[r].context for r in rids}

    def _carried(self, ahead):
        """Waits for a round drafted ahead; its drafts that still extend their context (`stepping.carried`)."""
        bases, proc = ahead
        made = yield proc
        out = carried(bases, made, lambda r: self.running[r].context if r in self.running else None)
        self.ahead_counts[0] += len(bases)
        self.ahead_counts[1] += len(out)
        return out

    def _verified(self, members: list[str], drafts: dict) -> tuple[int, bool]:
        """The step's verification replayed for its members (their first token, if it prefilled them; the
        controller's acceptance observations; the finished ones leave): the tokens it committed, and whether it
        prefilled a request."""
        committed, prefilled = 0, False
        for rid in members:
            st = self.running[rid]
            if rid in self.prefill:
                self.prefill.discard(rid)
                self.first[rid] = self.env.now
                prefilled = True
            _, accepted, depth = self.replayer.verify(rid, drafts.get(rid))
            committed += 1 + accepted
            self.planner.observe_acceptance(rid, depth, accepted, self.participation.get(rid))
            if st.done:
                del self.running[rid]
                self.env.process(self._finish(rid))
        return committed, prefilled

    def _steps(self):
        """The verify loop as speculation/loop.py runs it: `StepGrouping` groups the steps and starts the drafting
        beside them; simpy processes stand for the loop's tasks, and hardware.py's costs for its clock."""
        vllm = self.cfg.verifier.engine == "vllm"
        drafting = self.coordinator is not None
        pending: dict[int, simpy.Process] = {}  # per half: its next round, drafted while the other half is verified
        ahead = None  # (bases, the drafting process) started beside the last verify step
        last_end = None
        while True:
            if ahead is not None and not self.running:  # settle it before idling
                yield from self._carried(ahead)
                ahead = None
            joined = self._admit()
            if not self.running:
                pending.clear()
                last_end = None  # idle time is not loop overhead
                if self.wakeup.triggered:
                    self.wakeup = self.env.event()
                yield self.wakeup
                continue
            if joined and self.hw.admit_ms:  # the loop admits (and the torch engine prefills) before drafting
                with self.verifier.request() as turn:
                    yield turn
                    yield self.env.timeout(self.hw.admit_ms * joined / 1000)
            t0 = self.env.now
            since = t0 if last_end is None else last_end
            members = self.grouping.members(self.running, drafting, self._overlaps(), lambda r: True)
            if self.grouping.pipelined:
                proc = pending.pop(self.grouping.turn, None)
                drafts = (yield proc) if proc is not None else (yield from self._round(
                    self._contexts(members), self.grouping.overlap(members, self.running)))
            else:  # the whole pool in one verify step, drafted first (drafts started while pipelining still count)
                drafts = {}
                for proc in pending.values():
                    drafts.update((yield proc))
                pending.clear()
                if ahead is not None:
                    drafts.update((yield from self._carried(ahead)))
                    ahead = None
                if drafting:  # a new request drafts from its prompt: its first step prefills and verifies
                    rest = [r for r in self.running if r not in drafts]
                    drafts.update((yield from self._round(self._contexts(rest), self.grouping.overlap(
                        rest, self.running))))
            drafts = {r: d for r, d in drafts.items() if r in self.running}
            self.signals["draft_wait_s"] += self.env.now - t0
            if vllm:
                drafts = {r: d.best_chain().truncated(self.cfg.speculation.k) for r, d in drafts.items()}
            prompt = sum(self.prompt_tokens or len(self.running[r].req.prompt) for r in members if r in self.prefill)
            tokens = prompt + sum(1 + len(drafts[r]) if r in drafts else 1 for r in members)
            # `auto` may have changed tiers in this step's round
            if self.grouping.drafts_ahead(self.cfg.speculation.draft_ahead, drafting, self._overlaps(), drafts):
                bases = {r: self.running[r].context + d.tokens for r, d in drafts.items()}
                ahead = bases, self.env.process(self._round(bases, self.last_verify, ahead=True))
            with self.verifier.request() as turn:
                yield turn
                seconds = self.hw.verify(tokens)
                yield self.env.timeout(seconds + self.hw.loop_overhead_ms / 1000)
            self.last_verify = seconds
            self.verify_recent.append(seconds)
            self.steps += 1
            self.step_tokens += tokens
            self.planner.observe_step(tokens, seconds, self.env.now - since)
            wall, last_end = self.env.now - since, self.env.now
            committed, prefilled = self._verified(members, drafts)
            self.planner.observe_committed(len(members), committed, wall, drafting and bool(drafts), prefilled)
            turn = self.grouping.turn
            nxt = self.grouping.verified(seconds, self.running)
            if nxt:  # this half's next drafts are produced while the other half is verified
                pending[turn] = self.env.process(self._round(self._contexts(nxt),
                                                             self.grouping.overlap(nxt, self.running)))

    def _verifier_load(self, period_s: float) -> VerifierLoad:
        """What the verifier reports to the autoscaler over the last `period_s`; its signals start afresh."""
        s = self.signals
        self.signals = defaultdict(float)
        return VerifierLoad(s["draft_wait_s"] / period_s, s["speculated"] / s["rounds"] if s["rounds"] else 1.0,
                            s["rounds"] / period_s,
                            remote=s["remote_rounds"] / s["tier_rounds"] if s["tier_rounds"] else None,
                            requests=float(len(self.running)))

    # ------------------------------------------------------------------ run
    def run(self, workload: Workload, limit_s: float = 36000.0) -> Result:
        self.prompt_tokens = workload.prompt_tokens
        self.env.process(self._workload(workload))
        self.env.process(self._steps())
        if self.autoscaling is not None:
            self.env.process(self.fleet.autoscaler(self.autoscaling, self._verifier_load))
        self.env.run(until=simpy.AnyOf(self.env, [self.done, self.env.timeout(limit_s)]))
        self.fleet.meter()
        makespan = max((f.end for f in self.finished), default=self.env.now) - min(
            (f.arrival for f in self.finished), default=0.0)
        self.aio.close()
        return Result(self.finished, makespan, self.steps, self.step_tokens, self.fleet.gpu_seconds,
                      self.hw.cost(self.env.now, self.fleet.gpu_seconds), self.fleet.log, tuple(self.ahead_counts),
                      dict(self.tier_rounds))
