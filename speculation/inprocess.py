"""The drafting tier in one process: drafter engines behind `DrafterServer`, driven by a local coordinator.

`DrafterServer` is what a drafter replica runs (deployments/drafter.py wraps it); `InProcessDraftingTier` is the
`DraftingTier` of `VerifyLoop` without Ray, for `cosine generate`, the engine benchmark, tests and the verifier
replica of a `speculation.drafting_tier: colocated` graph: the same coordinator, the same messages, direct calls
instead of deployment handles.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from config import AppConfig, DrafterSpec
from engines.build import build_verifier_engine, check_models, cpu_threads, set_thread_torch_threads
from engines.cascade import CascadeDrafterEngine
from engines.drafter import DrafterEngine
from engines.drafter_pool import DrafterPool, pool_shape
from engines.drafter_runners import make_drafter_runner
from engines.interface import CacheFull
from engines.runner import LlamaRunner
from engines.sampling import SamplingParams
from model_family.sources import resolve_model
from speculation.coordinator import SpeculationCoordinator
from speculation.goodput import LinearLatency
from speculation.loop import VerifyLoop
from speculation.messages import Draft, DrafterCall, DrafterReply, DraftRequest, Proposal, SpeculationOverrides
from speculation.profiling import fit_draft_latency


class DrafterServer:
    """One drafter model serving `DrafterCall`s. A call's context is the committed context, plus the fused prefix
    where fusion overrode the drafter's own token: the engine keeps the agreeing cached prefix, so a replica that
    never saw the request, or restarted, simply rebuilds it.

    Steps and releases run on the drafter's one thread, in the order they arrive, so a caller that gives up on a
    step (a timeout, a cancelled request) cannot have a release touch the engine while that step still runs. A call
    for a request already released (a round that was in flight when its request ended) is dropped rather than
    leave a cache that nobody would free."""

    RELEASED_REMEMBERED = 4096  # request ids are never reused; the most recent releases are enough to catch late calls

    def __init__(self, name: str, model, max_requests: int = 64, max_len: int = 2048, device: str | None = None,
                 threads: int = 1, assistant=None, assistant_k: int = 4, **engine_kw):
        """`model`: a model, its path, or a `DrafterEngine` to serve as it is (its caches and CUDA graphs kept from a
        loop before; benchmarks reuse engines so). `assistant`: a smaller model that drafts this drafter's chains
        for it (`CascadeDrafterEngine`). `engine_kw`: more `DrafterEngine` arguments (dtype, runner, KV budget)."""
        self.name, self.threads = name, threads
        kw = dict(name=name, max_requests=max_requests, max_len=max_len, device=device, **engine_kw)
        if isinstance(model, DrafterEngine):
            self.engine = model
        elif assistant is None:
            self.engine = DrafterEngine(model, **kw)
        else:
            self.engine = CascadeDrafterEngine(model, assistant, assistant_k=assistant_k, **kw)
        # steps run on one thread of their own, with the drafter's torch threads set there (they are per thread)
        self.executor = ThreadPoolExecutor(1, thread_name_prefix=f"drafter-{name}",
                                           initializer=set_thread_torch_threads, initargs=(threads,))
        self.released: OrderedDict[str, None] = OrderedDict()

    @classmethod
    def from_spec(cls, spec: DrafterSpec, model=None, actor_cpus: float | None = None,
                  vocab_limit: int | None = None) -> DrafterServer:
        """The configured drafter; a loaded `model` replaces loading it from its path (and stays where it is).
        `vocab_limit`: ids the target has (`engines.build.check_models`); the drafter never proposes others."""
        threads = cpu_threads(spec.threads, actor_cpus)
        assistant = str(resolve_model(spec.assistant)) if spec.assistant else None
        loaded = model is not None
        return cls(spec.name, model if loaded else str(resolve_model(spec.model)), spec.max_requests, spec.max_len,
                   None if loaded else spec.device, threads, assistant, spec.assistant_k, dtype=spec.dtype,
                   runner=spec.runner, kv_cache_bytes=int(spec.kv_cache_gib * 2**30), vocab_limit=vocab_limit)

    def capture(self) -> int:
        """On a GPU, the fast runner's CUDA graphs of every step bucket (chain steps, and the short prefills that
        score a prompt), on the drafter's thread, before serving; the graphs captured."""
        graphs = getattr(self.engine.runner, "graphs", None)
        if graphs is None or not graphs.cuda:
            return 0

        def both() -> int:
            with self.engine.runner.lock:
                return graphs.capture(hidden_only_last=True) + graphs.capture(hidden_only_last=False)

        return self.executor.submit(both).result()

    def batch_cost(self, batch: int = 8, context: int = 128) -> LinearLatency:
        """This drafter's step time on its hardware, t(requests in the step) = a + b * requests, measured up to
        `batch` requests on the drafter's own thread, with its torch threads (a step's fixed cost a is Python,
        launches and weights read once; b grows with the batch). Splitting a call's requests over more replicas
        saves only the b part: the autoscaler's `scalable` signal."""
        kind = "fast" if isinstance(self.engine.runner, LlamaRunner) else "transformers"

        def make_runner(model, max_slots: int, max_len: int):
            return make_drafter_runner(model, max_slots, max_len, kind)

        return self.executor.submit(fit_draft_latency, self.engine.model, max(2, batch), context,
                                    make_runner).result()

    async def run(self, calls: list[DrafterCall]) -> DrafterReply:
        """`step` on the drafter's own thread (the event loop goes on meanwhile)."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, self.step, calls)

    def step(self, calls: list[DrafterCall]) -> DrafterReply:
        """Each request's chain: the next proposal and, for `steps` > 1, the drafter's own continuation of it.
        A request whose context no longer fits is dropped from the reply (and its cache freed)."""
        t = time.perf_counter()
        rids = self.admit(calls)
        if not rids:
            return DrafterReply({}, (time.perf_counter() - t) * 1000)
        first = self.engine.step(rids, want_loglik=any(c.score_context for c in calls))
        chains: dict[str, list[Proposal]] = {r: [p] for r, p in first.items()}
        more = {c.request_id: c.steps - 1 for c in calls if c.steps > 1 and c.request_id in first}
        if more:
            for r in more:
                self.engine.feed(r, [first[r].token])
            for r, chain in self.engine.draft(list(more), more).items():
                chains[r].extend(chain)
        return DrafterReply(chains, (time.perf_counter() - t) * 1000)

    def admit(self, calls: list[DrafterCall]) -> list[str]:
        """Sync each call's request to its context: the requests to step (released and no longer fitting ones
        dropped, the latter's cache freed)."""
        rids = []
        for c in calls:
            if c.request_id in self.released:
                continue
            try:
                self.engine.sync(c.request_id, c.context)
            except CacheFull:
                self.engine.release(c.request_id)
                continue
            rids.append(c.request_id)
        return rids

    def release_later(self, rids: list[str]) -> Future:
        """`release` on the drafter's own thread, after the steps queued before it."""
        return self.executor.submit(self.release, rids)

    def release(self, rids: list[str]) -> None:
        for r in rids:
            if r in self.engine:
                self.engine.release(r)
            self.released[r] = None
            self.released.move_to_end(r)
        while len(self.released) > self.RELEASED_REMEMBERED:
            self.released.popitem(last=False)


