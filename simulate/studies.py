"""What `cosine simulate` answers: validation against a real run, the paper's settings, and drafter sizing.

Systems, as variants of one application config:
- `no-spec`: target-only decoding (speculation off);
- `vanilla`: the generic drafter's chain, k = 4 fixed, run on the verifier's GPUs (vLLM's draft_model);
- `cosine`: the config as given (routing, fusion, the goodput controller), one drafter replica per deployment,
  each on a drafter GPU of its own, drafting pipelined with verification;
- `cosine+autoscaler`: the same, each drafter deployment scaled by the project's autoscaling policy (min 1).
"""

from __future__ import annotations

import copy
import json
import statistics
import tempfile
from pathlib import Path

import yaml

from config import AppConfig
from simulate.cluster import Autoscaling, Simulation, Workload
from simulate.hardware import DRAFTER_SHAPES, PROFILES, Hardware, drafter_step, fit
from simulate.replay import ReplayRequest, annotate
from speculation.trace import Trace

SYSTEMS = ("no-spec", "vanilla", "cosine", "cosine+autoscaler")
PAPER = {"prompt_tokens": 256, "output_tokens": 128, "batches": (1, 2, 4, 8, 16),
         "claims": "latency -23.2% and throughput +32.5% vs the best baseline at equal cost; offline throughput "
                   "3.15-4.71x vLLM (LLaMA pair), 2.84-3.79x (Qwen pair); online latency 1.2-1.6x lower than SpecInfer"}


def app_args(config: str | Path) -> dict:
    """The application args of a Serve config file (its first application)."""
    return yaml.safe_load(Path(config).read_text())["applications"][0]["args"]


def system_config(args: dict, system: str, max_batch: int | None = None) -> tuple[AppConfig, dict]:
    """The AppConfig of `system` and the Simulation options it needs."""
    a = copy.deepcopy(args)
    a["speculation"] = dict(a.get("speculation", {}), record_trace=None)
    if max_batch:
        a["verifier"] = dict(a["verifier"], max_batch=max_batch)
    options: dict = {}
    if system == "no-spec":
        a["speculation"]["mode"] = "off"
    elif system == "vanilla":
        generic = next((d["name"] for d in a["drafters"] if d.get("generalist")), a["drafters"][0]["name"])
        a["speculation"].update(mode="chain", adaptive=False, k=4, fixed_drafters=[generic])
        options["colocated"] = True
    elif system == "cosine+autoscaler":
        options["autoscaling"] = Autoscaling()
    elif system != "cosine":
        raise ValueError(f"unknown system {system!r}; one of {SYSTEMS}")
    return AppConfig.model_validate(a), options


def load_replay(trace: list[str | Path], args: dict) -> list[ReplayRequest]:
    t = Trace.load(*trace)
    return annotate(t.requests, AppConfig.model_validate(args))


def simulate(args: dict, system: str, hw: Hardware, requests: list[ReplayRequest], workload: Workload,
             max_batch: int | None = None, slo_ms_per_token: float | None = None, **extra) -> dict:
    cfg, options = system_config(args, system, max_batch)
    return Simulation(cfg, hw, requests, **{**options, **extra}).run(workload).summary(slo_ms_per_token)


