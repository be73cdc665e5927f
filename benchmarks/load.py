"""`cosine bench load`: Poisson arrivals from light load to beyond saturation, through the real HTTP endpoint.

Each system is a variant of one Serve config (default examples/bench.yaml, the bench target): fixed draft lengths k =
0 (speculation off), 2, 4, 6; the goodput controller (the default); the hill-climbing controller (Minions); the
goodput controller with a deployment per drafter (one replica each); and the same with the drafter autoscaler
(0-3 replicas each). Every system is deployed with `cosine serve` on loopback ports of its
own, warmed up, then driven at each rate for `duration` seconds with Poisson arrivals of held-out mixed-domain prompts
(streamed, so time to first token and time per output token are measured at the client; bounded in requests and
time), greedy or sampled (`--temperature`, `--top-p`, `--seed`: each request with its own seed, the same in every
system). Reported per system and rate: mean and p99 time per output token, mean time to first token, goodput (output
tokens per second of the window), errors, drafter replica-seconds (running `Drafter-*` replicas, polled from
Serve's REST API once a second), and the text statistics of the outputs (distinct tokens per output, repeated 4-gram
share); sampled, each system's outputs are checked against the target's distribution (benchmarks/sampled.py).
Systems are interleaved across repeats; each figure is the median over repeats with min and max.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import random
import statistics
import tempfile
import threading
import time
import uuid
from pathlib import Path

import httpx
import yaml

from benchmarks.common import ServedApp, heldout_prompts
from benchmarks.metrics import require_plotting, save_json
from benchmarks.sampled import P_FLOOR, Sampling, check_cell, distribution_pvalue, reference_model, text_columns
from model_family.text_stats import text_stats

AUTOSCALING = {"min_replicas": 0, "max_replicas": 3, "initial_replicas": 1, "metrics_interval_s": 1.0,
               "look_back_period_s": 5.0, "upscale_delay_s": 3.0, "downscale_delay_s": 15.0}
POLICY = {"policy_function": "autoscale.policy:DrafterAutoscaler"}
SYSTEMS = {
    "k=0": {"speculation": {"mode": "off"}},
    "k=2": {"speculation": {"adaptive": False, "k": 2}},
    "k=4": {"speculation": {"adaptive": False, "k": 4}},
    "k=6": {"speculation": {"adaptive": False, "k": 6}},
    "hill_climb": {"speculation": {"controller": {"kind": "hill_climb"}}},
    "goodput": {},
    # the autoscaler's layout (a deployment per drafter, one replica each) without it: what the autoscaler changes
    "goodput+deployments": {"speculation": {"drafting_tier": "deployments"}},
    "goodput+autoscaler": {"drafters": "autoscaled"},
    # what the autoscaled layout's served cost comes from: no Serve status poll (no drafter may go to zero), and
    # Serve's autoscaling metrics every 5 s instead of every second
    "goodput+autoscaler/min1": {"drafters": "autoscaled", "autoscaling": {"min_replicas": 1}},
    "goodput+autoscaler/metrics5s": {"drafters": "autoscaled", "autoscaling": {"metrics_interval_s": 5.0}},
}


def _merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in over.items():
        out[key] = _merge(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


def variant(base: dict, system: str) -> dict:
    """The Serve config of `system`: the base config's first application with the system's overrides."""
    cfg = copy.deepcopy(base)
    app = cfg["applications"][0]
    over = dict(SYSTEMS[system])
    scaling = {**AUTOSCALING, **over.pop("autoscaling", {})}
    if over.pop("drafters", None) == "autoscaled":  # drafters need deployments of their own to be scaled
        app["autoscaling_policy"] = dict(POLICY)
        over["speculation"] = {"drafting_tier": "deployments"}
        for d in app["args"]["drafters"]:
            d["deployment"] = {**d.get("deployment", {}), "autoscaling_config": dict(scaling)}
    app["args"] = _merge(app["args"], over)
    return cfg


def arrivals(rate: float, duration: float, seed: int, cap: int) -> list[float]:
    """Poisson arrival times in [0, duration), at most `cap` of them."""
    rng, t, out = random.Random(seed), 0.0, []
    while len(out) < cap:
        t += rng.expovariate(rate)
        if t >= duration:
            break
        out.append(t)
    return out


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100)[98] if len(values) > 1 else (values[0] if values else 0.0)


def replica_seconds(samples: list[tuple[float, int]]) -> float:
    """Integral of the running drafter replicas over time (left Riemann sum of the polled counts)."""
    return sum(n * (t1 - t0) for (t0, n), (t1, _) in zip(samples, samples[1:]))


def summarize(requests: list[dict], window: float, replicas: list[tuple[float, int]]) -> dict:
    ok = [r for r in requests if r.get("error") is None]
    tpot = [r["tpot"] for r in ok if r["tokens"] > 1]
    return {"requests": len(requests), "errors": len(requests) - len(ok),
            "tpot_ms_mean": 1000 * statistics.fmean(tpot) if tpot else 0.0, "tpot_ms_p99": 1000 * p99(tpot),
            "ttft_ms_mean": 1000 * statistics.fmean([r["ttft"] for r in ok]) if ok else 0.0,
            "goodput_tok_s": sum(r["tokens"] for r in ok) / window,
            "drafter_replica_s": replica_seconds(replicas)}


async def _request(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int,
                   sampling: dict | None = None) -> dict:
    """One streamed completion; `sampling`: its temperature, top_p and seed (greedy without)."""
    t0 = time.perf_counter()
    first, tokens, ids = None, 0, []
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True, **(sampling or {})}
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                return {"error": f"HTTP {r.status_code}"}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return {"error": chunk["error"]["type"]}
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                for c in chunk.get("choices", []):
                    ids += c.get("token_ids") or []
                if first is None and any(c.get("text") for c in chunk.get("choices", [])):
                    first = time.perf_counter()
    except httpx.HTTPError as e:
        return {"error": type(e).__name__}
    end = time.perf_counter()
    first = first or end
    return {"error": None, "ttft": first - t0, "tokens": tokens, "tpot": (end - first) / max(1, tokens - 1),
            "prompt": prompt, "output": ids}


def drive(url: str, model: str, prompts: list[list[int]], rate: float, duration: float, max_tokens: int,
          seed: int, sampling: Sampling = Sampling()) -> tuple[list[dict], float]:
    """Poisson arrivals at `rate` for `duration` s; waits for the requests it sent (5 min at most). Sampled, request
    i's seed is `sampling.seeds(..., seed + 1)[i]`: the same in every system driven with this arrival seed."""
    times = arrivals(rate, duration, seed, cap=int(rate * duration * 2) + 1)
    seeds = sampling.seeds(len(times), seed + 1)

    def params(i: int) -> dict | None:
        return None if seeds is None else {"temperature": sampling.temperature, "top_p": sampling.top_p,
                                           "seed": seeds[i]}

    async def go():
        async with httpx.AsyncClient(timeout=300) as client:
            start = time.perf_counter()

            async def at(i: int, t: float):
                await asyncio.sleep(max(0.0, start + t - time.perf_counter()))
                return await _request(client, url, model, prompts[i % len(prompts)], max_tokens, params(i))

            results = await asyncio.wait_for(asyncio.gather(*(at(i, t) for i, t in enumerate(times))), 300 + duration)
            return results, time.perf_counter() - start

    return asyncio.run(go())


