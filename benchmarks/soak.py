"""`cosine bench soak`: a long mixed run against the served graph, to show that nothing grows and nothing is lost.

One Serve config (default examples/local.yaml) is deployed with `cosine serve` on loopback ports of its own.
Clients then arrive (Poisson) for `duration` seconds, in cycles of `period` seconds: the first part of each cycle
at `rate` requests/s, the rest at `overload_rate` (above what the graph can serve, so requests queue and some are
refused with 429). Each request takes a held-out prompt of a random domain, streams or not (half each), and a
share of clients hang up midway (a streamed one after a few chunks, a non-streamed one by a short read timeout).
Bounded in requests (`max_requests`) and time; loopback only.

Reported: requests and outcomes by kind (completed, hung up by the client on purpose, refused with 429, failed,
by HTTP status or exception), p50 / p99 latency of completed requests, and at start and end each Serve replica's
resident memory (its process, read with psutil) with the verifier's requests in flight and the requests the
drafters hold a cache for. After the run, once the last request has ended, both counts must be back to 0.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
import uuid
from collections import Counter
from dataclasses import dataclass

import httpx

from benchmarks.common import ServedApp, heldout_prompts
from benchmarks.load import arrivals
from benchmarks.metrics import save_json


@dataclass(frozen=True)
class Plan:
    """One client: when it arrives, what it asks and how it behaves."""

    at: float
    prompt: int  # index into the prompt list
    stream: bool
    hang_up: bool


def schedule(duration: float, rate: float, overload_rate: float, period: float, overload_share: float,
             hang_up_share: float, prompts: int, max_requests: int, seed: int) -> list[Plan]:
    """Arrivals over `duration` s: per cycle of `period` s, Poisson at `rate`, then at `overload_rate` for the
    cycle's last `overload_share`; at most `max_requests`."""
    rng = random.Random(seed)
    times: list[float] = []
    start = 0.0
    while start < duration:
        calm = min(period * (1 - overload_share), duration - start)
        busy = min(period * overload_share, duration - start - calm)
        times += [start + t for t in arrivals(rate, calm, rng.randrange(1 << 30), cap=max_requests)]
        if busy > 0:
            times += [start + calm + t for t in arrivals(overload_rate, busy, rng.randrange(1 << 30),
                                                         cap=max_requests)]
        start += period
    return [Plan(t, rng.randrange(prompts), rng.random() < 0.5, rng.random() < hang_up_share)
            for t in sorted(times)[:max_requests]]


async def _one(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], plan: Plan,
               max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": plan.stream}
    t0 = time.perf_counter()
    try:
        if plan.stream:
            async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
                if r.status_code != 200:
                    return {"outcome": "refused (429)" if r.status_code == 429 else f"HTTP {r.status_code}"}
                chunks, error = 0, None
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunks += 1
                    payload = json.loads(line[6:])
                    if "error" in payload:
                        error = payload["error"].get("type", "stream error")
                    if plan.hang_up and chunks >= 3:
                        return {"outcome": "hung up (client)"}
                if error:
                    return {"outcome": f"stream error: {error}"}
        else:
            timeout = httpx.Timeout(300, read=0.5) if plan.hang_up else None
            r = await client.post(f"{url}/v1/completions", json=body,
                                  **({"timeout": timeout} if timeout else {}))
            if r.status_code != 200:
                return {"outcome": "refused (429)" if r.status_code == 429 else f"HTTP {r.status_code}"}
    except httpx.ReadTimeout:
        if plan.hang_up and not plan.stream:
            return {"outcome": "hung up (client)"}
        return {"outcome": "ReadTimeout"}
    except httpx.HTTPError as e:
        return {"outcome": type(e).__name__}
    return {"outcome": "completed", "latency": time.perf_counter() - t0}


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(results: list[dict]) -> dict:
    outcomes = Counter(r["outcome"] for r in results)
    latencies = [r["latency"] for r in results if r["outcome"] == "completed"]
    expected = {"completed", "hung up (client)", "refused (429)"}
    return {"requests": len(results), "outcomes": dict(outcomes),
            "failed": sum(n for k, n in outcomes.items() if k not in expected),
            "latency_s_p50": percentile(latencies, 0.5), "latency_s_p99": percentile(latencies, 0.99)}


def snapshot(url: str, dashboard: str) -> dict:
    """Each Serve replica's resident memory (MB), the verifier's requests in flight and the requests drafters
    hold a cache for."""
    import psutil
    from ray.dashboard.modules.serve.sdk import ServeSubmissionClient

    replicas = {}
    for app in ServeSubmissionClient(dashboard).get_serve_details().get("applications", {}).values():
        for name, d in app.get("deployments", {}).items():
            for i, r in enumerate(d.get("replicas", [])):
                try:
                    replicas[f"{name}#{i}"] = round(psutil.Process(r["pid"]).memory_info().rss / 2**20)
                except (psutil.Error, KeyError, TypeError):
                    replicas[f"{name}#{i}"] = None
    stats = httpx.get(f"{url}/v1/internal/speculation_stats", timeout=30, headers=_auth()).json()
    return {"replica_rss_mb": replicas, "requests_in_flight": stats.get("requests_in_flight"),
            "drafter_requests_held": stats.get("requests_held")}


