"""`serve deploy` of a changed config while requests run, on a local Ray cluster, deployed the way `serve deploy`
does (Serve's REST API).

Every key under the application's `args` reaches every deployment, so any change there is a new version of each
one: Serve replaces every replica. With the graph's `max_surge_percent: 100` the old replicas keep serving until
their replacements are ready, and finish what they hold (`graceful_shutdown_timeout_s`). No request may fail or
change its output (greedy output equals target-only decoding, streamed or not), and the new config must be the one
serving afterwards (here: a drafter added, k lowered).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
import torch

from model_family.distill import greedy_continue

pytestmark = pytest.mark.slow

MODEL = "cosine-target"
NEW = 40


def serve_config(port: int, k: int, drafters: tuple[str, ...]) -> dict:
    args = {
        "ingress": {"model_name": MODEL, "max_queued_requests": 32},
        "verifier": {"engine": "vllm", "model": "target", "max_batch": 8, "max_len": 384, "kv_cache_gib": 1},
        "speculation": {"mode": "cosine", "k": k, "draft_timeout_ms": 2000},
        "routing": {"drafters_per_request": 2},
        "drafters": [{"name": d, "model": f"drafter-{d}", "generalist": d == "generic", "max_len": 384}
                     for d in drafters],
    }
    return {"proxy_location": "HeadOnly", "http_options": {"host": "127.0.0.1", "port": port},
            "applications": [{"name": "cosine", "route_prefix": "/", "import_path": "serve_app.graph:build_app",
                              "args": args}]}


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


def _load(base: str, prompts: list[list[int]], stop: threading.Event, results: list) -> None:
    """Four clients, half streaming, sending the prompts in turn until `stop`: (prompt, start, end, status, text)."""
    async def run() -> None:
        async with httpx.AsyncClient(timeout=300) as client:
            async def worker(i: int) -> None:
                j = i
                while not stop.is_set():
                    prompt, t = prompts[j % len(prompts)], time.time()
                    status, text = await _complete(client, base, prompt, stream=i % 2 == 1)
                    results.append((prompt, t, time.time(), status, text))
                    j += 4

            await asyncio.gather(*(worker(i) for i in range(4)))

    asyncio.run(run())


def _replica_ids() -> set[str]:
    """The application's replica actors (named SERVE_REPLICA::app#deployment#id)."""
    import ray

    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith("SERVE_REPLICA::cosine#")}


def test_a_redeploy_under_load_loses_no_request_and_changes_no_output(tokenizer, target, heldout):
    import ray
    from ray import serve
    from ray.dashboard.modules.serve.sdk import ServeSubmissionClient

    from serve_app.launch import serve_env
    from tests.conftest import RAY_TMP, free_port

    port, dash = free_port(), free_port()
    base = f"http://127.0.0.1:{port}"
    prompts = [tokenizer(heldout[d][i][:300], add_special_tokens=False).input_ids
               for d in ("code", "legal", "biomedical") for i in (50, 51)]
    ctx = ray.init(num_cpus=4, include_dashboard=True, dashboard_host="127.0.0.1", dashboard_port=dash,
                   log_to_driver=False, _temp_dir=RAY_TMP, runtime_env={"env_vars": serve_env()})
    try:
        client = ServeSubmissionClient(f"http://{ctx.dashboard_url}")
        client.deploy_applications(serve_config(port, 4, ("code", "legal", "generic")))
        deadline = time.time() + 300
        while time.time() < deadline:
            try:
                if httpx.post(f"{base}/v1/completions", timeout=30,
                              json={"model": MODEL, "prompt": "Hi", "max_tokens": 1}).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        old = _replica_ids()

        results: list = []
        stop = threading.Event()
        load = threading.Thread(target=_load, args=(base, prompts, stop, results))
        load.start()
        time.sleep(4)
        t_deploy = time.time()
        client.deploy_applications(serve_config(port, 2, ("code", "legal", "generic", "biomedical")))
        deadline = time.time() + 300  # until every old replica is gone
        while time.time() < deadline and (_replica_ids() & old
                                          or serve.status().applications["cosine"].status != "RUNNING"):
            time.sleep(1)
        t_replaced = time.time()
        time.sleep(4)
        stop.set()
        load.join(300)
        assert not load.is_alive()
        assert not _replica_ids() & old, "old replicas still running"

        assert all(status == 200 for *_, status, _ in results), [r[3:] for r in results if r[3] != 200][:3]
        # requests ran before, during and after the replacement
        assert any(t0 < t_deploy for _, t0, *_ in results) and any(t1 > t_replaced for _, _, t1, *_ in results)
        assert sum(t0 < t_replaced and t1 > t_deploy for _, t0, t1, *_ in results) >= 4
        want = {}
        for prompt, *_, text in results:
            key = tuple(prompt)
            if key not in want:
                ids = greedy_continue(target, torch.tensor([prompt]), NEW)[0, len(prompt):].tolist()
                want[key] = tokenizer.decode(ids, skip_special_tokens=True)
            assert text == want[key]

        # the new config serves: the added drafter drafts
        r = httpx.post(f"{base}/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": prompts[4], "max_tokens": 32, "temperature": 0,
            "speculation": {"drafters": ["biomedical"]}})
        assert r.status_code == 200 and r.json()["usage"]["num_accepted_tokens"] > 0
    finally:
        serve.shutdown()
        ray.shutdown()