# ---------------------------------------------------------------------------------------------- validation
def validate(config: str, per_domain: int = 3, new_tokens: int = 128, concurrencies=(1, 4), repeats: int = 3,
             port: int = 8031, save_trace: Path | None = None, log=print) -> dict:
    """Run the served graph of `config` for real with a trace recorded, then simulate the same runs from the trace.
    The latency model is fitted on every measured run (in sample) and, per concurrency, on the other
    concurrencies' runs only (out of sample); acceptance is replayed."""
    from transformers import AutoTokenizer

    from benchmarks.anchors import _Served
    from benchmarks.engine import _prompts
    from model_family.paths import model_path

    args = app_args(config)
    work = Path(tempfile.mkdtemp(prefix="cosine-validate-"))
    trace_path = work / "trace.jsonl"
    serve_cfg = yaml.safe_load(Path(config).read_text())
    serve_cfg["applications"][0]["args"]["speculation"] = dict(args.get("speculation", {}),
                                                               record_trace=str(trace_path))
    (work / "serve.yaml").write_text(yaml.safe_dump(serve_cfg))
    tok = AutoTokenizer.from_pretrained(model_path(args.get("tokenizer", "tokenizer")))
    prompts = _prompts(tok, per_domain, 64)
    ids = [p for _, p in prompts]

    def lines() -> int:
        return len(trace_path.read_text().splitlines()) if trace_path.exists() else 0

    log(f"starting the served graph of {config} (trace: {trace_path})")
    served = _Served(str(work / "serve.yaml"), port, port + 1)
    runs = []
    try:
        served.run(ids[:4], 2, 16, None)  # warm-up
        for rep in range(repeats):
            for c in concurrencies:
                start = lines()
                res = served.run(ids, c, new_tokens, None)
                tokens = [len(o) for o in res["outputs"]]
                runs.append({"concurrency": c, "repeat": rep, "lines": (start, lines()),
                             "throughput_tok_s": sum(tokens) / res["wall"],
                             "latency_ms_per_token": 1000 * statistics.fmean(
                                 s / max(n, 1) for s, n in zip(res["seconds"], tokens)),
                             "client_seconds": res["seconds"]})
                log(f"  measured: concurrency {c}, repeat {rep + 1}/{repeats}: "
                    f"{runs[-1]['throughput_tok_s']:.1f} tok/s, {runs[-1]['latency_ms_per_token']:.1f} ms/token")
    finally:
        served.stop()
    all_lines = trace_path.read_text().splitlines()

    def segment(rs: list[dict]) -> Trace:
        path = work / "segment.jsonl"
        path.write_text("\n".join(line for r in rs for line in all_lines[r["lines"][0]:r["lines"][1]]) + "\n")
        t = Trace.load(path)
        # per request: what the client waited beyond the loop's own time (HTTP, tokenization, queueing at ingress)
        t.overhead_ms = 1000 * statistics.fmean(statistics.fmean(r["client_seconds"]) - statistics.fmean(
            q["t1"] - q["t0"] for q in _requests_of(all_lines, r)) for r in rs)
        return t

    first = Trace.load(*[_write(work / "first.jsonl", all_lines[runs[0]["lines"][0]:runs[0]["lines"][1]])])
    by_prompt = {tuple(r["prompt"]): r for r in first.requests}
    domains = {tuple(p): d for d, p in prompts}
    ordered = [dict(by_prompt[tuple(p)], domain=domains[tuple(p)]) for p in ids]
    requests = annotate(ordered, AppConfig.model_validate(args))
    if save_trace:
        save_trace.parent.mkdir(parents=True, exist_ok=True)
        save_trace.write_text("".join(json.dumps({"kind": "request", **r}) + "\n" for r in ordered))
    rows = []
    for c in concurrencies:
        measured = [r for r in runs if r["concurrency"] == c]
        for fitted_on in ("all", "others"):
            pool = runs if fitted_on == "all" else [r for r in runs if r["concurrency"] != c]
            if not pool:
                continue
            seg = segment(pool)
            hw = fit(seg).model_copy(update={"request_overhead_ms": max(seg.overhead_ms, 0.0)})
            cfg = AppConfig.model_validate(dict(args, speculation=dict(args.get("speculation", {}),
                                                                       record_trace=None)))
            pred = Simulation(cfg, hw, requests).run(Workload("closed", count=len(requests), concurrency=c)).summary()
            row = {"concurrency": c, "fitted_on": fitted_on}
            for key in ("throughput_tok_s", "latency_ms_per_token"):
                values = [r[key] for r in measured]
                row[key] = {"measured": statistics.median(values), "measured_min": min(values),
                            "measured_max": max(values), "simulated": pred[key]}
                row[key]["error"] = pred[key] / row[key]["measured"] - 1
            row["hardware"] = hw.model_dump()
            rows.append(row)
            log(f"  concurrency {c}, latency model fitted on {fitted_on}: throughput "
                f"{row['throughput_tok_s']['simulated']:.1f} vs {row['throughput_tok_s']['measured']:.1f} tok/s "
                f"({row['throughput_tok_s']['error']:+.1%}), latency {row['latency_ms_per_token']['simulated']:.1f} "
                f"vs {row['latency_ms_per_token']['measured']:.1f} ms/token ({row['latency_ms_per_token']['error']:+.1%})")
    return {"config": str(config), "prompts": len(ids), "new_tokens": new_tokens, "repeats": repeats,
            "rows": rows, "runs": [{k: v for k, v in r.items() if k != "client_seconds"} for r in runs]}


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def _requests_of(all_lines: list[str], run: dict) -> list[dict]:
    return [r for r in (json.loads(x) for x in all_lines[run["lines"][0]:run["lines"][1]]) if r["kind"] == "request"]


