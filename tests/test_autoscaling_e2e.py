"""The drafter autoscaler and `serve deploy` of a changed config, end to end: the served application on one local
Ray cluster, deployed as `serve deploy` does (Serve's REST API; the application-level autoscaling policy applies
only so). The tests share the cluster and run in order, each starting from the config the one before left (a test
run alone deploys its own): a load ramp low -> high -> idle; a redeploy under load to a changed config; drafters
at zero without traffic and back for it.

Drafter replicas must rise under load and fall back after it, a redeploy must replace every replica, and no
request may fail or change its output while replicas come and go (greedy output equals target-only decoding, token
for token, streamed or not). The thresholds are set for the small test models (drafting costs little next to
verification here), not for production. Every wait is for a condition, with bounds of minutes: on a slow, shared
machine the same events come later, not differently.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass

import httpx
import pytest
import torch

from model_family.distill import greedy_continue

pytestmark = pytest.mark.slow

MODEL = "cosine-target"
NEW = 48


@dataclass(frozen=True)
class Layout:
    """What a test deploys: drafters autoscaling between `low` and `high` replicas."""
    drafters: tuple[str, ...]
    low: int
    high: int
    k: int
    adaptive_drafters: bool


# the ramp: one replica each at rest, two under load; the layout the redeploy changes to swaps a drafter for
# another, lowers k and lets drafters go to zero (routed rounds only: rounds the controller put on the generalist
# would keep the domain drafters at zero). Two drafters each (both draft every request: drafters_per_request 2):
# every replica started costs seconds of both cores
RAMP = Layout(("code", "generic"), low=1, high=2, k=4, adaptive_drafters=True)
ZERO = Layout(("biomedical", "generic"), low=0, high=1, k=2, adaptive_drafters=False)


def serve_config(port: int, layout: Layout) -> dict:
    # a replica takes seconds to start on a busy machine, and the test thresholds put the drafting demand close to
    # one replica's share: downscaling waits 20 s, so a dip while the new replica starts does not stop it (with 4 s
    # a fresh-clone run under load flip-flopped one deployment between 1 and 2 for 8 minutes, never running 2)
    scaling = {"min_replicas": layout.low, "max_replicas": layout.high, "initial_replicas": 1,
               "metrics_interval_s": 0.5, "look_back_period_s": 2.0, "upscale_delay_s": 1.0,
               "downscale_delay_s": 20.0}
    if layout.low == 0:
        # going to zero is no flip-flop risk (a drafter at zero comes back for the next routed round, without
        # Serve's upscale delay), and idle is idle: the last test waits 6 s of it, not 20
        scaling["downscale_to_zero_delay_s"] = 6.0
    # drafts may wait 8 s (0.8 x draft_timeout_ms): a replica's first calls on a busy machine take seconds, and a
    # call past the round's end counts as a drafter failure, which these tests assert never happens
    args = {
        "ingress": {"model_name": MODEL, "max_queued_requests": 32},
        "verifier": {"engine": "vllm", "model": "target", "max_batch": 8, "max_len": 384, "kv_cache_gib": 1},
        # the guard off: the replicas follow the drafting these tests load on, and on a shared 2-core CPU the guard
        # may rightly find speculation slower than plain decoding and switch it off (tests/test_guard.py)
        "speculation": {"mode": "cosine", "k": layout.k, "draft_timeout_ms": 10000,
                        "adaptive_drafters": layout.adaptive_drafters, "guard": {"enabled": False}},
        "routing": {"drafters_per_request": 2},
        "drafters": [{"name": d, "model": f"drafter-{d}", "generalist": d == "generic", "max_len": 384,
                      "deployment": {"autoscaling_config": scaling}} for d in layout.drafters],
    }
    return {"proxy_location": "HeadOnly", "http_options": {"host": "127.0.0.1", "port": port},
            "applications": [{"name": "cosine", "route_prefix": "/", "import_path": "serve_app.graph:build_app",
                              "autoscaling_policy": {"policy_function": "autoscale.policy:DrafterAutoscaler",
                                                     "policy_kwargs": {"target_utilization": 0.05,
                                                                       "smoothing": 1.0}},
                              "args": args}]}


def _drafter_replicas() -> dict[str, int]:
    from ray import serve

    app = serve.status().applications.get("cosine")
    if app is None:
        return {}
    return {name: sum(n for state, n in d.replica_states.items() if state == "RUNNING")
            for name, d in app.deployments.items() if name.startswith("Drafter-")}


def _replica_ids() -> set[str]:
    """The application's replica actors (named SERVE_REPLICA::app#deployment#id)."""
    import ray

    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith("SERVE_REPLICA::cosine#")}


