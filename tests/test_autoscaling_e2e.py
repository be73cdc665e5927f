"""The drafter autoscaler end to end: the served application on a local Ray cluster, deployed as `serve deploy`
does (the application-level autoscaling policy applies only so), under a load ramp low -> high -> idle.

Drafter replicas must rise under load and fall back after it, and no request may fail or change its output while
replicas come and go (greedy output equals target-only decoding, token for token). The thresholds are set for
the small test models (drafting costs little next to verification here), not for production.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import torch

from model_family.distill import greedy_continue

pytestmark = pytest.mark.slow

MODEL = "cosine-target"
DRAFTERS = ("code", "legal", "generic")
NEW = 48


def serve_config(port: int) -> dict:
    scaling = {"min_replicas": 1, "max_replicas": 2, "metrics_interval_s": 0.5, "look_back_period_s": 2.0,
               "upscale_delay_s": 1.0, "downscale_delay_s": 4.0}
    args = {
        "ingress": {"model_name": MODEL, "max_queued_requests": 32},
        "verifier": {"engine": "vllm", "model": "target", "max_batch": 8, "max_len": 384, "kv_cache_gib": 1},
        "speculation": {"mode": "cosine", "k": 4, "draft_timeout_ms": 2000},
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


def test_a_load_ramp_scales_drafters_up_and_down_without_changing_any_output(tokenizer, target, heldout):
    import ray
    from ray.dashboard.modules.serve.sdk import ServeSubmissionClient

    from serve_app.launch import serve_env
    from tests.conftest import RAY_TMP, free_port

    port, dash, metrics_port = free_port(), free_port(), free_port()
    prompts = [tokenizer(heldout[d][i][:300], add_special_tokens=False).input_ids
               for d in ("code", "legal", "literature") for i in range(3)]
    ctx = ray.init(num_cpus=4, include_dashboard=True, dashboard_host="127.0.0.1", dashboard_port=dash,
                   log_to_driver=False, _temp_dir=RAY_TMP, runtime_env={"env_vars": serve_env()},
                   _metrics_export_port=metrics_port)
    try:
        ServeSubmissionClient(f"http://{ctx.dashboard_url}").deploy_applications(serve_config(port))
        base = f"http://127.0.0.1:{port}"
        deadline = time.time() + 300
        while time.time() < deadline:
            try:
                if httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1},
                              timeout=30).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
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
        asyncio.run(_load(base, prompts, 8, stop_at(90, scaled_up), results))  # high, until scaled up
        assert any(n > 1 for _, r in trace for n in r.values()), f"no drafter scaled up under load: {trace}"
        asyncio.run(_load(base, prompts, 8, stop_at(time.time() - t0 + 6), results))  # with new replicas
        deadline = time.time() + 90  # idle: back down
        while time.time() < deadline and any(n > 1 for n in _drafter_replicas().values()):
            time.sleep(1)
        assert _drafter_replicas() == {f"Drafter-{d}": 1 for d in DRAFTERS}, f"did not scale down: {trace}"
        asyncio.run(_load(base, prompts, 2, stop_at(time.time() - t0 + 4), results))  # after scaling down

        assert results and all(status == 200 for _, status, _ in results), [r for r in results if r[1] != 200][:3]
        reference = {}
        for prompt, _, body in results:
            key = tuple(prompt)
            if key not in reference:
                want = greedy_continue(target, torch.tensor([prompt]), NEW)[0, len(prompt):].tolist()
                reference[key] = tokenizer.decode(want, skip_special_tokens=True)
            assert body["choices"][0]["text"] == reference[key]
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
        from ray import serve

        serve.shutdown()
        ray.shutdown()
