"""The drafter autoscaler end to end: the served application on a local Ray cluster, deployed as `serve deploy`
does (the application-level autoscaling policy applies only so), under a load ramp low -> high -> idle.

Drafter replicas must rise under load and fall back after it, and no request may fail or change its output while
replicas come and go (greedy output equals target-only decoding, token for token). The thresholds are set for
the small test models (drafting costs little next to verification here), not for production. Every wait is for a
condition, with bounds of minutes: on a slow, shared machine the same events come later, not differently.
"""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
import torch

from model_family.distill import greedy_continue

pytestmark = pytest.mark.slow

MODEL = "cosine-target"
DRAFTERS = ("code", "legal", "generic")
NEW = 48


def serve_config(port: int, low: int = 1, high: int = 2, adaptive_drafters: bool = True) -> dict:
    scaling = {"min_replicas": low, "max_replicas": high, "initial_replicas": 1, "metrics_interval_s": 0.5,
               "look_back_period_s": 2.0, "upscale_delay_s": 1.0, "downscale_delay_s": 4.0}
    args = {
        "ingress": {"model_name": MODEL, "max_queued_requests": 32},
        "verifier": {"engine": "vllm", "model": "target", "max_batch": 8, "max_len": 384, "kv_cache_gib": 1},
        "speculation": {"mode": "cosine", "k": 4, "draft_timeout_ms": 2000, "adaptive_drafters": adaptive_drafters},
        "routing": {"drafters_per_request": 2},
        "drafters": [{"name": d, "model": f"drafter-{d}", "generalist": d == "generic", "max_len": 384,
                      "deployment": {"autoscaling_config": scaling}} for d in DRAFTERS],
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


async def _load(base: str, prompts: list[list[int]], concurrency: int, until, results: list) -> None:
    """`concurrency` clients, each sending the prompts in turn until `until()`; every answer is kept."""
    async with httpx.AsyncClient(timeout=300) as client:
        async def worker(i: int) -> None:
            j = i
            while not until():
                prompt = prompts[j % len(prompts)]
                j += concurrency
                r = await client.post(f"{base}/v1/completions", json={
                    "model": MODEL, "prompt": prompt, "max_tokens": NEW, "temperature": 0, "ignore_eos": True})
                results.append((prompt, r.status_code, r.json()))

        await asyncio.gather(*(worker(i) for i in range(concurrency)))


def _prompts(tokenizer, heldout) -> list[list[int]]:
    return [tokenizer(heldout[d][i][:300], add_special_tokens=False).input_ids
            for d in ("code", "legal", "literature") for i in range(3)]


def _deploy(config: dict, metrics_port: int) -> None:
    """A local Ray cluster, the application deployed through Serve's REST API (as `serve deploy` does), and its
    first answer."""
    import ray
    from ray.dashboard.modules.serve.sdk import ServeSubmissionClient

    from serve_app.launch import serve_env
    from tests.conftest import RAY_TMP, free_port

    ctx = ray.init(num_cpus=4, include_dashboard=True, dashboard_host="127.0.0.1", dashboard_port=free_port(),
                   log_to_driver=False, _temp_dir=RAY_TMP, runtime_env={"env_vars": serve_env()},
                   _metrics_export_port=metrics_port)
    ServeSubmissionClient(f"http://{ctx.dashboard_url}").deploy_applications(config)
    base = f"http://127.0.0.1:{config['http_options']['port']}"
    deadline = time.time() + 300
    while time.time() < deadline:
        try:
            if httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1},
                          timeout=30).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError("the application did not answer in 300 s")


def _shutdown() -> None:
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()


def _check_outputs(results: list, target, tokenizer) -> None:
    """Every request answered 200 with the target's own greedy continuation."""
    assert results and all(status == 200 for _, status, _ in results), [r for r in results if r[1] != 200][:3]
    reference = {}
    for prompt, _, body in results:
        key = tuple(prompt)
        if key not in reference:
            want = greedy_continue(target, torch.tensor([prompt]), NEW)[0, len(prompt):].tolist()
            reference[key] = tokenizer.decode(want, skip_special_tokens=True)
        assert body["choices"][0]["text"] == reference[key]


