"""The one draft/verify loop: the service, `cosine generate` and the engine benchmark all run this class.

`VerifyLoop` owns a verifier engine's running batch (CoSine's request pool). `generate` registers a request and
yields a `TokenChunk` per verify step that committed tokens for it (the steps' chunks merged where several were
waiting for a busy consumer). One task repeats: admit, ask the drafting tier
for drafts for the step's requests (bounded by `draft_timeout_ms`; late or failed drafting means plain decoding
this step), verify them in a worker thread, hand the results to the requests' queues, and start drafting the next
round beside the next step. Which requests a step takes and which rounds run beside it (CoSine's pipeline halves,
drafting ahead) is `StepGrouping` (speculation/stepping.py), which the cluster simulator runs too.

The drafting tier is the only thing that differs between deployments: `DraftingTier.draft` is a call to the
Speculation deployment through a Serve handle in the service, and a local coordinator over in-process drafter
engines otherwise (assembly/). No Ray here.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import logging
import statistics
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import torch

from config import AppConfig
from engines.build import set_thread_torch_threads
from engines.device_work import WORK
from engines.interface import VerifierEngine
from engines.sampling import SamplingParams
from speculation.messages import Draft, DraftRequest, DraftRound, Participation, SpeculationOverrides, TokenChunk
from speculation.plain_steps import PlainSteps
from speculation.planner import DraftPlanner, draft_timeout_s
from speculation.stepping import StepGrouping, carried
from speculation.loop_stats import LoopStats
from speculation.trace import TraceRecorder

logger = logging.getLogger(__name__)


class DraftingTier(Protocol):
    async def draft(self, batch: list[DraftRequest]) -> DraftRound: ...

    def release(self, request_ids: list[str]) -> None:
        """Forget finished or aborted requests (drafters free their caches); must not block."""

    async def stats(self) -> dict:
        """The drafting tier's own timings and counters (for `speculation_stats`)."""


@dataclass
class _Request:
    """One request's state in the loop."""

    queue: asyncio.Queue
    overrides: SpeculationOverrides
    participation: Participation | None = None  # how its pending draft was made
    drafted: bool = False  # past its first round (which scores the prompt, so is not priced)
    routed: bool = False  # past its first round not on the generalist (where routing scores the prompt, late)
    answered: bool = False  # its first tokens delivered


