"""The verifier deployment: owns the running batch (CoSine's request pool) and the draft/verify loop.

Requests arrive through `generate`, a streaming method: it registers the request with the loop and yields
committed tokens as they come. The loop, one per replica, repeats: ask the speculation cluster for drafts for
every running request (bounded by `draft_timeout_ms`; late or failed drafting means plain decoding this step),
run one verify step of the engine in a worker thread, and hand the results to the requests' queues. Drafting for
the next step starts as soon as a step's results are known, overlapping with the streaming of this one.
A client that disconnects cancels its generator, which aborts the request and releases its caches everywhere.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field

from ray import serve

from engines.draft import Draft
from engines.sampling import SamplingParams

logger = logging.getLogger("ray.serve")


@dataclass
class _Live:
    queue: asyncio.Queue
    params: SamplingParams
    prompt_len: int
    speculation: dict = field(default_factory=dict)  # per-request override (see serve_app.protocol)
    generated: int = 0
    started: float = field(default_factory=time.perf_counter)


def draft_from_dict(d: dict) -> Draft:
    return Draft(d["tokens"], d["parents"], None, d.get("drafters"), d.get("probs"))


def draft_to_dict(d: Draft) -> dict:
    return {"tokens": d.tokens, "parents": d.parents, "drafters": d.drafters, "probs": d.probs}


@serve.deployment(name="Verifier")
class VerifierDeployment:
    def __init__(self, config: dict, speculation=None):
        from speculation.goodput import Participation, SpeculationController
        from config import AppConfig
        from engines.build import build_verifier_engine

        self.cfg = AppConfig.model_validate(config)
        self.engine = build_verifier_engine(self.cfg)
        self.speculation = speculation  # handle to the Speculation deployment, or None
        spec = self.cfg.speculation
        # a multi-drafter round verifies up to drafters_per_request nodes per depth (the chain and its branches)
        per_depth = self.cfg.routing.drafters_per_request if spec.mode == "cosine" else 1
        # participation modes the controller picks from each round: one drafter, or n drafters fused in lockstep
        # (when fusion is on) or one-shot; drafting is priced per mode from the rounds this replica observes
        modes = ()
        if spec.adaptive_drafters and per_depth > 1:
            modes = (Participation(1),) + tuple(Participation(n, lockstep)
                                                 for lockstep in ((True, False) if spec.fusion else (False,))
                                                 for n in range(2, per_depth + 1))
        self.controller = SpeculationController(k_max=spec.k, drafters_per_request=per_depth, parallel_groups=True,
                                                modes=modes) if spec.adaptive else None
        self.half_verify_s = [0.0, 0.0]  # last verify step time of each pipeline half
        self.shared_cpu: list[str] | None = None  # drafters computing on this replica's CPU (see _check_placement)
        self.modes: dict[str, object] = {}  # the Participation each request's pending draft was made with
        self.drafted: set[str] = set()  # requests past their first round (which scores the prompt: not priced)
        self.live: dict[str, _Live] = {}
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.aborts: set[str] = set()
        self.ids = itertools.count()
        self.arrivals = itertools.count()
        self.loop_task: asyncio.Task | None = None
        self.group: dict[str, int] = {}  # pipeline half of each request
        self.metrics = _Metrics()

    # ------------------------------------------------------------------ API
    async def generate(self, prompt_ids: list[int], params: dict, request_id: str | None = None,
                       speculation: dict | None = None):
        """Yields {"token_ids": [...], "finished": bool, "finish_reason", "usage"?} chunks."""
        self._ensure_loop()
        rid = request_id or f"v-{next(self.ids)}"
        sp = SamplingParams(**params)
        live = _Live(asyncio.Queue(), sp, len(prompt_ids), speculation or {})
        self.live[rid] = live
        self.group[rid] = next(self.arrivals) % 2
        await self.inbox.put(("add", rid, prompt_ids, sp))
        try:
            while True:
                chunk = await live.queue.get()
                if isinstance(chunk, Exception):
                    raise chunk
                yield chunk
                if chunk["finished"]:
                    break
        finally:
            if rid in self.live:  # cancelled or failed before finishing: abort everywhere
                self.live.pop(rid, None)
                await self.inbox.put(("abort", rid, None, None))

    def running(self) -> int:
        return len(self.live)

    async def speculation_stats(self) -> dict:
        """Timings of the draft/verify loop and of the speculation rounds (for `cosine bench serve`)."""
        m = self.metrics
        out = {"verify_steps": len(m.verify_seconds), "draft_fallbacks": m.draft_failures,
               "verify_ms_recent": 1000 * sum(m.verify_seconds) / max(1, len(m.verify_seconds)),
               "draft_round_ms_recent": 1000 * sum(m.draft_seconds) / max(1, len(m.draft_seconds))}
        c = self.controller
        if c is not None:
            ks = list(m.draft_lengths)
            out["controller"] = {"mean_k_recent": sum(ks) / max(1, len(ks)), "zero_k_share": ks.count(0) / max(1, len(ks)),
                                 "verify_fit_ms": [1000 * c.verify.a, 1000 * c.verify.b],
                                 "draft_round_fit_ms": {str(p): [1000 * m.a, 1000 * m.b]
                                                        for p, m in c.mode_draft.items()},
                                 "pool_acceptance": c.pool_acceptance,
                                 "drafting_overlaps_verification": not self.shared_cpu,
                                 "participation": str(c.mode) if c.mode else None,
                                 "acceptance_by_participation": {str(p): c.mode_acceptance(p) for p in c.mode_counts}}
        if self.speculation is not None:
            out.update(await self.speculation.stats.remote())
        return out

    def check_health(self) -> None:
        if self.loop_task is not None and self.loop_task.done() and self.loop_task.exception():
            raise RuntimeError(f"verify loop died: {self.loop_task.exception()!r}")

    # ------------------------------------------------------------------ the loop
    def _ensure_loop(self) -> None:
        if self.loop_task is None or self.loop_task.done():
            loop = asyncio.get_running_loop()
            self.loop_task = loop.create_task(self._loop())
            if self.shared_cpu is None and self.speculation is not None:
                loop.create_task(self._check_placement())

    async def _check_placement(self) -> None:
        """Drafting only overlaps verification where it has hardware of its own. Drafters on this node's CPU, next
        to a CPU verifier (the one-machine configuration), take their cycles from verification: for them the
        controller counts drafting time in full."""
        import ray

        try:
            drafters = await self.speculation.placement.remote()
        except Exception:  # noqa: BLE001 - unknown placement: assume separate hardware, as in a cluster
            logger.warning("drafter placement unknown; assuming drafting overlaps verification")
            self.shared_cpu = []
            return
        node, device = ray.get_runtime_context().get_node_id(), self.engine.runner.device.type
        self.shared_cpu = sorted(n for n, p in drafters.items()
                                 if p["node_id"] == node and p["device"] == device == "cpu")

    async def _drain_inbox(self, block: bool) -> list[str]:
        released = []
        while block or not self.inbox.empty():
            kind, rid, prompt, sp = await self.inbox.get()
            block = False
            if kind == "add":
                try:
                    self.engine.add_request(prompt, sp, request_id=rid)
                except ValueError as e:
                    live = self.live.pop(rid, None)
                    if live:
                        live.queue.put_nowait(e)
            else:
                self.engine.abort(rid)
                self.group.pop(rid, None)
                self.modes.pop(rid, None)
                self.drafted.discard(rid)
                if self.controller:
                    self.controller.release(rid)
                released.append(rid)
        return released

    async def _drafts(self, rids: list[str]) -> dict[str, Draft]:
        """Drafts for `rids` from the speculation cluster; {} (plain decoding) when late, failed or off."""
        if self.speculation is None or self.cfg.speculation.mode == "off" or not rids:
            return {}
        spec = self.cfg.speculation
        overrides = {r: self.live[r].speculation if r in self.live else {} for r in rids}
        caps = {r: 0 if not o.get("enabled", True) else min(spec.k, o.get("max_draft_tokens") or spec.k)
                for r, o in overrides.items()}
        ks = self.controller.choose(rids, caps, overlap_s=self._overlap(rids)) if self.controller else caps
        self.metrics.draft_lengths.extend(ks[r] for r in rids if caps[r] > 0)
        # Gamma_max: shorten the longest drafts until the total fits (CoSine Alg. 2)
        while sum(ks.values()) > spec.gamma_max:
            ks[max(ks, key=ks.get)] -= 1
        batch, modes = [], set()
        for r in rids:
            if ks[r] <= 0:
                continue
            item = {"rid": r, "context": self.engine.context(r), "k": ks[r]}
            mode = self._participation(overrides[r])
            item.update(participants=mode.drafters, fusion=mode.lockstep,
                        # up to `drafters` nodes per depth: the fused path and its branches
                        budget=min(spec.tree_budget, mode.drafters * ks[r]))
            for key in ("drafters", "routing"):
                if overrides[r].get(key) is not None:
                    item[key] = overrides[r][key]
            self.modes[r] = mode
            modes.add(mode if r in self.drafted else None)
            self.drafted.add(r)
            batch.append(item)
        if not batch:
            return {}
        t = time.perf_counter()
        try:
            raw = await asyncio.wait_for(self.speculation.draft.remote(batch), spec.draft_timeout_ms / 1000)
        except Exception as e:  # noqa: BLE001 - late or failed drafts: decode without them
            self.metrics.draft_round(None)
            logger.warning("drafts unavailable this step (%r); decoding without them", e)
            return {}
        seconds = time.perf_counter() - t
        self.metrics.draft_round(seconds)
        depth = max(it["k"] for it in batch)
        if self.controller and not self.controller.modes:  # per lockstep depth, by the number of requests drafting
            self.controller.draft.observe(len(batch), seconds / depth)
        elif self.controller and len(modes) == 1 and None not in modes:  # one mode, no prompt scoring: price it
            self.controller.draft_model(modes.pop()).observe(depth, seconds)
        return {r: draft_from_dict(d) for r, d in raw.items()}

    def _participation(self, o: dict):
        """How a request drafts this round: the controller's mode, unless the request overrides the drafters,
        their number or fusion (then lockstep is the configured fusion, or the controller's choice where the
        number matches)."""
        from speculation.goodput import Participation

        spec, mode = self.cfg.speculation, self.controller.mode if self.controller else None
        if o.get("drafters"):
            n = len(o["drafters"])
        elif spec.mode != "cosine":
            n = 1
        else:
            n = o.get("drafters_per_request") or (mode.drafters if mode else self.cfg.routing.drafters_per_request)
        if n <= 1:
            return Participation(1)
        if o.get("fusion") is not None:
            lockstep = bool(o["fusion"])
        elif mode is not None and mode.drafters == n:
            lockstep = mode.lockstep
        else:
            lockstep = spec.fusion
        return Participation(n, lockstep and spec.mode == "cosine")

    def _overlap(self, rids: list[str]) -> float:
        """How long the other pipeline half's verification runs alongside these requests' drafting (0 when the
        other half is empty: then drafting and verification take turns)."""
        if self.shared_cpu:
            return 0.0
        half = self.group.get(rids[0], 0) if rids else 0
        if not any(self.group.get(r, 0) != half for r in self.engine.running):
            return 0.0
        return self.half_verify_s[1 - half]

    async def _loop(self) -> None:
        """Two halves of the pool take turns: while one half is verified (in a worker thread), the other half's
        drafts are being produced by the speculation cluster (CoSine's pipeline)."""
        tasks: dict[int, asyncio.Task] = {}
        turn = 0
        while True:
            released = await self._drain_inbox(block=not self.engine.has_unfinished())
            if released and self.speculation is not None:
                self.speculation.release.remote(released)
            if not self.engine.has_unfinished():
                tasks.clear()
                continue
            self.engine.admit()
            members = [r for r in self.engine.running if self.group.get(r, 0) == turn]
            if not members:
                turn = 1 - turn
                members = [r for r in self.engine.running if self.group.get(r, 0) == turn]
            task = tasks.pop(turn, None)
            drafts = await task if task is not None else await self._drafts(members)
            drafts = {r: d for r, d in drafts.items() if r in self.engine.running}
            t = time.perf_counter()
            try:
                outs = await asyncio.to_thread(self.engine.step, drafts, set(members))
            except Exception as e:  # noqa: BLE001 - an engine failure fails the requests in it, not the replica
                logger.exception("verify step failed")
                for rid in members:
                    self.engine.abort(rid)
                    live = self.live.pop(rid, None)
                    if live:
                        live.queue.put_nowait(RuntimeError(f"verification failed: {e}"))
                continue
            self.half_verify_s[turn] = time.perf_counter() - t
            self.metrics.verify_step(self.half_verify_s[turn], drafts, outs, len(self.live))
            self._dispatch(outs)
            nxt = [r for r in self.engine.running if self.group.get(r, 0) == turn]
            if nxt:  # this half's next drafts are produced while the other half is verified
                tasks[turn] = asyncio.get_running_loop().create_task(self._drafts(nxt))
            turn = 1 - turn

    def _dispatch(self, outs) -> None:
        if self.controller:
            self.controller.verify.observe(self.engine.last_step_tokens, self.engine.last_verify_seconds)
        finished = []
        for o in outs:
            mode = self.modes.pop(o.request_id, None)
            if self.controller:
                self.controller.observe_acceptance(o.request_id, o.draft_depth, o.num_accepted_tokens,
                                                   mode if o.draft_depth and self.controller.modes else None)
            chunk = {"token_ids": o.new_token_ids, "finished": o.finished, "finish_reason": o.finish_reason,
                     "num_draft_tokens": o.num_draft_tokens, "num_accepted_tokens": o.num_accepted_tokens,
                     "accepted_drafters": o.accepted_drafters}
            if o.finished:
                finished.append(o.request_id)
                chunk["usage"] = self.engine.finished_stats(o.request_id) or {}
                self.group.pop(o.request_id, None)
                self.modes.pop(o.request_id, None)
                self.drafted.discard(o.request_id)
                if self.controller:
                    self.controller.release(o.request_id)
            live = self.live.get(o.request_id)
            if live is not None:
                live.generated += len(o.new_token_ids)
                live.queue.put_nowait(chunk)
                if o.finished:
                    self.live.pop(o.request_id, None)
        if finished and self.speculation is not None:
            self.speculation.release.remote(finished)


class _Metrics:
    """Prometheus metrics through Ray Serve (exported by every node's metrics agent), plus recent timings."""

    LATENCY_MS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]

    def __init__(self):
        from collections import deque

        from ray.serve import metrics as m

        self.draft_failures = 0
        self.draft_seconds: deque = deque(maxlen=512)
        self.verify_seconds: deque = deque(maxlen=512)
        self.draft_lengths: deque = deque(maxlen=512)  # the controller's recent choices (speculating requests)
        self.drafted = m.Counter("cosine_draft_tokens", "draft tokens verified, by drafter", tag_keys=("drafter",))
        self.accepted = m.Counter("cosine_accepted_tokens", "draft tokens accepted, by drafter",
                                  tag_keys=("drafter",))
        self.drafts = m.Counter("cosine_drafts", "drafts verified (one per request and step), by drafter",
                                tag_keys=("drafter",))
        self.generated = m.Counter("cosine_generated_tokens", "tokens committed to clients")
        self.steps = m.Counter("cosine_verify_steps", "verifier forward passes")
        self.fallbacks = m.Counter("cosine_draft_fallbacks", "steps decoded without drafts (late or failed)")
        self.draft_ms = m.Histogram("cosine_draft_latency_ms", "speculation round latency seen by the verifier",
                                    boundaries=self.LATENCY_MS)
        self.verify_ms = m.Histogram("cosine_verify_latency_ms", "verify step latency", boundaries=self.LATENCY_MS)
        self.in_flight = m.Gauge("cosine_requests_in_flight", "requests in the verifier's pool")
        self.mal = m.Gauge("cosine_mean_accepted_length", "recent mean accepted length (bonus included), by drafter",
                           tag_keys=("drafter",))
        self._recent: dict[str, deque] = {}

    def draft_round(self, seconds: float | None) -> None:
        if seconds is None:
            self.draft_failures += 1
            self.fallbacks.inc()
        else:
            self.draft_seconds.append(seconds)
            self.draft_ms.observe(seconds * 1000)

    def verify_step(self, seconds: float, drafts: dict, outs: list, in_flight: int) -> None:
        from collections import Counter, deque

        self.verify_seconds.append(seconds)
        self.verify_ms.observe(seconds * 1000)
        self.steps.inc()
        self.in_flight.set(in_flight)
        for o in outs:
            if o.new_token_ids:
                self.generated.inc(len(o.new_token_ids))
            d = drafts.get(o.request_id)
            if d is None or not d.drafters:
                continue
            for name, n in Counter(x for x in d.drafters if x).items():
                self.drafted.inc(n, tags={"drafter": name})
                self.drafts.inc(tags={"drafter": name})
                acc = sum(1 for a in o.accepted_drafters if a == name)
                if acc:
                    self.accepted.inc(acc, tags={"drafter": name})
                q = self._recent.setdefault(name, deque(maxlen=200))
                q.append(1 + acc)
                self.mal.set(sum(q) / len(q), tags={"drafter": name})