class ReplicaPoller:
    """Running `Drafter-*` replicas over time, from Serve's REST API on the dashboard (what `serve status` reads)."""

    def __init__(self, dashboard: str, interval: float = 1.0):
        from ray.dashboard.modules.serve.sdk import ServeSubmissionClient

        self.client, self.interval = ServeSubmissionClient(dashboard), interval
        self.samples: list[tuple[float, int]] = []
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def count(self) -> int:
        apps = self.client.get_serve_details().get("applications", {})
        return sum(1 for app in apps.values() for name, d in app.get("deployments", {}).items()
                   if name.startswith("Drafter-") for r in d.get("replicas", []) if r.get("state") == "RUNNING")

    def _run(self) -> None:
        while not self.stopped.is_set():
            try:
                self.samples.append((time.perf_counter(), self.count()))
            except Exception:  # noqa: BLE001 - a missed poll only coarsens the integral
                pass
            self.stopped.wait(self.interval)

    def __enter__(self) -> ReplicaPoller:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopped.set()
        self.thread.join()


def run(config: str, systems: list[str], rates: list[float], duration: float, repeats: int, max_tokens: int,
        port: int, log=print, sampling: Sampling = Sampling()) -> dict:
    from config import AppConfig
    from model_family.paths import model_path
    from transformers import AutoTokenizer

    # one token for the systems' Ray clusters and this process's REST client (Ray's token authentication)
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    os.environ.setdefault("RAY_AUTH_TOKEN", uuid.uuid4().hex)
    prompts = [p for _, p in heldout_prompts(AutoTokenizer.from_pretrained(model_path("tokenizer")), 4, 64)]
    random.Random(0).shuffle(prompts)  # domains mixed in arrival order
    base = yaml.safe_load(Path(config).read_text())
    tmp = Path(tempfile.mkdtemp(prefix="cosine-load-"))
    configs = {}
    for s in systems:
        cfg = variant(base, s)
        AppConfig.model_validate(cfg["applications"][0]["args"])  # a bad variant fails before any deployment
        configs[s] = tmp / f"{s.replace('+', '_').replace('=', '')}.yaml"
        configs[s].write_text(yaml.safe_dump(cfg))
    runs: dict[tuple[str, float], list[dict]] = {}
    for rep in range(repeats):
        for i, (s, path) in enumerate(configs.items()):
            log(f"[{rep + 1}/{repeats}] [{i + 1}/{len(configs)}] {s}: deploying")
            served = ServedApp(str(path), port, port + 1)
            try:
                drive(served.url, served.model, prompts, 1.0, 8, 16, seed=99, sampling=sampling)  # warm-up
                with ReplicaPoller(f"http://127.0.0.1:{port + 1}") as poller:
                    for rate in rates:
                        t0 = time.perf_counter()
                        results, window = drive(served.url, served.model, prompts, rate, duration, max_tokens,
                                                seed=rep * 1000 + int(rate * 100), sampling=sampling)
                        samples = [x for x in poller.samples if x[0] >= t0]
                        row = summarize(results, window, samples)
                        row["outputs"] = [(r["prompt"], r["output"]) for r in results if r.get("error") is None]
                        stats = httpx.get(f"{served.url}/v1/internal/speculation_stats", timeout=30).json()
                        row["mean_k"] = (stats.get("controller") or {}).get("mean_k_recent")
                        row["replica_trace"] = [(round(t - t0, 1), n) for t, n in samples]
                        runs.setdefault((s, rate), []).append(row)
                        log(f"    rate {rate}/s: {row['goodput_tok_s']:.1f} tok/s, TPOT {row['tpot_ms_mean']:.1f} ms "
                            f"(p99 {row['tpot_ms_p99']:.1f}), {row['errors']} errors, "
                            f"{row['drafter_replica_s']:.0f} drafter replica-s, mean k {row['mean_k']}")
            finally:
                served.stop()
    rows = []
    for (s, rate), rs in runs.items():
        row = {"system": s, "rate": rate}
        for key in ("goodput_tok_s", "tpot_ms_mean", "tpot_ms_p99", "ttft_ms_mean", "drafter_replica_s", "errors"):
            vals = [r[key] for r in rs]
            row[key], row[key + "_min"], row[key + "_max"] = statistics.median(vals), min(vals), max(vals)
            row[key + "_by_repeat"] = vals  # in run order
        ks = [r["mean_k"] for r in rs if r.get("mean_k") is not None]
        row["mean_k"] = statistics.median(ks) if ks else None  # the controller's recent mean k (adaptive systems)
        row["replica_traces"] = [r["replica_trace"] for r in rs]
        row["text"] = text_stats([o for r in rs for _, o in r["outputs"]])
        rows.append(row)
    result = {"config": {"base": config, "rates": rates, "duration_s": duration, "repeats": repeats,
                         "max_tokens": max_tokens, "prompts": len(prompts), "sampling": sampling.as_dict()},
              "rows": rows, "warnings": []}
    if not sampling.greedy:
        verifier = AppConfig.model_validate(base["applications"][0]["args"]).verifier.model
        model = reference_model(model_path(verifier))
        for row in rows:  # every request of the system at this rate, all repeats
            pairs = [pair for r in runs[(row["system"], row["rate"])] for pair in r["outputs"]]
            test = distribution_pvalue(model, [p for p, _ in pairs], [[o for _, o in pairs]], sampling)
            row["distribution_p"], row["distribution_tokens"] = test["p"], test["tokens"]
            if test["p"] is not None and test["p"] < P_FLOOR:
                result["warnings"].append(f"{row['system']}, rate {row['rate']}: its sampled tokens do not follow "
                                          f"the target's distribution (chi-square p = {test['p']:.2g})")
                log("WARNING: " + result["warnings"][-1])
    return result