class InProcessDraftingTier:
    """Drafter servers in this process; a drafter's step runs on the drafter's own thread (torch releases the GIL),
    so several drafters and the verifier's step can overlap where there are cores for them. An engine is not
    re-entrant: calls to one drafter queue on its lock, as they do on a replica.

    With `pool_drafters` "auto", drafters of one shape form a `DrafterPool` (engines/drafter_pool.py) on one thread
    of its own (their steps and releases in order there): the coordinator's calls to several of them at one depth
    (`asyncio.gather`ed, so they all arrive before the loop's next turn) are coalesced into one `_PooledCalls`
    batch, whose chains advance one pooled forward per depth."""

    def __init__(self, coordinator: SpeculationCoordinator, servers: dict[str, DrafterServer],
                 pool_drafters: str = "off", pool_padded: bool | None = None):
        self.coordinator = coordinator
        self.servers = servers
        self.locks = {name: asyncio.Lock() for name in servers}
        self.pools: dict[str, _PooledCalls] = {}  # drafter name -> its pool
        if pool_drafters == "auto":
            shapes: dict[tuple, list[str]] = {}
            for name, server in servers.items():
                shape = pool_shape(server.engine)
                if shape is not None:
                    shapes.setdefault(shape, []).append(name)
            for names in shapes.values():
                if len(names) > 1:
                    pooled = _PooledCalls({n: servers[n] for n in names}, pool_padded)
                    self.pools |= dict.fromkeys(names, pooled)
        for name, server in servers.items():
            if name not in self.pools:
                server.capture()

    @classmethod
    def from_config(cls, cfg: AppConfig, models: dict | None = None) -> InProcessDraftingTier:
        """The configured drafters, checked against the target (`check_models`); `models` (name -> loaded model)
        replaces loading them from their paths."""
        models = models or {}
        vocab = check_models(cfg, preloaded=set(models))
        servers = {d.name: DrafterServer.from_spec(d, models.get(d.name), vocab_limit=vocab) for d in cfg.drafters}
        return cls(SpeculationCoordinator.from_config(cfg), servers, cfg.speculation.pool_drafters)

    async def _step(self, name: str, calls: list[DrafterCall]) -> dict[str, list[Proposal]]:
        if name in self.pools:
            return (await self.pools[name].run(name, calls)).chains
        async with self.locks[name]:
            return (await self.servers[name].run(calls)).chains

    async def draft(self, batch: list[DraftRequest]) -> dict[str, Draft]:
        return await self.coordinator.draft(batch, self._step)

    async def stats(self) -> dict:
        return self.coordinator.state()

    def release(self, request_ids: list[str]) -> None:
        per: dict[str, list[str]] = {}
        for r in request_ids:
            for name in self.coordinator.release(r):
                per.setdefault(name, []).append(r)
        for name, rids in per.items():
            self.servers[name].release_later(rids)


