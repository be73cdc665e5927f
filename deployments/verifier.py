"""The verifier deployment: a thin Serve wrapper around `speculation.loop.VerifyLoop`, with the engine the
configuration names, a drafting tier (the Speculation deployment's handle, or with `speculation.drafting_tier:
colocated` the coordinator and drafters in this replica, or with `auto` both, each round on the tier
speculation/tiers.py picks) and Prometheus metrics."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

import torch
from ray import serve
from ray.serve import metrics

from config import AppConfig
from deployments.speculation import DrafterFailures
from engines.build import build_verifier_engine, cpu_threads, in_passing_thread
from engines.device_work import WORK, DeviceWork, warmed_up
from engines.sampling import SamplingParams
from assembly.drafting_tier import InProcessDraftingTier, step_on_verifier_thread
from assembly.loop import freeze_startup_heap
from speculation.loop import VerifyLoop
from speculation.loop_stats import LoopStats
from speculation.messages import DraftRequest, DraftRound, SpeculationOverrides, TokenChunk
from speculation.signals import VERIFIER_RETIRED, IntervalMeter, verifier_signals
from speculation.tiers import VERIFIER_REMOTE, AutoDraftingTier, resolve

logger = logging.getLogger("ray.serve")


class HandleDraftingTier:
    """`VerifyLoop`'s drafting tier in the service: the Speculation deployment, one hop away."""

    def __init__(self, handle):
        self.handle = handle

    async def draft(self, batch: list[DraftRequest]) -> DraftRound:
        return await self.handle.draft.remote(batch)

    def release(self, request_ids: list[str]) -> None:
        self.handle.release.remote(request_ids)

    async def stats(self) -> dict:
        return await self.handle.stats.remote()


class MetricBuffer:
    """Ray metrics recorded in process and published on a timer: a Ray metric call costs the loop's thread a trip
    into Ray's core worker, and the loop made several per step and per request; here a step adds to dicts, and
    every `PUBLISH_S` (a timer on the loop's event loop, started by the first record) each counter gets one call
    with its sum, each gauge its last value, and each histogram its observations. Ray's agent exports every few
    seconds anyway, so Prometheus sees the same series."""

    PUBLISH_S = 1.0

    def __init__(self):
        self.counts: dict[tuple, float] = {}
        self.gauges: dict[tuple, float] = {}
        self.observed: dict[tuple, list[float]] = {}
        self._timer = None

    def inc(self, metric, n: float = 1, tags: dict | None = None) -> None:
        key = (metric, tuple(tags.items()) if tags else ())
        self.counts[key] = self.counts.get(key, 0) + n
        self._arm()

    def set(self, metric, value: float, tags: dict | None = None) -> None:
        self.gauges[(metric, tuple(tags.items()) if tags else ())] = value
        self._arm()

    def observe(self, metric, value: float) -> None:
        self.observed.setdefault((metric, ()), []).append(value)
        self._arm()

    def _arm(self) -> None:
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.PUBLISH_S, self.publish)

    def publish(self) -> None:
        counts, gauges, observed = self.counts, self.gauges, self.observed
        self.counts, self.gauges, self.observed, self._timer = {}, {}, {}, None
        for (metric, tags), n in counts.items():
            metric.inc(n, tags=dict(tags) or None)
        for (metric, tags), value in gauges.items():
            metric.set(value, tags=dict(tags) or None)
        for (metric, _), values in observed.items():
            for v in values:
                metric.observe(v)