def format_table(result: dict) -> str:
    text_head, text_sep, text_cells = text_columns(result)
    sampled = not result["config"].get("sampling", {"greedy": True})["greedy"]
    check_head, check_sep = (" output: chi-square p vs the target's distribution |", "---|") if sampled else ("", "")
    lines = ["| system | rate req/s | goodput tok/s | TPOT mean ms | TPOT p99 ms | TTFT mean ms | drafter replica-s "
             "| mean k | errors |" + check_head + text_head,
             "|---|---|---|---|---|---|---|---|---|" + check_sep + text_sep]
    for r in sorted(result["rows"], key=lambda r: (r["rate"], r["system"])):
        k = "" if r.get("mean_k") is None else f"{r['mean_k']:.2f}"
        lines.append(f"| {r['system']} | {r['rate']} | {r['goodput_tok_s']:.1f} ({r['goodput_tok_s_min']:.1f}-"
                     f"{r['goodput_tok_s_max']:.1f}) | {r['tpot_ms_mean']:.1f} | {r['tpot_ms_p99']:.1f} "
                     f"| {r['ttft_ms_mean']:.0f} | {r['drafter_replica_s']:.0f} | {k} | {r['errors']:.0f} |"
                     + (f" {check_cell(r)} |" if sampled else "") + text_cells(r))
    if sampled:
        lines += ["", f"- sampling: {Sampling.of(result['config']['sampling']).describe()}"]
    lines += [f"- WARNING: {w}" for w in result.get("warnings", [])]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    """Goodput, time per output token and drafter replica-seconds by rate (matplotlib: `main` checks it is there)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for s in dict.fromkeys(r["system"] for r in result["rows"]):
        rows = sorted((r for r in result["rows"] if r["system"] == s), key=lambda r: r["rate"])
        x = [r["rate"] for r in rows]
        for ax, key in zip(axes, ("goodput_tok_s", "tpot_ms_mean", "drafter_replica_s")):
            ax.plot(x, [r[key] for r in rows], marker="o", label=s)
    for ax, title in zip(axes, ("goodput (tok/s)", "mean time per output token (ms)", "drafter replica-seconds")):
        ax.set_xlabel("arrival rate (requests/s)")
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(args) -> int:
    require_plotting(bool(args.plot))
    result = run(args.config, args.systems.split(","), [float(r) for r in args.rates.split(",")], args.duration,
                 args.repeats, args.max_tokens, args.port, sampling=Sampling.from_args(args))
    print(format_table(result))
    save_json(result, args.json)
    if args.plot:
        plot(result, Path(args.plot))
    return 0