def test_a_load_ramp_scales_drafters_up_and_down_without_changing_any_output(tokenizer, target, heldout):
    from tests.conftest import free_port

    port, metrics_port = free_port(), free_port()
    prompts = _prompts(tokenizer, heldout)
    try:
        _deploy(serve_config(port), metrics_port)
        base = f"http://127.0.0.1:{port}"
        assert _drafter_replicas() == {f"Drafter-{d}": 1 for d in DRAFTERS}

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
        asyncio.run(_load(base, prompts, 8, stop_at(240, scaled_up), results))  # high, until scaled up
        assert any(n > 1 for _, r in trace for n in r.values()), f"no drafter scaled up under load: {trace}"
        asyncio.run(_load(base, prompts, 8, stop_at(time.time() - t0 + 6), results))  # with new replicas
        deadline = time.time() + 240  # idle: back down
        while time.time() < deadline and any(n > 1 for n in _drafter_replicas().values()):
            time.sleep(1)
        assert _drafter_replicas() == {f"Drafter-{d}": 1 for d in DRAFTERS}, f"did not scale down: {trace}"
        asyncio.run(_load(base, prompts, 2, stop_at(time.time() - t0 + 4), results))  # after scaling down

        _check_outputs(results, target, tokenizer)
        stats = httpx.get(f"{base}/v1/internal/speculation_stats", timeout=30).json()
        assert stats["drafter_failures"] == 0

        # operators see the decisions: the policy's gauges (exported from Serve's controller) and the chosen k
        wanted = ('cosine_autoscaler_target_replicas{', 'drafter="code"', "cosine_autoscaler_drafting_demand",
                  "cosine_draft_length_bucket", 'cosine_goodput{', 'source="predicted"', 'source="measured"')
        text, deadline = "", time.time() + 60
        while time.time() < deadline and not all(w in text for w in wanted):
            text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30).text
            time.sleep(2)
        assert all(w in text for w in wanted), [w for w in wanted if w not in text]
    finally:
        _shutdown()


def test_drafters_go_to_zero_without_traffic_and_come_back_for_it_without_changing_any_output(tokenizer, target,
                                                                                               heldout):
    """min_replicas: 0. With no requests the verifier reports no rounds and every drafter goes to zero; the
    speculation node parks them (no call waits at an empty deployment). Requests then run without drafts while
    the verifier's signal brings one replica of each back (Serve skips the upscale delay from zero), after which
    they draft again; every output is the target's own."""
    from tests.conftest import free_port

    port, metrics_port = free_port(), free_port()
    prompts = _prompts(tokenizer, heldout)
    base = f"http://127.0.0.1:{port}"

    def stats() -> dict:
        return httpx.get(f"{base}/v1/internal/speculation_stats", timeout=30).json()

    def wait_for(what, seconds: float = 240):
        deadline = time.time() + seconds
        while time.time() < deadline and not what():
            time.sleep(0.5)
        return what()

    try:
        # routed rounds only: rounds the controller put on the generalist would keep the domain drafters at zero
        _deploy(serve_config(port, low=0, high=1, adaptive_drafters=False), metrics_port)
        zero = {f"Drafter-{d}": 0 for d in DRAFTERS}
        assert wait_for(lambda: _drafter_replicas() == zero), f"idle drafters stayed: {_drafter_replicas()}"
        # the speculation node sees it within its poll period (until then a call would wait at the empty handle)
        assert wait_for(lambda: set(stats()["drafters_parked"]) == set(DRAFTERS), 60)
        calls_before = stats()["drafter_calls"]  # the first answer's, before they went
        results: list = []
        done = threading.Event()
        load = threading.Thread(target=lambda: asyncio.run(_load(base, prompts, 2, done.is_set, results)))
        load.start()
        try:
            assert wait_for(lambda: len(results) >= 2, 180)  # answered while the drafters were at zero
            st = stats()  # one read: while every drafter is still parked, none was called
            assert set(st["drafters_parked"]) != set(DRAFTERS) or st["drafter_calls"] == calls_before
            back = {f"Drafter-{d}": 1 for d in DRAFTERS}
            assert wait_for(lambda: _drafter_replicas() == back), f"drafters did not come back: {_drafter_replicas()}"
            assert wait_for(lambda: not stats()["drafters_parked"], 60)
            answered = len(results)
            assert wait_for(lambda: len(results) >= answered + 4, 180)  # drafting again
        finally:
            done.set()
            load.join()
        after = stats()
        assert after["drafter_calls"] > calls_before and after["drafter_failures"] == 0
        _check_outputs(results, target, tokenizer)
    finally:
        _shutdown()