class PrometheusStats(LoopStats):
    """The loop's statistics, also exported as Prometheus metrics through Ray Serve (every node's metrics agent)."""

    LATENCY_MS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]

    def __init__(self):
        super().__init__()
        self.drafted = metrics.Counter("cosine_draft_tokens", "draft tokens verified, by drafter",
                                       tag_keys=("drafter",))
        self.accepted = metrics.Counter("cosine_accepted_tokens", "draft tokens accepted, by drafter",
                                        tag_keys=("drafter",))
        self.drafts = metrics.Counter("cosine_drafts", "drafts verified (one per request and step), by drafter",
                                      tag_keys=("drafter",))
        self.generated = metrics.Counter("cosine_generated_tokens", "tokens committed to clients")
        self.steps = metrics.Counter("cosine_verify_steps", "verifier forward passes")
        self.fallbacks = metrics.Counter("cosine_draft_fallbacks", "steps decoded without drafts (late or failed)")
        self.draft_ms = metrics.Histogram("cosine_draft_latency_ms", "speculation round latency seen by the "
                                          "verifier", boundaries=self.LATENCY_MS)
        self.verify_ms = metrics.Histogram("cosine_verify_latency_ms", "verify step latency",
                                           boundaries=self.LATENCY_MS)
        self.in_flight = metrics.Gauge("cosine_requests_in_flight", "requests in the verifier's pool")
        self.mal = metrics.Gauge("cosine_mean_accepted_length", "recent mean accepted length (bonus included), by "
                                 "drafter", tag_keys=("drafter",))
        self.draft_length = metrics.Histogram("cosine_draft_length", "draft length the controller chose, per "
                                              "request and round (0: that request decodes without a draft)",
                                              boundaries=[0.5, 1.5, 2.5, 3.5, 4.5, 6.5, 8.5, 16.5])
        self.goodput = metrics.Gauge("cosine_goodput", "tokens per second to clients: measured (over the last "
                                     "steps) and predicted (what the goodput controller expects of its choice)",
                                     tag_keys=("source",))
        self.device_work = metrics.Counter("cosine_device_work", "work this replica's process gave its devices "
                                           "(engines/device_work.py): what=drafter_forwards, draft_depths (summed "
                                           "over drafting rounds), draft_host_reads, verify_host_reads (device "
                                           "results read on the host: syncs on a GPU)", tag_keys=("what",))
        self.captures = metrics.Gauge("cosine_graph_captures_after_warmup", "CUDA graph captures after startup "
                                      "in this replica's process (0 when every step shape was captured at start)")
        self.out = MetricBuffer()
        self.step_ends: deque = deque(maxlen=32)  # (end time, tokens committed) of recent steps
        self.meter = IntervalMeter()  # for the autoscaler (record_autoscaling_stats)

    def planned(self, ks: list[int], predicted_goodput: float | None) -> None:
        for k in ks:
            self.out.observe(self.draft_length, k)
        if predicted_goodput:
            self.out.set(self.goodput, predicted_goodput, tags={"source": "predicted"})
        self.meter.add("rounds", len(ks))
        self.meter.add("speculated", sum(1 for k in ks if k > 0))
        self.meter.add("k", sum(ks))

    def draft_wait(self, seconds: float) -> None:
        super().draft_wait(seconds)
        self.meter.add("draft_wait_s", seconds)

    def draft_round(self, seconds: float | None) -> None:
        super().draft_round(seconds)
        if seconds is None:
            self.out.inc(self.fallbacks)
        else:
            self.out.observe(self.draft_ms, seconds * 1000)

    def verify_step(self, seconds: float, drafts: dict, outs: list, in_flight: int) -> None:
        super().verify_step(seconds, drafts, outs, in_flight)
        self.out.observe(self.verify_ms, seconds * 1000)
        self.out.inc(self.steps)
        self.out.set(self.in_flight, in_flight)
        generated = sum(len(o.new_token_ids) for o in outs)
        if generated:
            self.out.inc(self.generated, generated)
        self.step_ends.append((time.perf_counter(), generated))
        if len(self.step_ends) > 1:
            span = self.step_ends[-1][0] - self.step_ends[0][0]
            self.out.set(self.goodput, sum(n for _, n in list(self.step_ends)[1:]) / max(span, 1e-9),
                         tags={"source": "measured"})

    def device_round(self, depth: int, work: DeviceWork) -> None:
        super().device_round(depth, work)
        for what, n in (("draft_depths", depth), ("drafter_forwards", work.drafter_forwards),
                        ("draft_host_reads", work.host_reads)):
            if n:
                self.out.inc(self.device_work, n, tags={"what": what})

    def device_step(self, work: DeviceWork) -> None:
        super().device_step(work)
        if work.host_reads:
            self.out.inc(self.device_work, work.host_reads, tags={"what": "verify_host_reads"})
        self.out.set(self.captures, WORK.captures_after_warmup)

    def drafter_round(self, name: str, drafted: int, accepted: int) -> None:
        super().drafter_round(name, drafted, accepted)
        tags = {"drafter": name}
        self.out.inc(self.drafted, drafted, tags=tags)
        self.out.inc(self.drafts, tags=tags)
        if accepted:
            self.out.inc(self.accepted, accepted, tags=tags)
        q = self.recent_accepted[name]
        self.out.set(self.mal, sum(q) / len(q), tags=tags)