def _auth() -> dict:
    key = os.environ.get("COSINE_API_KEY")
    return {"authorization": f"Bearer {key}"} if key else {}


def run(config: str, duration: float, rate: float, overload_rate: float, period: float, overload_share: float,
        hang_up_share: float, max_requests: int, max_tokens: int, port: int, log=print) -> dict:
    from model_family.paths import model_path
    from transformers import AutoTokenizer

    os.environ.setdefault("RAY_AUTH_MODE", "token")  # one token for the Ray cluster and this process's REST client
    os.environ.setdefault("RAY_AUTH_TOKEN", uuid.uuid4().hex)
    prompts = [p for _, p in heldout_prompts(AutoTokenizer.from_pretrained(model_path("tokenizer")), 8, 64)]
    plans = schedule(duration, rate, overload_rate, period, overload_share, hang_up_share, len(prompts),
                     max_requests, seed=0)
    log(f"{len(plans)} requests over {duration:.0f} s; deploying {config}")
    served = ServedApp(config, port, port + 1)
    dashboard = f"http://127.0.0.1:{port + 1}"
    try:
        warm = schedule(10, 1.0, 1.0, 10, 0.0, 0.0, len(prompts), 8, seed=1)
        _drive(served.url, served.model, prompts, warm, max_tokens, log=lambda *_: None)
        start = snapshot(served.url, dashboard)
        results = _drive(served.url, served.model, prompts, plans, max_tokens, log)
        time.sleep(5)  # cancellations and releases still travelling
        end = snapshot(served.url, dashboard)
    finally:
        served.stop()
    return {"config": {"base": config, "duration_s": duration, "rate": rate, "overload_rate": overload_rate,
                       "period_s": period, "overload_share": overload_share, "hang_up_share": hang_up_share,
                       "max_tokens": max_tokens},
            "summary": summarize(results), "start": start, "end": end}


def _drive(url: str, model: str, prompts: list[list[int]], plans: list[Plan], max_tokens: int, log) -> list[dict]:
    async def go():
        limits = httpx.Limits(max_connections=512, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=300, limits=limits, headers=_auth()) as client:
            t0, done = time.perf_counter(), Counter()

            async def at(plan: Plan):
                await asyncio.sleep(max(0.0, t0 + plan.at - time.perf_counter()))
                out = await _one(client, url, model, prompts[plan.prompt], plan, max_tokens)
                done[out["outcome"]] += 1
                n = sum(done.values())
                if n % 100 == 0:
                    log(f"  [{time.perf_counter() - t0:6.0f} s] {n}/{len(plans)} requests: {dict(done)}")
                return out

            return await asyncio.gather(*(at(p) for p in plans))

    return asyncio.run(go())


def format_report(result: dict) -> str:
    s, cfg = result["summary"], result["config"]
    lines = [f"{s['requests']} requests in {cfg['duration_s']:.0f} s ({cfg['rate']}/s, {cfg['overload_rate']}/s for "
             f"{cfg['overload_share']:.0%} of every {cfg['period_s']:.0f} s; {cfg['hang_up_share']:.0%} of clients "
             f"hang up): failed {s['failed']}; latency of completed p50 {s['latency_s_p50']:.2f} s, "
             f"p99 {s['latency_s_p99']:.2f} s", "", "| outcome | requests |", "|---|---|"]
    lines += [f"| {k} | {n} |" for k, n in sorted(s["outcomes"].items(), key=lambda kv: -kv[1])]
    lines += ["", "| replica | RSS MB at start | RSS MB at end |", "|---|---|---|"]
    for name, mb in result["start"]["replica_rss_mb"].items():
        lines.append(f"| {name} | {mb} | {result['end']['replica_rss_mb'].get(name)} |")
    for key in ("requests_in_flight", "drafter_requests_held"):
        lines.append(f"| {key.replace('_', ' ')} | {result['start'][key]} | {result['end'][key]} |")
    return "\n".join(lines)


def main(args) -> int:
    result = run(args.config, args.duration, args.rate, args.overload_rate, args.period, args.overload_share,
                 args.hang_up_share, args.max_requests, args.max_tokens, args.port)
    save_json(result, args.json)
    print(format_report(result))
    ok = result["summary"]["failed"] == 0 and not result["end"]["requests_in_flight"] \
        and not result["end"]["drafter_requests_held"]
    print(f"\n{'nothing lost, nothing left behind' if ok else 'FAILURES or leftovers: see above'}")
    return 0 if ok else 1

