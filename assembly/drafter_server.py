"""One drafter serving `DrafterCall`s: what a drafter replica runs (deployments/drafter.py wraps it) and what the
in-process drafting tier calls directly. The drafter is a model (`DrafterEngine`, `CascadeDrafterEngine`) or
model-free (`NgramDrafterEngine`, `SuffixDrafterEngine`), as its spec's `kind` says."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

from config import DrafterSpec
from engines.build import cpu_threads, set_thread_torch_threads
from engines.cascade import CascadeDrafterEngine
from engines.drafter import DrafterEngine
from engines.drafter_runners import make_drafter_runner
from engines.interface import CacheFull
from engines.model_free import ModelFreeDrafter
from engines.ngram_drafter import NgramDrafterEngine
from engines.runner import LlamaRunner
from engines.suffix_drafter import SuffixDrafterEngine
from model_family.sources import resolve_model
from speculation.latency import LinearLatency
from speculation.messages import DrafterCall, DrafterReply, Proposal
from speculation.profiling import fit_draft_latency, fit_step_latency


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
        """`model`: a model, its path, or a `DrafterEngine` or model-free drafter to serve as it is (its caches and
        CUDA graphs kept from a loop before; benchmarks reuse engines so). `assistant`: a smaller model that drafts
        this drafter's chains for it (`CascadeDrafterEngine`). `engine_kw`: more `DrafterEngine` arguments (dtype,
        runner, KV budget)."""
        self.name, self.threads = name, threads
        kw = dict(name=name, max_requests=max_requests, max_len=max_len, device=device, **engine_kw)
        if isinstance(model, (DrafterEngine, ModelFreeDrafter)):
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
        `vocab_limit`: ids the target has (`engines.build.check_models`); the drafter never proposes others (a
        model-free one proposes tokens of the context, which the target's tokenizer made)."""
        threads = cpu_threads(spec.threads, actor_cpus)
        if spec.kind == "ngram":
            n = spec.ngram
            return cls(spec.name, NgramDrafterEngine(spec.name, n.min_n, n.max_n, spec.max_requests, spec.max_len,
                                                     n.min_prob), threads=threads)
        if spec.kind == "suffix":
            s = spec.suffix
            return cls(spec.name, SuffixDrafterEngine(spec.name, s.max_depth, s.cross_request, s.cached_outputs,
                                                      s.max_tenants, spec.max_requests, spec.max_len, s.min_prob),
                       threads=threads)
        assistant = str(resolve_model(spec.assistant)) if spec.assistant else None
        loaded = model is not None
        return cls(spec.name, model if loaded else str(resolve_model(spec.model)), spec.max_requests, spec.max_len,
                   None if loaded else spec.device, threads, assistant, spec.assistant_k, dtype=spec.dtype,
                   runner=spec.runner, kv_cache_bytes=int(spec.kv_cache_gib * 2**30), vocab_limit=vocab_limit)

    def capture(self) -> int:
        """The fast runner's CUDA graphs of every step bucket (chain steps, and the short prefills that score a
        prompt), on the drafter's thread, before serving (on a CPU, with graphs on, the shapes recorded); the graphs
        captured."""
        graphs = getattr(self.engine.runner, "graphs", None)
        if graphs is None:
            return 0
        return self.executor.submit(lambda: graphs.capture(hidden_only_last=True) +
                                    graphs.capture(hidden_only_last=False)).result()

    def batch_cost(self, batch: int = 8, context: int = 128) -> LinearLatency:
        """This drafter's step time on its hardware, t(requests in the step) = a + b * requests, measured up to
        `batch` requests on the drafter's own thread, with its torch threads (a step's fixed cost a is Python,
        launches and weights read once; b grows with the batch). Splitting a call's requests over more replicas
        saves only the b part: the autoscaler's `scalable` signal. A model-free drafter's own steps are timed."""
        if self.engine.model is None:
            return self.executor.submit(fit_step_latency, self.engine, max(2, batch), context).result()
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
        alternatives = any(c.alternatives for c in calls)
        first = self.engine.step(rids, want_loglik=any(c.score_context for c in calls), alternatives=alternatives)
        chains: dict[str, list[Proposal]] = {r: [p] for r, p in first.items()}
        more = {c.request_id: c.steps - 1 for c in calls if c.steps > 1 and c.request_id in first}
        if more:
            for r in more:
                self.engine.feed(r, [first[r].token])
            for r, chain in self.engine.draft(list(more), more, alternatives).items():
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
                self.engine.sync(c.request_id, c.context, c.tenant)
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
