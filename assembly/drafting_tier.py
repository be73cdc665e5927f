"""The drafting tier in one process: drafter servers driven by a local coordinator, the `DraftingTier` of
`VerifyLoop` without Ray: the same coordinator, the same messages, direct calls instead of deployment handles."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

from assembly.drafter_server import DrafterServer
from config import AppConfig
from engines.build import check_models, set_thread_torch_threads
from engines.drafter_pool import DrafterPool, pool_shape
from speculation.coordinator import SpeculationCoordinator
from speculation.loop import VerifyLoop
from speculation.messages import DrafterCall, DrafterReply, DraftRequest, DraftRound, Proposal


class InProcessDraftingTier:
    """Drafter servers in this process; a drafter's step runs on the drafter's own thread (torch releases the GIL),
    so several drafters and the verifier's step can overlap where there are cores for them. An engine is not
    re-entrant: calls to one drafter queue on its lock, as they do on a replica.

    With `pool_drafters` "on" ("auto": on where they run on a GPU), drafters of one shape form a `DrafterPool`
    (engines/drafter_pool.py) on one thread of its own (their steps and releases in order there): the coordinator's
    calls to several of them at one depth (`asyncio.gather`ed, so they all arrive before the loop's next turn) are
    coalesced into one `_PooledCalls` batch, whose chains advance one pooled forward per depth. Every drafter's CUDA
    graphs are captured at startup, a pooled one's (it still steps alone where it alone scores a prompt) once the
    pool holds its cache."""

    def __init__(self, coordinator: SpeculationCoordinator, servers: dict[str, DrafterServer],
                 pool_drafters: str = "auto", pool_padded: bool | None = None):
        self.coordinator = coordinator
        self.servers = servers
        self.locks = {name: asyncio.Lock() for name in servers}
        self.pools: dict[str, _PooledCalls] = {}  # drafter name -> its pool
        if pool_drafters != "off":
            shapes: dict[tuple, list[str]] = {}
            for name, server in servers.items():
                shape = pool_shape(server.engine)
                if shape is not None and (pool_drafters == "on" or str(server.engine.runner.device).startswith("cuda")):
                    shapes.setdefault(shape, []).append(name)
            for names in shapes.values():
                if len(names) > 1:
                    pooled = _PooledCalls({n: servers[n] for n in names}, pool_padded)
                    self.pools |= dict.fromkeys(names, pooled)
        for server in servers.values():  # a pooled one on its pool's thread, on the cache the pool gave it
            server.capture()

    @classmethod
    def from_config(cls, cfg: AppConfig, models: dict | None = None) -> InProcessDraftingTier:
        """The configured drafters, checked against the target (`check_models`); `models` (name -> loaded model)
        replaces loading them from their paths."""
        models = models or {}
        vocab = check_models(cfg, preloaded=set(models))
        servers = {d.name: DrafterServer.from_spec(d, models.get(d.name), vocab_limit=vocab) for d in cfg.drafters}
        return cls(SpeculationCoordinator.from_config(cfg), servers, cfg.speculation.pool_drafters)

    def step_on(self, thread: ThreadPoolExecutor) -> None:
        """Step every drafter (and pool) on `thread` from now on, their own threads shut down: the verifier's thread
        where drafting takes turns with verification on a CPU (`step_on_verifier_thread`)."""
        for runs in [*self.servers.values(), *self.pools.values()]:
            if runs.executor is not thread:
                runs.executor.shutdown(wait=True)
                runs.executor = thread

    async def _step(self, name: str, calls: list[DrafterCall]) -> dict[str, list[Proposal]]:
        if name in self.pools:
            return (await self.pools[name].run(name, calls)).chains
        async with self.locks[name]:
            return (await self.servers[name].run(calls)).chains

    async def draft(self, batch: list[DraftRequest]) -> DraftRound:
        return await self.coordinator.draft(batch, self._step)

    async def stats(self) -> dict:
        return self.coordinator.state()

    def forward_work(self) -> tuple[int, float]:
        """The drafter models' forward passes so far and their seconds, by the runners' own timers (a pool's
        batched forward counted once): what of a drafting round is model compute, the rest being the coordinator's
        and the drafter servers' host work. Model-free drafters have none."""
        pools = {id(p.pool): p.pool for p in self.pools.values()}
        alone = [s.engine for n, s in self.servers.items() if n not in self.pools and s.engine.runner is not None]
        return (sum(e.forward_passes for e in alone) + sum(p.forward_passes for p in pools.values()),
                sum(e.runner.forward_seconds for e in alone) + sum(p.forward_seconds for p in pools.values()))

    def release(self, request_ids: list[str]) -> None:
        per: dict[str, list[str]] = {}
        for r in request_ids:
            for name in self.coordinator.release(r):
                per.setdefault(name, []).append(r)
        for name, rids in per.items():
            self.servers[name].release_later(rids)


def step_on_verifier_thread(tier: InProcessDraftingTier | None, loop: VerifyLoop, overlaps: bool) -> None:
    """Where colocated drafters take turns with verification (`overlaps` False) on a CPU, they step on the thread
    the verifier steps on, as vLLM's own drafter does: with its torch threads and its warm OpenMP workers. On
    threads of their own, each drafter's OpenMP pool woke sleeping workers at every op while the verifier's pool
    spun beside it (the 2-core CPU, `cosine bench anchors`, k = 4, concurrency 8: a drafting round 11.47 ms against
    23.20 on threads of their own; docs/benchmarks.md)."""
    if tier is not None and not overlaps and loop.engine.device == "cpu":
        tier.step_on(loop.step_thread)


class _PooledCalls:
    """The calls to a pool's drafters, coalesced: calls that arrive in one event-loop turn become one batch, run on
    the pool's thread as `DrafterServer.step` runs one drafter's (sync, the first pooled step, then the chains),
    each drafter's reply as its own step would give it. The pooled servers' executor becomes the pool's thread, so
    their releases stay ordered with the steps."""

    def __init__(self, servers: dict[str, DrafterServer], padded: bool | None = None):
        self.servers = servers
        self.pool = DrafterPool([s.engine for s in servers.values()], padded)
        threads = max(s.threads for s in servers.values())
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="drafter-pool",
                                           initializer=set_thread_torch_threads, initargs=(threads,))
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
        """One pooled step for the calls of this turn. Calls to one drafter from overlapping rounds (the pipeline's
        two halves drafting at once) share it when their requests differ; a request called twice goes to a later
        step."""
        waiting, self.waiting = self.waiting, []
        while waiting:
            merged: dict[str, list[DrafterCall]] = {}
            batch, later = [], []
            for item in waiting:
                name, calls, _ = item
                taken = {c.request_id for c in merged.get(name, [])}
                if taken & {c.request_id for c in calls}:
                    later.append(item)
                    continue
                merged.setdefault(name, []).extend(calls)
                batch.append(item)
            waiting = later
            job = loop.run_in_executor(self.executor, self.step, list(merged.items()))
            job.add_done_callback(lambda j, batch=batch: self._answer(j, batch))

    @staticmethod
    def _answer(job: asyncio.Future, batch) -> None:
        for name, calls, fut in batch:
            if fut.done():  # its caller gave up (a timeout)
                continue
            if job.exception() is not None:
                fut.set_exception(job.exception())
            else:
                reply = job.result()[name]
                mine = {c.request_id for c in calls}
                fut.set_result(DrafterReply({r: ch for r, ch in reply.chains.items() if r in mine}, reply.compute_ms))

    def step(self, batch: list[tuple[str, list[DrafterCall]]]) -> dict[str, DrafterReply]:
        t = time.perf_counter()
        rids = {name: self.servers[name].admit(calls) for name, calls in batch}
        rids = {n: r for n, r in rids.items() if r}
        alternatives = any(c.alternatives for _, calls in batch for c in calls)
        first = self.pool.step(rids, want_loglik={n for n, calls in batch if any(c.score_context for c in calls)},
                               alternatives=alternatives)
        chains = {n: {r: [p] for r, p in got.items()} for n, got in first.items()}
        more = {n: {c.request_id: c.steps - 1 for c in calls if c.steps > 1 and c.request_id in first.get(n, {})}
                for n, calls in batch}
        more = {n: m for n, m in more.items() if m}
        for n, m in more.items():
            for r in m:
                self.pool.engines[n].feed(r, [first[n][r].token])
        for n, got in self.pool.draft({n: list(m) for n, m in more.items()}, more, alternatives).items():
            for r, chain in got.items():
                chains[n][r].extend(chain)
        ms = (time.perf_counter() - t) * 1000
        return {name: DrafterReply(chains.get(name, {}), ms) for name, _ in batch}