class VerifierServer:
    """The verifier replica's methods, undecorated: `VerifierDeployment` serves them alone (behind the ingress),
    serve_app/ingress.py's `VerifierIngress` with the OpenAI server in the same replica."""

    def __init__(self, config: AppConfig, speculation=None):
        v = config.verifier
        torch.set_num_threads(cpu_threads(v.threads, v.deployment.ray_actor_options.get("num_cpus")))
        plan = resolve(config)
        if plan.remote and speculation is None:
            raise ValueError("the drafting tier needs the Speculation deployment's handle (serve_app/graph.py)")
        self.speculation = speculation if plan.remote else None  # handle to the Speculation deployment, or None
        remote = HandleDraftingTier(speculation) if plan.remote else None
        local = None
        if plan.local:
            local = in_passing_thread(InProcessDraftingTier.from_config, config)
            local.coordinator.on_failure = DrafterFailures()
        self.tiers = AutoDraftingTier(local, remote, config) if plan.auto else None
        drafting = self.tiers or local or remote
        loggers = None
        if v.engine == "vllm":  # vLLM's own metrics (its spec-decode counters among them) go out with ours
            from engines.vllm_hooks import ray_metrics_logger

            loggers = [ray_metrics_logger()]
        self.engine = in_passing_thread(build_verifier_engine, config, loggers)
        self.loop = VerifyLoop(self.engine, config, drafting, PrometheusStats())
        # colocated drafters compute on this replica's hardware: drafting takes its cycles from verification
        self.loop.drafting_overlaps_verification = plan.fixed == "deployments" or \
            config.speculation.colocated_overlaps(self.engine.device)
        if self.tiers is not None:  # follows the tier in use
            self.tiers.attach(self.loop)
        # the colocated tier overlaps verification only as the one tier, configured so (auto: never)
        step_on_verifier_thread(local, self.loop, plan.fixed is not None and self.loop.drafting_overlaps_verification)
        self.placement_checked = not plan.remote
        warmed_up()  # engines and drafters captured their graphs above: a capture from now on is counted
        freeze_startup_heap()
        self.retired = metrics.Gauge("cosine_domain_drafters_retired", "1 while the verifier drafts every round on "
                                     "the generalist so that the autoscaler may take the domain drafters' replicas")

    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
                       overrides: SpeculationOverrides | None = None):
        """Streams a `TokenChunk` per verify step that committed tokens for the request."""
        if not self.placement_checked:
            self.placement_checked = True
            await self._check_placement()
        async for chunk in self.loop.generate(prompt_ids, params, request_id, overrides):
            yield chunk

    async def complete(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
                       overrides: SpeculationOverrides | None = None) -> TokenChunk:
        """The whole request as one chunk: one reply instead of a message per verify step, for clients that do not
        stream (each message costs both processes CPU the verify step's threads would have used)."""
        out = TokenChunk([], False)
        async for chunk in self.generate(prompt_ids, params, request_id, overrides):
            out.extend(chunk)
        return out

    def running(self) -> int:
        return len(self.loop.requests)

    async def speculation_stats(self) -> dict:
        """Timings of the draft/verify loop and of the speculation rounds (for `cosine bench serve`)."""
        out = self.loop.stats.summary()
        out["requests_in_flight"] = len(self.loop.requests)
        # since start, as the benchmarks' in-process rows read them: rounds by participation, drafter forwards
        out["by_participation_since_start"] = {str(p): n for p, n in self.loop.stats.by_participation.items()}
        if isinstance(self.loop.drafting, InProcessDraftingTier):
            forwards, seconds = self.loop.drafting.forward_work()
            out["drafter_forwards_since_start"], out["drafter_forward_s_since_start"] = forwards, seconds
        controller = self.loop.controller_state()
        if controller is not None:
            out["controller"] = controller
        if self.loop.drafting is not None:
            out.update(await self.loop.drafting.stats())
        return out

    def spec_decode_totals(self) -> dict:
        """vLLM's speculative-decoding counters over this replica's life (the ingress's /metrics)."""
        return self.loop.stats.spec_decode

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metrics hook: what the drafter autoscaler (autoscale/policy.py) needs to
        know of the verifier (a verifier with autoscaling_config takes part in the application's policy)."""
        signals = verifier_signals(self.loop.stats.meter, len(self.loop.requests))
        retirement = self.loop.planner.retirement
        if retirement is not None:
            signals[VERIFIER_RETIRED] = retirement.take()
            self.retired.set(float(retirement.retired))
        if self.tiers is not None:
            signals[VERIFIER_REMOTE] = self.tiers.remote_share()
        return signals

    def check_health(self) -> None:
        err = self.loop.failed()
        if err is not None:
            raise RuntimeError(f"verify loop died: {err!r}")

    async def _check_placement(self) -> None:
        """Drafting only overlaps verification where it has hardware of its own. Drafters on this node's CPU, next
        to a CPU verifier (the one-machine configuration), take their cycles from verification: for them the
        controller counts drafting time in full."""
        import ray

        try:
            drafters = await self.speculation.placement.remote()
        except Exception:  # noqa: BLE001 - unknown placement: assume separate hardware, as in a cluster
            logger.warning("drafter placement unknown; assuming drafting overlaps verification")
            return
        node, device = ray.get_runtime_context().get_node_id(), self.engine.device
        shared = [n for n, p in drafters.items() if p["node_id"] == node and p["device"] == device == "cpu"]
        if self.tiers is not None:
            self.tiers.set_remote_overlaps(not shared)
        else:
            self.loop.drafting_overlaps_verification = not shared


VerifierDeployment = serve.deployment(name="Verifier")(VerifierServer)