def _wait_for(what, seconds: float = 240, every: float = 0.5):
    deadline = time.time() + seconds
    while time.time() < deadline and not what():
        time.sleep(every)
    return what()


class Cluster:
    """One local Ray cluster with its dashboard (Serve's REST API) and metrics agent; `deploy` puts a layout on it
    as `serve deploy` does and returns once the new version serves and no replica of an older one is left."""

    def __init__(self):
        import ray
        from ray.dashboard.modules.serve.sdk import ServeSubmissionClient

        from serve_app.launch import serve_env
        from serve_app.ray_start import start_with_retry
        from tests.conftest import RAY_TMP, free_port, head_env

        self.port, self.metrics_port = free_port(), free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        with head_env(serve_env()):
            ctx = start_with_retry(lambda: ray.init(
                num_cpus=4, include_dashboard=True, dashboard_host="127.0.0.1", dashboard_port=free_port(),
                log_to_driver=False, _temp_dir=RAY_TMP, _metrics_export_port=self.metrics_port))
        self.client = ServeSubmissionClient(f"http://{ctx.dashboard_url}")
        self.layout: Layout | None = None

    def submit(self, layout: Layout) -> None:
        self.client.deploy_applications(serve_config(self.port, layout))
        self.layout = layout

    def deploy(self, layout: Layout) -> None:
        if self.layout == layout:
            return
        old = _replica_ids()
        self.submit(layout)
        assert _wait_for(lambda: self._answers() and not _replica_ids() & old and self._running(), 480, 1), \
            "the application did not serve its new version in 480 s"

    def stats(self) -> dict:
        return httpx.get(f"{self.base}/v1/internal/speculation_stats", timeout=30).json()

    def describe(self) -> str:
        from ray import serve

        app = serve.status().applications.get("cosine")
        return "no application" if app is None else f"{app.status}: " + ", ".join(
            f"{name} {d.status} {d.replica_states}" for name, d in app.deployments.items())

    def _running(self) -> bool:
        from ray import serve

        app = serve.status().applications.get("cosine")
        return app is not None and app.status == "RUNNING"

    def _answers(self) -> bool:
        try:
            return httpx.post(f"{self.base}/v1/completions", timeout=30,
                              json={"model": MODEL, "prompt": "Hi", "max_tokens": 1}).status_code == 200
        except httpx.HTTPError:
            return False


@pytest.fixture(scope="module")
def cluster():
    from tests.conftest import stop_ray

    try:
        yield Cluster()
    finally:
        stop_ray()


async def _complete(client: httpx.AsyncClient, base: str, prompt: list[int], stream: bool) -> tuple[int, str]:
    """(status, text); a stream counts as 200 only if it ends with [DONE] and carries no error event."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": NEW, "temperature": 0, "ignore_eos": True,
            "stream": stream}
    if not stream:
        r = await client.post(f"{base}/v1/completions", json=body)
        return r.status_code, r.json()["choices"][0]["text"] if r.status_code == 200 else r.text
    async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
        events = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
    if r.status_code != 200 or not events or events[-1] != "[DONE]":
        return r.status_code or 0, f"stream cut: {events[-2:]}"
    chunks = [json.loads(e) for e in events[:-1]]
    if any("error" in c for c in chunks):
        return 500, f"error event: {chunks}"
    return 200, "".join(c["choices"][0]["text"] for c in chunks)


async def _load(base: str, prompts: list[list[int]], concurrency: int, until, results: list,
                stream_every: int = 0) -> None:
    """`concurrency` clients, each sending the prompts in turn until `until()`; every client i with
    `stream_every` and i % stream_every == 1 streams. Every answer is kept: (prompt, start, end, status, text)."""
    async with httpx.AsyncClient(timeout=300) as client:
        async def worker(i: int) -> None:
            j = i
            while not until():
                prompt, t = prompts[j % len(prompts)], time.time()
                j += concurrency
                status, text = await _complete(client, base, prompt, bool(stream_every) and i % stream_every == 1)
                results.append((prompt, t, time.time(), status, text))

        await asyncio.gather(*(worker(i) for i in range(concurrency)))


_REFERENCE: dict[tuple[int, ...], str] = {}  # prompt -> the target's greedy text, shared by the tests


def _check_outputs(results: list, target, tokenizer) -> None:
    """Every request answered 200 with the target's own greedy continuation."""
    assert results and all(r[3] == 200 for r in results), [r[3:] for r in results if r[3] != 200][:3]
    reference = _REFERENCE
    for prompt, *_, text in results:
        key = tuple(prompt)
        if key not in reference:
            want = greedy_continue(target, torch.tensor([prompt]), NEW)[0, len(prompt):].tolist()
            reference[key] = tokenizer.decode(want, skip_special_tokens=True)
        assert text == reference[key]