class VerifyLoop:
    def __init__(self, engine: VerifierEngine, cfg: AppConfig, drafting: DraftingTier | None,
                 stats: LoopStats | None = None):
        self.engine = engine
        self.cfg = cfg
        self.drafting = drafting if cfg.speculation.mode != "off" else None
        self.stats = stats or LoopStats()
        self.planner = DraftPlanner(cfg)
        self.controller = self.planner.controller
        self.trace = TraceRecorder(cfg.speculation.record_trace) if cfg.speculation.record_trace else None
        self.drafting_overlaps_verification = True  # False where drafters share this CPU (set by the deployment)
        self.grouping = StepGrouping(engine.partial_steps)
        self.plain = PlainSteps(self)
        # verify steps run on a thread of their own with the torch threads of the thread that built the loop (the
        # deployment's count). OpenMP counts are per thread, and a thread started after an in-process drafter's
        # thread set its count (1) starts with that one: asyncio.to_thread's workers verified on one core of two
        # (measured: the engine bench's target-only steps took 46 ms against 23 ms for the same step on two)
        self._verify_thread = ThreadPoolExecutor(1, thread_name_prefix="verify", initializer=set_thread_torch_threads,
                                                 initargs=(torch.get_num_threads(),))
        self.requests: dict[str, _Request] = {}
        self._fresh: set[str] = set()  # requests whose prompt no step has fed yet
        # the next speculative step pays one-time costs (its round scored new prompts for routing, or drafters catch
        # up on the tokens committed while steps were plain): the guard leaves it out, as it leaves out prefills
        self._catching_up = False
        self._asked: set[str] = set()  # requests a drafting round was asked for since their last step
        self._held: list = []  # a verify step's outputs kept from their requests while the next round drafts
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.ids = itertools.count()
        self.task: asyncio.Task | None = None

    # ------------------------------------------------------------------ requests
    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
                       overrides: SpeculationOverrides | None = None) -> AsyncIterator[TokenChunk]:
        self._ensure_running()
        rid = request_id or f"v-{next(self.ids)}"
        req = _Request(asyncio.Queue(), overrides or SpeculationOverrides())
        self.requests[rid] = req
        self.grouping.join(rid)
        await self.inbox.put(("add", rid, prompt_ids, params))
        started, output, drafted, accepted = time.perf_counter(), [], 0, 0
        try:
            while True:
                chunk = await req.queue.get()
                if isinstance(chunk, Exception):
                    raise chunk
                # steps that committed while the consumer was busy go out as one chunk (through Serve, one message)
                while not chunk.finished and not req.queue.empty():
                    later = req.queue.get_nowait()
                    if isinstance(later, Exception):
                        req.queue.put_nowait(later)  # raised at the next read, after what came before it
                        break
                    chunk.extend(later)
                if self.trace:
                    output += chunk.token_ids
                    drafted, accepted = drafted + chunk.num_draft_tokens, accepted + chunk.num_accepted_tokens
                    if chunk.finished:
                        self.trace.request(rid, list(prompt_ids), output, started, time.perf_counter(), drafted,
                                           accepted)
                yield chunk
                if chunk.finished:
                    break
        finally:
            if rid in self.requests:  # cancelled or failed before finishing: abort everywhere
                self.requests.pop(rid, None)
                await self.inbox.put(("abort", rid, None, None))

    async def stop(self) -> None:
        """Stop the loop's task (requests still running are abandoned). Cancels until the task is done: on Python
        3.11 `asyncio.wait_for` drops a cancellation that arrives as its inner call completes (CPython gh-86296),
        and a task awaiting one (a drafting round) then runs on and idles forever; waiting on it hung stop()."""
        while self.task is not None and not self.task.done():
            self.task.cancel()
            await asyncio.wait({self.task}, timeout=1.0)

    def controller_state(self) -> dict | None:
        return self.planner.state(self.drafting_overlaps_verification)

    def failed(self) -> BaseException | None:
        if self.task is not None and self.task.done() and not self.task.cancelled():
            return self.task.exception()
        return None

    def _ensure_running(self) -> None:
        """Start the loop's task in a context of its own: a task copies its creator's context variables, and Ray
        Serve keeps the request in one, cancelling the calls made under a request when its client goes away; the
        loop's calls to the drafting tier serve every request, not the one that happened to start it."""
        if self.task is None or self.task.done():
            self.task = asyncio.get_running_loop().create_task(self._run(), context=contextvars.Context())

    async def _drain_inbox(self, block: bool) -> None:
        if block:
            self.deliver([])  # nothing to draft for: what was held reaches its requests
        released = []
        while block or not self.inbox.empty():
            kind, rid, prompt, params = await self.inbox.get()
            block = False
            if kind == "add":
                try:
                    if self.engine.drafts_itself and rid in self.requests:  # it takes the request's bound on drafts
                        o = self.requests[rid].overrides
                        self.engine.add_request(prompt, params, request_id=rid,
                                                max_draft_tokens=o.max_draft_tokens if o.enabled else 0)
                    else:
                        self.engine.add_request(prompt, params, request_id=rid)
                    self._fresh.add(rid)
                except ValueError as e:
                    self.grouping.leave(rid)
                    req = self.requests.pop(rid, None)
                    if req:
                        req.queue.put_nowait(e)
            else:
                self.engine.abort(rid)
                self.stats.totals["requests_aborted"] += 1
                released.append(rid)
        self._release(released)

    def _release(self, rids: list[str]) -> None:
        if not rids:
            return
        for r in rids:
            self.grouping.leave(r)
            self._fresh.discard(r)
            self._asked.discard(r)
            if self.controller:
                self.controller.release(r)
        if self.drafting is not None:
            self.drafting.release(rids)

    # ------------------------------------------------------------------ drafting
    def _speculating(self, rid: str) -> bool:
        req = self.requests.get(rid)
        return req is None or req.overrides.enabled

    async def _drafts(self, rids: list[str], ahead: dict[str, list[int]] | None = None) -> dict[str, Draft]:
        """Drafts for `rids`; {} (plain decoding) when late, failed or off. `ahead`: drafted during a verify step,
        from these contexts (each request's context and the chain being verified)."""
        if self.drafting is None or not rids:
            return {}
        overrides = {r: self.requests[r].overrides if r in self.requests else SpeculationOverrides() for r in rids}
        contexts = ahead or {r: self.engine.context(r) for r in rids}
        # drafted ahead, the round runs beside the step being verified
        overlap = (self.stats.verify_seconds[-1] if self.stats.verify_seconds else 0.0) if ahead else \
            self.grouping.overlap(rids, self.engine.running)
        unscored = frozenset(r for r in rids if r in self.requests and not self.requests[r].routed)
        batch = self.planner.plan(contexts, overrides, overlap, ahead=bool(ahead), unscored=unscored)
        self.stats.planned(self.planner.chosen, getattr(self.controller, "predicted_goodput", None))
        if not batch:
            return {}
        self._asked.update(d.request_id for d in batch)
        participations, scored = set(), 0
        for d in batch:
            req = self.requests.get(d.request_id)
            if req is not None:
                # the generalist's rounds leave the prompt unscored: the request's first routed round scores it
                first = not req.drafted or not (req.routed or d.participation.generalist)
                participations.add(None if first else d.participation)
                scored += len(d.context) if first else 0
                req.participation, req.drafted = d.participation, True
                self.stats.by_participation[d.participation] += 1
                req.routed |= not d.participation.generalist
        self._catching_up |= scored > 0
        t, work = time.perf_counter(), WORK.snapshot()
        try:
            recent = list(self.stats.verify_seconds)[-32:]
            timeout = draft_timeout_s(self.cfg.speculation, recent, scored > 0)
            verify_s = statistics.median(recent) if recent else None
            for d in batch:  # the coordinator ends its round in time for it, and prices its wait by the step's
                d.wait_s, d.verify_s = timeout, verify_s
            got = await asyncio.wait_for(self.drafting.draft(batch), timeout)
        except Exception as e:  # noqa: BLE001 - late or failed drafts: decode without them
            self.stats.draft_round(None)
            logger.warning("drafts unavailable this step (%r); decoding without them", e)
            return {}
        seconds, drafts = time.perf_counter() - t, got.drafts
        self.stats.draft_round(seconds)
        # the depth drafted, not asked for: a fused tree that reaches its node budget ends the round earlier
        self.stats.device_round(max((d.depth for d in drafts.values()), default=0), WORK.since(work))
        if self.trace:
            self.trace.draft(len(batch), max(d.k for d in batch), scored, seconds)
        self.planner.observe_round(batch, participations, seconds, got.faulted, scored)
        return drafts

    def _draft_ahead(self, drafts: dict[str, Draft]) -> tuple[dict[str, list[int]], asyncio.Task] | None:
        """Start drafting the next round while `drafts` are verified: from each request's context plus the chain
        the engine verifies (vLLM verifies chains), as if all of it were accepted (`StepGrouping.drafts_ahead`)."""
        if not self.grouping.drafts_ahead(self.cfg.speculation.draft_ahead, self.drafting is not None,
                                          self.drafting_overlaps_verification, drafts):
            return None
        bases = {r: self.engine.context(r) + self.engine.chain_of(d).tokens for r, d in drafts.items()}
        return bases, asyncio.get_running_loop().create_task(self._drafts(list(bases), ahead=bases))

    async def _carried(self, ahead: tuple[dict[str, list[int]], asyncio.Task]) -> dict[str, Draft]:
        """The drafts made ahead that still extend their request's context (`stepping.carried`)."""
        bases, task = ahead
        made = await task
        # requests that finished or were aborted while their round was drafted: the drafters made caches for them
        # after the release, so release them again
        self._release([r for r in bases if r not in self.engine.running])
        out = carried(bases, made, lambda r: self.engine.context(r) if r in self.engine.running else None)
        self.stats.ahead_round(len(bases), len(out))
        return out

    def _drop(self, ahead: tuple[dict[str, list[int]], asyncio.Task]) -> None:
        """A round drafted ahead for requests that all finished meanwhile: nothing in it is used, so the loop goes
        on (a request arriving now is prefilled without waiting for it: at concurrency 1 every request did); the
        caches the drafters made for it are released when it ends."""
        bases, task = ahead
        self.stats.ahead_round(len(bases), 0)
        task.add_done_callback(lambda _: self._release(list(bases)))

    # ------------------------------------------------------------------ the loop
    async def _run(self) -> None:
        """The loop's task. Should it fail, its requests fail with it rather than wait for chunks that will never
        come (the next request starts a new task)."""
        try:
            await self._steps()
        except BaseException as e:  # cancelled too: its requests must not wait for chunks that will never come
            stopped = isinstance(e, asyncio.CancelledError)
            if not stopped:
                logger.exception("the verify loop failed")
            for req in self.requests.values():
                req.queue.put_nowait(RuntimeError(f"the verify loop {'stopped' if stopped else 'failed'}: {e!r}"))
            raise

    async def _steps(self) -> None:
        """The steps, grouped as `StepGrouping` says: pipelined, one half is verified (in a worker thread) while the
        other half's drafts are produced by the drafting tier; else the whole pool in one step, its next round
        drafted ahead meanwhile (`_draft_ahead`)."""
        pending: dict[int, asyncio.Task] = {}  # per half: its next round, drafted while the other half is verified
        ahead = None
        last_end = None
        while True:
            if self.plain.ahead is not None:  # a plain step in flight: its outputs before the engine is touched
                self.stats.step_intervals.append(0.0)  # it started as the step before it ended
                last_end = await self.plain.step(last_end or time.perf_counter())
                continue
            if ahead is not None and not self.engine.has_unfinished():  # its requests all finished
                self._drop(ahead)
                ahead = None
            idle = not self.engine.has_unfinished()
            await self._drain_inbox(block=idle)
            if idle:
                last_end = None  # idle time is not loop overhead
            if not self.engine.has_unfinished():
                pending.clear()
                continue
            self.engine.admit()
            t = time.perf_counter()
            # the step's wall time (for the hill climber) runs from the last step's end, or from now after idling
            since = t if last_end is None else last_end
            if ahead is None and not pending and self.plain.applies():  # no request may draft: the engine's step
                if last_end is not None:
                    self.stats.step_intervals.append(t - last_end)
                last_end = await self.plain.step(since)
                continue
            members = self.grouping.members(self.engine.running, self.drafting is not None,
                                            self.drafting_overlaps_verification, self._speculating)
            if self.grouping.pipelined:
                task = pending.pop(self.grouping.turn, None)
                drafts = await task if task is not None else await self._drafts(members)
            else:  # the whole pool in one verify step, drafted first (drafts started while pipelining still count)
                drafts = {}
                for task in pending.values():
                    drafts.update(await task)
                pending.clear()
                if ahead is not None:
                    drafts.update(await self._carried(ahead))
                    ahead = None
                drafts.update(await self._drafts([r for r in self.engine.draftable() if r not in drafts]))
            drafts = {r: d for r, d in drafts.items() if r in self.engine.running}
            self.deliver([])  # the last step's tokens reach their clients while this step verifies
            wait = time.perf_counter() - t
            self.stats.draft_wait(wait)
            t = time.perf_counter()
            if last_end is not None:
                self.stats.step_intervals.append(t - last_end)
            ahead = self._draft_ahead(drafts)
            work = WORK.snapshot()
            try:
                outs = await self.submit_step(drafts, set(members))
            except Exception as e:  # noqa: BLE001 - an engine failure fails the requests in it, not the loop
                logger.exception("verify step failed")
                self.fail(members, e)
                continue
            last_end = time.perf_counter()
            self.stats.device_step(WORK.since(work))
            seconds, turn = last_end - t, self.grouping.turn
            self.stats.verify_step(seconds, drafts, outs, len(self.requests))
            asked = bool(drafts) or any(r in self._asked for r in members)
            prefill = self._catching_up or any(o.request_id in self._fresh for o in outs)
            self._catching_up = False
            self._asked.difference_update(members)
            self._fresh.difference_update(o.request_id for o in outs)
            self.planner.observe_committed(len(outs), sum(len(o.new_token_ids) for o in outs), last_end - since,
                                           asked, prefill)
            if self.trace:
                self.trace.step(last_end, len(members), self.engine.last_step_tokens, seconds, wait, len(drafts))
            self._dispatch(outs, last_end - since)
            nxt = self.grouping.verified(seconds, self.engine.running)
            if nxt:  # this half's next drafts are produced while the other half is verified
                pending[turn] = asyncio.get_running_loop().create_task(self._drafts(nxt))

    @property
    def step_thread(self) -> ThreadPoolExecutor:
        """The thread verify steps run on: the engine's own (`step_executor`), else the loop's verify thread."""
        return self.engine.step_executor or self._verify_thread

    def submit_step(self, drafts: dict, only: set[str] | None) -> asyncio.Future:
        """The engine's step on `step_thread`."""
        return asyncio.wrap_future(self.step_thread.submit(self.engine.step, drafts, only))

    def fail(self, rids: list[str], error: Exception) -> None:
        """A verify step over `rids` failed: they fail with it (aborted everywhere), the loop goes on."""
        for rid in rids:
            self.engine.abort(rid)
            req = self.requests.pop(rid, None)
            if req:
                req.queue.put_nowait(RuntimeError(f"verification failed: {error}"))
        self._release(rids)

    def _dispatch(self, outs, wall_s: float) -> None:
        """A verify step's outputs to the planner with the step's wall time `wall_s`, then to their requests."""
        self.planner.observe_step(self.engine.last_step_tokens, self.engine.last_verify_seconds, wall_s)
        for o in outs:
            req = self.requests.get(o.request_id)
            self.planner.observe_acceptance(o.request_id, o.draft_depth, o.num_accepted_tokens,
                                            req.participation if req else None)
            if self.trace:
                self.trace.verified(o.request_id, o.draft_depth, o.num_accepted_tokens)
        if self.drafting is not None and not self.drafting_overlaps_verification:
            # drafters share this CPU: the next round drafts before the requests' readers (a server's streaming,
            # detokenizing, HTTP) wake, so that they run beside the verify step after it and not beside the
            # drafters' small forwards, which stall on every core taken from them (served on the 2-core CPU, a
            # drafter forward took 1.6-1.8x its in-process time). A request's first tokens go at once:
            # its first round scores the prompt for routing, which would add to its time to first token
            first, held = [], []
            for o in outs:
                (held if (r := self.requests.get(o.request_id)) is not None and r.answered else first).append(o)
            self._held += held
            # the finished ones' drafter caches are freed now, for the next round's new requests
            self._release([o.request_id for o in held if o.finished])
            self._put(first)
        else:
            self.deliver(outs)

    def deliver(self, outs) -> None:
        """A verify step's outputs, after those held back (`_dispatch`, released there), to their requests' queues."""
        held, self._held = self._held, []
        self._put(held, release=False)
        self._put(outs)

    def _put(self, outs, release: bool = True) -> None:
        """Outputs to their requests' queues; finished requests released (`release`)."""
        finished = []
        for o in outs:
            req = self.requests.get(o.request_id)
            chunk = TokenChunk(o.new_token_ids, o.finished, o.finish_reason, o.num_draft_tokens,
                               o.num_accepted_tokens, o.accepted_drafters, logprobs=o.logprobs,
                               prompt_logprobs=o.prompt_logprobs)
            if o.finished:
                finished.append(o.request_id)
                chunk.usage = self.engine.finished_stats(o.request_id) or {}
            if req is not None:
                req.answered |= bool(o.new_token_ids)
                req.queue.put_nowait(chunk)
                if o.finished:
                    self.requests.pop(o.request_id, None)
        if release:
            self._release(finished)