class _PooledCalls:
    """The calls to a pool's drafters, coalesced: calls that arrive in one event-loop turn become one batch, run on
    the pool's thread as `DrafterServer.step` runs one drafter's (sync, the first pooled step, then the chains),
    each drafter's reply as its own step would give it. The pooled servers' executor becomes the pool's thread, so
    their releases stay ordered with the steps."""

    def __init__(self, servers: dict[str, DrafterServer], padded: bool | None = None):
        self.servers = servers
        self.pool = DrafterPool([s.engine for s in servers.values()], padded)
        threads = max(s.threads for s in servers.values())
        # on a GPU the pool's thread issues its work on a stream of its own: it neither waits for the verifier's
        # work on the default stream nor breaks a capture there
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="drafter-pool", initializer=_drafting_thread,
                                           initargs=(threads, self.pool.device))
        for s in servers.values():
            s.executor.shutdown(wait=True)
            s.executor = self.executor
        self.executor.submit(self.pool.capture).result()  # every bucket's CUDA graph, before serving
        self.waiting: list[tuple[str, list[DrafterCall], asyncio.Future]] = []

    async def run(self, name: str, calls: list[DrafterCall]) -> DrafterReply:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        if not self.waiting:
            loop.call_soon(self._flush, loop)
        self.waiting.append((name, calls, fut))
        return await fut

    def _flush(self, loop: asyncio.AbstractEventLoop) -> None:
        waiting, self.waiting = self.waiting, []
        while waiting:  # a drafter called twice in one turn (overlapping rounds): its second call in a later batch
            batch, seen, later = [], set(), []
            for item in waiting:
                (later if item[0] in seen else batch).append(item)
                seen.add(item[0])
            waiting = later
            job = loop.run_in_executor(self.executor, self.step, [(n, c) for n, c, _ in batch])
            job.add_done_callback(lambda j, batch=batch: self._answer(j, batch))

    @staticmethod
    def _answer(job: asyncio.Future, batch) -> None:
        for name, _, fut in batch:
            if fut.done():  # its caller gave up (a timeout)
                continue
            if job.exception() is not None:
                fut.set_exception(job.exception())
            else:
                fut.set_result(job.result()[name])

    def step(self, batch: list[tuple[str, list[DrafterCall]]]) -> dict[str, DrafterReply]:
        t = time.perf_counter()
        rids = {name: self.servers[name].admit(calls) for name, calls in batch}
        rids = {n: r for n, r in rids.items() if r}
        first = self.pool.step(rids, want_loglik={n for n, calls in batch if any(c.score_context for c in calls)})
        chains = {n: {r: [p] for r, p in got.items()} for n, got in first.items()}
        more = {n: {c.request_id: c.steps - 1 for c in calls if c.steps > 1 and c.request_id in first.get(n, {})}
                for n, calls in batch}
        more = {n: m for n, m in more.items() if m}
        for n, m in more.items():
            for r in m:
                self.pool.engines[n].feed(r, [first[n][r].token])
        for n, got in self.pool.draft({n: list(m) for n, m in more.items()}, more).items():
            for r, chain in got.items():
                chains[n][r].extend(chain)
        ms = (time.perf_counter() - t) * 1000
        return {name: DrafterReply(chains.get(name, {}), ms) for name, _ in batch}


def _drafting_thread(threads: int, device: torch.device) -> None:
    set_thread_torch_threads(threads)
    if device.type == "cuda":
        torch.cuda.set_stream(torch.cuda.Stream(device))


@dataclass
class Generation:
    token_ids: list[int]
    finish_reason: str | None
    stats: dict  # the request's speculation statistics (vLLM's names)


def build_loop(cfg: AppConfig, engine=None, drafter_models: dict | None = None) -> VerifyLoop:
    """The service's loop in this process: the configured verifier engine (or `engine`) and drafters (or the
    already loaded `drafter_models`, name -> model or `DrafterEngine`)."""
    tier = InProcessDraftingTier.from_config(cfg, drafter_models) if cfg.speculation.mode != "off" else None
    loop = VerifyLoop(engine if engine is not None else build_verifier_engine(cfg), cfg, tier)
    loop.drafting_overlaps_verification = False  # drafters and verifier share this process's hardware
    return loop


async def generate_all(loop: VerifyLoop, prompts: list[list[int]], params: list[SamplingParams],
                       overrides: list[SpeculationOverrides | None] | None = None) -> list[Generation]:
    """Every prompt through the loop at once (continuous batching up to the engine's max_batch)."""
    async def one(prompt, sp, o) -> Generation:
        out = Generation([], None, {})
        async for chunk in loop.generate(prompt, sp, overrides=o):
            out.token_ids += chunk.token_ids
            if chunk.finished:
                out.finish_reason, out.stats = chunk.finish_reason, chunk.usage or {}
        return out

    overrides = overrides or [None] * len(prompts)
    return list(await asyncio.gather(*(one(p, sp, o) for p, sp, o in zip(prompts, params, overrides))))