def _prompts(tokenizer, heldout, domains=("code", "legal", "literature"), rows=(0, 1, 2)) -> list[list[int]]:
    return [tokenizer(heldout[d][i][:300], add_special_tokens=False).input_ids for d in domains for i in rows]


def test_a_load_ramp_scales_drafters_up_and_down_without_changing_any_output(cluster, tokenizer, target, heldout):
    cluster.deploy(RAMP)
    base, drafters = cluster.base, RAMP.drafters
    prompts = _prompts(tokenizer, heldout)
    assert _wait_for(lambda: _drafter_replicas() == {f"Drafter-{d}": 1 for d in drafters}, 60), _drafter_replicas()

    results: list = []
    trace: list[tuple[float, dict[str, int]]] = []
    t0 = time.time()

    def stop_at(seconds: float, when=None):
        return lambda: time.time() - t0 > seconds or (when is not None and when())

    def scaled_up() -> bool:
        replicas = _drafter_replicas()
        trace.append((time.time() - t0, replicas))
        return any(n > 1 for n in replicas.values())

    asyncio.run(_load(base, prompts, 1, stop_at(8), results))  # low
    asyncio.run(_load(base, prompts, 8, stop_at(480, scaled_up), results))  # high, until scaled up
    assert any(n > 1 for _, r in trace for n in r.values()), f"no drafter scaled up under load: {trace}"
    asyncio.run(_load(base, prompts, 8, stop_at(time.time() - t0 + 6), results))  # with new replicas
    _wait_for(lambda: not any(n > 1 for n in _drafter_replicas().values()), 240, 1)  # idle: back down
    assert _drafter_replicas() == {f"Drafter-{d}": 1 for d in drafters}, f"did not scale down: {trace}"
    # after scaling down, under a light load that keeps the gauges fresh (Ray's agent exports what was set
    # lately): operators see the decisions, the policy's gauges (exported from Serve's controller) and the chosen k
    wanted = ('cosine_autoscaler_target_replicas{', 'drafter="code"', "cosine_autoscaler_drafting_demand",
              "cosine_draft_length_bucket", 'cosine_goodput{', 'source="predicted"', 'source="measured"')
    seen: set[str] = set()

    def exported() -> bool:
        text = httpx.get(f"http://127.0.0.1:{cluster.metrics_port}/metrics", timeout=30).text
        seen.update(w for w in wanted if w in text)
        return len(seen) == len(wanted)

    deadline = time.time() + 180
    asyncio.run(_load(base, prompts, 2, lambda: exported() or time.time() > deadline, results))
    assert seen == set(wanted), [w for w in wanted if w not in seen]

    _check_outputs(results, target, tokenizer)
    assert cluster.stats()["drafter_failures"] == 0