# ---------------------------------------------------------------------------------------------- the paper
def reproduce(args: dict, requests: list[ReplayRequest], profiles=("paper-llama", "paper-qwen"), prompts: int = 512,
              batches=PAPER["batches"], online_s: float = 600.0, log=print) -> dict:
    """Offline (fixed batch sizes, `prompts` requests of 256 prompt tokens at time 0) and online (Poisson at a
    low and a high rate, and a rate that alternates between them every 2 minutes), per hardware profile."""
    out: dict = {"paper": PAPER, "prompts": prompts, "offline": [], "online": []}
    for name in profiles:
        hw = PROFILES[name]
        for b in batches:
            for system in SYSTEMS[:3]:
                r = simulate(args, system, hw, requests, Workload("offline", count=prompts, prompt_tokens=256),
                             max_batch=b)
                out["offline"].append({"profile": name, "batch": b, "system": system, **r})
            log(f"  {name} offline batch {b}: " + ", ".join(
                f"{x['system']} {x['throughput_tok_s']:.0f} tok/s {x['service_ms_per_token']:.1f} ms/tok"
                for x in out["offline"][-3:]))
        # the online rates, from the target-only service rate at batch 16: low 30% of it, high 90%
        capacity = next(x["throughput_tok_s"] for x in out["offline"]
                        if x["profile"] == name and x["batch"] == 16 and x["system"] == "no-spec")
        per_request = PAPER["output_tokens"]
        rates = {"low": 0.3 * capacity / per_request, "high": 0.9 * capacity / per_request}
        rates["fluctuating"] = [(t, rates["low"] if (t // 120) % 2 == 0 else rates["high"])
                                for t in range(120, int(online_s) + 120, 120)]
        for label, rate in rates.items():
            for system in SYSTEMS:
                r = simulate(args, system, hw, requests, Workload("poisson", rate=rate, duration=online_s,
                                                                  prompt_tokens=256, seed=1), max_batch=16)
                out["online"].append({"profile": name, "rate": label, "system": system, **r})
            log(f"  {name} online {label}: " + ", ".join(
                f"{x['system']} {x['latency_ms_per_token']:.1f} ms/tok ${x['usd_per_million_tokens']:.2f}/Mtok"
                for x in out["online"][-4:]))
    return out


# ---------------------------------------------------------------------------------------------- sizing
DRAFTER_KINDS = {"RTX2080Ti": 616, "RTX3090": 936, "A100-80GB": 2039}  # memory bandwidth, GB/s (datasheets)


def size(args: dict, requests: list[ReplayRequest], profile: str = "paper-qwen", rate: float | None = None,
         mix: dict[str, float] | None = None, counts=(1, 2, 4, 7, 14), duration: float = 600.0,
         prices: dict[str, float] | None = None, slo_ms_per_token: float | None = None, log=print) -> dict:
    """Goodput per dollar for drafter GPUs of each kind and count per verifier, at one Poisson rate and domain mix,
    beside the layouts without drafter GPUs (no speculation; vanilla speculation on the verifier's GPUs): the answer
    is the best of them all, and the best remote layout is reported too. Goodput: the tokens of requests that met
    `slo_ms_per_token` (from sending; every token without an SLO). Every GPU holds one replica of every drafter
    (small models fit many to a GPU); a request's calls to a drafter go to its home replica. Rate default: 90% of
    the target-only service rate at batch 16."""
    import random

    base = PROFILES[profile]
    if prices:
        base = base.model_copy(update={"prices": {**base.prices, **prices}})
    pool = requests
    if mix:
        rng = random.Random(0)
        by_domain = {d: [r for r in requests if r.domain == d] for d in mix}
        pool = [rng.choice(by_domain[d]) for d in rng.choices(list(mix), weights=list(mix.values()), k=512)
                if by_domain[d]]
    if rate is None:
        cap = simulate(args, "no-spec", base, pool, Workload("offline", count=256, prompt_tokens=256),
                       max_batch=16)["throughput_tok_s"]
        rate = 0.9 * cap / PAPER["output_tokens"]
    workload = Workload("poisson", rate=rate, duration=duration, prompt_tokens=256, seed=2)
    rows = []
    for system in ("no-spec", "vanilla"):
        r = simulate(args, system, base, pool, workload, max_batch=16, slo_ms_per_token=slo_ms_per_token)
        rows.append({"system": system, "kind": None, "gpus": 0, **r})
    params, layers = DRAFTER_SHAPES[profile]
    for kind, bw in DRAFTER_KINDS.items():
        hw = base.model_copy(update={"drafter_gpu": kind, "draft": drafter_step(params, layers, bw)})
        for n in counts:
            r = simulate(args, "cosine", hw, pool, workload, max_batch=16, slo_ms_per_token=slo_ms_per_token,
                         replicas=n, drafter_gpus=n)
            rows.append({"system": "cosine", "kind": kind, "gpus": n, **r})
            log(f"  {kind} x{n}: {r['throughput_tok_s']:.0f} tok/s, {r['latency_ms_per_token']:.1f} ms/token, "
                f"${r['usd_per_million_tokens']:.2f} per 1M tokens")
    for row in rows:
        cost = row["usd_per_million_good_tokens"]
        row["good_tokens_per_usd"] = 1e6 / cost if cost else 0.0

    def layout(r: dict) -> dict:
        return {"system": r["system"], "kind": r["kind"], "gpus": r["gpus"],
                "per_verifier_gpu": r["gpus"] / base.verifier_gpus, "good_tokens_per_usd": r["good_tokens_per_usd"]}

    best = max(rows, key=lambda r: r["good_tokens_per_usd"])
    remote = max((r for r in rows if r["system"] == "cosine"), key=lambda r: r["good_tokens_per_usd"])
    return {"profile": profile, "rate": rate, "mix": mix, "prices": base.prices, "slo_ms_per_token": slo_ms_per_token,
            "rows": rows, "best": layout(best), "best_remote": layout(remote)}