def test_a_redeploy_under_load_loses_no_request_and_changes_no_output(cluster, tokenizer, target, heldout):
    """Every key under the application's `args` reaches every deployment, so any change there is a new version of
    each one: Serve replaces every replica. With the graph's `max_surge_percent: 100` the old replicas keep serving
    until their replacements are ready, and finish what they hold (`graceful_shutdown_timeout_s`). The new config
    (a drafter swapped for another, k lowered) must be the one serving afterwards. Two clients keep requests in
    flight through the swap; four kept both cores busy and doubled the new replicas' start."""
    cluster.deploy(RAMP)
    base = cluster.base
    prompts = _prompts(tokenizer, heldout, ("code", "legal", "biomedical"), (50, 51))
    old = _replica_ids()

    results: list = []
    stop = threading.Event()
    load = threading.Thread(target=lambda: asyncio.run(_load(base, prompts, 2, stop.is_set, results, 2)))
    load.start()
    try:
        assert _wait_for(lambda: len(results) >= 2, 180)  # requests answered by the old version
        t_deploy = time.time()
        cluster.submit(ZERO)
        assert _wait_for(lambda: not _replica_ids() & old and cluster._running(), 480, 1), \
            f"old replicas still run: {sorted(_replica_ids() & old)}, {cluster.describe()}"
        t_replaced = time.time()
        answered = len(results)
        assert _wait_for(lambda: len(results) >= answered + 2, 180)  # requests answered by the new version
    finally:
        stop.set()
        load.join(300)
    assert not load.is_alive()

    # the new config serves: the added drafter drafts. Asked after the load, one request at a time: under the load
    # the goodput controller may rightly give no drafts on a busy 2-core machine (the drafters then go to their
    # minimum, zero here; a request speculated for brings one replica back, tests below)
    usages: list[dict] = []

    def biomedical_drafts() -> bool:
        r = httpx.post(f"{base}/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": prompts[4], "max_tokens": 32, "temperature": 0,
            "speculation": {"drafters": ["biomedical"]}})
        assert r.status_code == 200, r.text
        usages.append(r.json()["usage"])
        return usages[-1]["num_accepted_tokens"] > 0

    assert _wait_for(biomedical_drafts, 180, 1), (usages[-3:], cluster.stats(), cluster.describe())

    assert any(t0 < t_deploy for _, t0, *_ in results) and any(t1 > t_replaced for _, _, t1, *_ in results)
    assert sum(t0 < t_replaced and t1 > t_deploy for _, t0, t1, *_ in results) >= 4  # in flight during the swap
    _check_outputs(results, target, tokenizer)


def test_drafters_go_to_zero_without_traffic_and_come_back_for_it_without_changing_any_output(cluster, tokenizer,
                                                                                               target, heldout):
    """min_replicas: 0. With no requests the verifier reports no rounds and every drafter goes to zero; the
    speculation node parks them (no call waits at an empty deployment). Requests then run without drafts while
    the verifier's signal brings one replica of each back (Serve skips the upscale delay from zero), after which
    they draft again; every output is the target's own."""
    cluster.deploy(ZERO)
    base, drafters = cluster.base, ZERO.drafters
    prompts = _prompts(tokenizer, heldout)

    zero = {f"Drafter-{d}": 0 for d in drafters}
    assert _wait_for(lambda: _drafter_replicas() == zero), f"idle drafters stayed: {_drafter_replicas()}"
    # the speculation node sees it within its poll period (until then a call would wait at the empty handle)
    assert _wait_for(lambda: set(cluster.stats()["drafters_parked"]) == set(drafters), 60)
    # before they went; failures counted from here (the redeploy before this test may have had its own)
    calls_before, failures_before = (cluster.stats()[k] for k in ("drafter_calls", "drafter_failures"))
    results: list = []
    done = threading.Event()
    load = threading.Thread(target=lambda: asyncio.run(_load(base, prompts, 2, done.is_set, results)))
    load.start()
    try:
        assert _wait_for(lambda: len(results) >= 2, 180)  # answered while the drafters were at zero
        st = cluster.stats()  # one read: while every drafter is still parked, none was called
        assert set(st["drafters_parked"]) != set(drafters) or st["drafter_calls"] == calls_before
        back = {f"Drafter-{d}": 1 for d in drafters}
        assert _wait_for(lambda: _drafter_replicas() == back), f"drafters did not come back: {_drafter_replicas()}"
        assert _wait_for(lambda: not cluster.stats()["drafters_parked"], 60)
        answered = len(results)
        assert _wait_for(lambda: len(results) >= answered + 4, 180)  # drafting again
    finally:
        done.set()
        load.join()
    after = cluster.stats()
    assert after["drafter_calls"] > calls_before and after["drafter_failures"] == failures_before, \
        (failures_before, after)
    _check_outputs(results, target, tokenizer)
