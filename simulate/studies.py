"""What `cosine simulate` answers: validation against a real run or recorded ones, the paper's settings, drafter
sizing, and where drafters on GPUs of their own pay.

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
from simulate.hardware import PROFILES, Hardware, fit, paper_profile
from simulate.replay import ReplayRequest, annotate, sharpened
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

    from benchmarks.common import ServedApp, heldout_prompts
    from model_family.sources import resolve_model

    args = app_args(config)
    work = Path(tempfile.mkdtemp(prefix="cosine-validate-"))
    trace_path = work / "trace.jsonl"
    serve_cfg = yaml.safe_load(Path(config).read_text())
    serve_cfg["applications"][0]["args"]["speculation"] = dict(args.get("speculation", {}),
                                                               record_trace=str(trace_path))
    (work / "serve.yaml").write_text(yaml.safe_dump(serve_cfg))
    tok = AutoTokenizer.from_pretrained(resolve_model(args.get("tokenizer") or args["verifier"]["model"]))
    prompts = heldout_prompts(tok, per_domain, 64)
    ids = [p for _, p in prompts]

    def lines() -> int:
        return len(trace_path.read_text().splitlines()) if trace_path.exists() else 0

    log(f"starting the served graph of {config} (trace: {trace_path})")
    served = ServedApp(str(work / "serve.yaml"), port, port + 1)
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


# ---------------------------------------------------------------------------------------------- recorded runs
RECORDED = Path(__file__).parent / "traces" / "inprocess"  # committed: `cosine simulate record`


def record(config: str, requests_from: Path, out: Path = RECORDED, concurrencies=(1, 2, 4), repeats: int = 3,
           adaptive: bool | None = None, log=print) -> list[Path]:
    """Closed-loop runs of the config's verify loop in this process (assembly/loop.py: the torch engine
    as verifier, the drafters on threads of their own; no Ray, no HTTP), the runs interleaved. Writes the
    application args used (`args.json`) and a gzipped trace per run (`c{C}-r{R}.jsonl.gz`: concurrency C, repeat
    R). Each run gets a loop of its own, warmed up, so that it starts from the state a simulated run starts from (a
    fresh controller). The prompts (and their domains) are `requests_from`'s; `adaptive` overrides
    speculation.adaptive (false: always k, so every decision is the replay's, not the timings')."""
    import asyncio
    import gzip

    import torch

    from engines.sampling import SamplingParams
    from assembly.loop import build_loop

    prompts = Trace.load(requests_from).requests
    domain = {tuple(r["prompt"]): r.get("domain") for r in prompts}
    params = SamplingParams(max_tokens=max(len(r["output"]) for r in prompts), ignore_eos=True)
    work = Path(tempfile.mkdtemp(prefix="cosine-record-"))
    # one torch thread everywhere (the verifier's steps, and the prompt prefills the torch engine runs on this,
    # the event loop's, thread): on a shared machine ops fanned out over every core stalled whenever another
    # process held one of them (measured here: 0.3-0.4 s per prefill, repeats of a run 1.8x apart)
    torch.set_num_threads(1)
    args = app_args(config)
    speculation = dict(args.get("speculation", {}), record_trace=None)
    if adaptive is not None:
        speculation["adaptive"] = adaptive
    args = dict(args, verifier=dict(args["verifier"], engine="torch", threads=1), speculation=speculation)

    async def run(loop, ids: list[list[int]], concurrency: int, p: SamplingParams) -> None:
        gate = asyncio.Semaphore(concurrency)

        async def one(prompt):
            async with gate:
                async for _ in loop.generate(prompt, p):
                    pass

        await asyncio.gather(*(one(x) for x in ids))

    async def one_run(path: Path, concurrency: int) -> list[dict]:
        loop = build_loop(AppConfig.model_validate(dict(args, speculation=dict(speculation, record_trace=str(path)))))
        await run(loop, [r["prompt"] for r in prompts[:4]], 2, SamplingParams(max_tokens=16, ignore_eos=True))
        start = len(path.read_text().splitlines())
        await run(loop, [r["prompt"] for r in prompts], concurrency, params)
        await loop.stop()
        loop.trace.close()
        for server in loop.drafting.servers.values():
            server.executor.shutdown(wait=True)
        lines = [json.loads(x) for x in path.read_text().splitlines()[start:]]
        for x in lines:
            x.update({k: round(v, 6) for k, v in x.items() if isinstance(v, float)})  # microseconds
            if x["kind"] == "request":
                x["domain"] = domain[tuple(x["prompt"])]
        return lines

    out.mkdir(parents=True, exist_ok=True)
    (out / "args.json").write_text(json.dumps(args, indent=1) + "\n")
    written = []
    for rep in range(repeats):
        for c in concurrencies:
            lines = asyncio.run(one_run(work / f"c{c}-r{rep}.jsonl", c))
            written.append(out / f"c{c}-r{rep}.jsonl.gz")
            text = "".join(json.dumps(x, separators=(",", ":")) + "\n" for x in lines)
            written[-1].write_bytes(gzip.compress(text.encode(), mtime=0))
            log(f"  concurrency {c}, repeat {rep + 1}/{repeats}: {measured(_load_gz(written[-1]))}")
    return written


def _load_gz(path: Path) -> Trace:
    import gzip

    t = Trace()
    for line in gzip.decompress(path.read_bytes()).decode().splitlines():
        rec = json.loads(line)
        {"request": t.requests, "step": t.steps, "draft": t.drafts}[rec.pop("kind")].append(rec)
    return t


def measured(trace: Trace) -> dict:
    """A recorded run's throughput (tokens over the run's wall time), mean latency per token of its requests and
    mean verify step time, from its trace."""
    reqs = trace.requests
    tokens = sum(len(r["output"]) for r in reqs)
    return {"throughput_tok_s": tokens / (max(r["t1"] for r in reqs) - min(r["t0"] for r in reqs)),
            "latency_ms_per_token": 1000 * statistics.fmean((r["t1"] - r["t0"]) / len(r["output"]) for r in reqs),
            "verify_ms": 1000 * statistics.fmean(s["verify_s"] for s in trace.steps)}


def recorded(directory: Path = RECORDED) -> tuple[dict, list[dict]]:
    """The application args the runs were recorded with, and the runs: concurrency, repeat, trace, measurements."""
    runs = []
    for f in sorted(Path(directory).glob("c*-r*.jsonl.gz")):
        c, r = f.name.removesuffix(".jsonl.gz")[1:].split("-r")
        t = _load_gz(f)
        runs.append({"concurrency": int(c), "repeat": int(r), "trace": t, **measured(t)})
    return json.loads((Path(directory) / "args.json").read_text()), runs


def recorded_replay(args: dict, runs: list[dict]) -> list[ReplayRequest]:
    """The recorded runs' requests (every run sends the same prompts and greedy decoding gives the same outputs), in
    the order they were sent, replayed."""
    first = min(runs, key=lambda r: (r["concurrency"], r["repeat"]))["trace"]
    return annotate(sorted(first.requests, key=lambda r: r["t0"]), AppConfig.model_validate(args))


def predict(args: dict, fitted: list[dict], predicted: list[dict], requests: list[ReplayRequest],
            hw: Hardware | None = None, half: int | None = None) -> list[dict]:
    """Fit this machine's latency model on the `fitted` runs (on every other step and drafting round of theirs with
    `half`; or take `hw`), simulate a closed-loop run at each concurrency of the `predicted` runs with the runs'
    application `args`, and compare with their measured median: throughput, latency per token, mean verify step."""
    hw = hw or fit(Trace(*(sum((getattr(r["trace"], k) for r in fitted), []) for k in ("requests", "steps", "drafts"))),
                   half=half)
    cfg = AppConfig.model_validate(args)
    rows = []
    for c in sorted({r["concurrency"] for r in predicted}):
        res = Simulation(cfg, hw, requests).run(Workload("closed", count=len(requests), concurrency=c))
        decoded = res.step_tokens - sum(len(r.prompt) for r in requests)  # the trace's steps exclude prefills
        sim = dict(res.summary(), verify_ms=hw.verify.a + hw.verify.b * decoded / res.steps)
        row = {"concurrency": c, "repeats": sorted(r["repeat"] for r in predicted if r["concurrency"] == c),
               "fitted_on": sorted((r["concurrency"], r["repeat"]) for r in fitted), "half": half,
               "hardware": hw.model_dump()}
        for key in ("throughput_tok_s", "latency_ms_per_token", "verify_ms"):
            m = statistics.median(r[key] for r in predicted if r["concurrency"] == c)
            row[key] = {"measured": m, "simulated": sim[key], "error": sim[key] / m - 1}
        rows.append(row)
    return rows


def out_of_sample(args: dict, runs: list[dict], requests: list[ReplayRequest]) -> list[dict]:
    """Each recorded run predicted twice: from the even steps and drafting rounds of its own trace (the odd ones
    unseen), and from the other concurrencies of its repeat (recorded beside it): the middle concurrency
    interpolated, the outer ones extrapolated."""
    return [row for r in runs for row in (
        predict(args, [r], [r], requests, half=0)
        + predict(args, [x for x in runs if x["repeat"] == r["repeat"] and x["concurrency"] != r["concurrency"]], [r],
                  requests))]


# ---------------------------------------------------------------------------------------------- the paper
def reproduce(args: dict, requests: list[ReplayRequest], profiles=("paper-llama", "paper-qwen"), prompts: int = 512,
              batches=PAPER["batches"], online_s: float = 600.0, log=print) -> dict:
    """Offline (fixed batch sizes, `prompts` requests of 256 prompt tokens at time 0) and online (Poisson at a
    low and a high rate, and a rate that alternates between them every 2 minutes), per hardware profile."""
    out: dict = {"paper": PAPER, "prompts": prompts, "offline": [], "online": [],
                 "hardware": {name: PROFILES[name].model_dump() for name in profiles}}
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
DRAFTER_KINDS = ("RTX2080Ti", "RTX3090", "A100-80GB")  # hardware.GPUS


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
    rows, steps = [], {}
    for system in ("no-spec", "vanilla"):
        r = simulate(args, system, base, pool, workload, max_batch=16, slo_ms_per_token=slo_ms_per_token)
        rows.append({"system": system, "kind": None, "gpus": 0, **r})
    for kind in DRAFTER_KINDS:
        hw = base.model_copy(update={"drafter_gpu": kind, "draft": paper_profile(
            profile.removesuffix("-eager"), not profile.endswith("-eager"), kind).draft})
        steps[kind] = hw.draft.model_dump()
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
            "hardware": base.model_dump(), "drafter_steps": steps, "rows": rows, "best": layout(best),
            "best_remote": layout(remote)}


# ---------------------------------------------------------------------------------------------- remote drafters
def remote_pays(args: dict, requests: list[ReplayRequest], profile: str = "paper-qwen", batches=(1, 16),
                draft_ms=(0.25, 0.5, 1.0, 2.0, 6.0, 10.0), hops=(0.0, 0.5, 1.5, 3.0, 6.0),
                shares=(0.0, 0.25, 0.5, 0.75, 1.0), prompts: int = 64, log=print) -> dict:
    """CoSine with its drafters on GPUs of their own against vanilla speculation on the verifier's GPUs (offline,
    `prompts` requests of 256 prompt tokens at each batch size), as throughput cosine / vanilla: over the drafter
    step's fixed cost (`draft_ms` and the profile's own, graphed and eager) and the hop, and over the domain
    drafters' margin on the generic drafter (`sharpened` by each share, at the profile's step and hop)."""
    base = PROFILES[profile]
    draft_ms = sorted({*draft_ms, base.draft.a, PROFILES[f"{profile}-eager"].draft.a})
    domain = {d["name"] for d in args["drafters"] if not d.get("generalist")}
    work = Workload("offline", count=prompts, prompt_tokens=256)
    out: dict = {"profile": profile, "draft": base.draft.model_dump(), "hop_ms": base.hop_ms, "prompts": prompts,
                 "vanilla": {}, "grid": [], "margin": []}
    for b in batches:
        van = simulate(args, "vanilla", base, requests, work, max_batch=b)
        out["vanilla"][str(b)] = van
        for a in draft_ms:
            for h in hops:
                hw = base.model_copy(update={"draft": base.draft.model_copy(update={"a": a}), "hop_ms": h})
                r = simulate(args, "cosine", hw, requests, work, max_batch=b)
                out["grid"].append({"batch": b, "draft_ms": a, "hop_ms": h, "ratio": r["throughput_tok_s"]
                                    / van["throughput_tok_s"], "accepted": r["mean_accepted_length"]})
            log(f"  batch {b}, drafter step {a} ms: " + ", ".join(
                f"hop {x['hop_ms']}: {x['ratio']:.2f}" for x in out["grid"][-len(hops):]))
        for share in shares:
            better = sharpened(requests, domain, share)
            r = simulate(args, "cosine", base, better, work, max_batch=b)  # vanilla's generic drafter is unchanged
            out["margin"].append({"batch": b, "share": share, "ratio": r["throughput_tok_s"] / van["throughput_tok_s"],
                                  "accepted": r["mean_accepted_length"],
                                  "vanilla_accepted": van["mean_accepted_length"],
                                  "margin": r["mean_accepted_length"] / van["mean_accepted_length"]})
            log(f"  batch {b}, domain drafters sharpened {share:.0%}: accepted {r['mean_accepted_length']:.2f} vs "
                f"{van['mean_accepted_length']:.2f}, throughput ratio {out['margin'][-1]['ratio']:.2f}")
    return out


# ---------------------------------------------------------------------------------------------- drafting tiers
TIER_LAYOUTS = ("colocated", "deployments", "auto")  # speculation.drafting_tier


def tiers(args: dict, requests: list[ReplayRequest], profiles=("paper-qwen", "paper-qwen-eager", "paper-llama"),
          batches=PAPER["batches"], prompts: int = 128, log=print) -> dict:
    """`speculation.drafting_tier` per load: the config's drafting (routing, fusion, the goodput controller) on the
    verifier's GPUs (colocated), on drafter GPUs of their own (deployments), and `auto` (each round on the tier the
    chooser of speculation/tiers.py picks, from the rounds it measures), offline at each batch size (`prompts`
    requests of 256 prompt tokens). `best_fixed` is the better fixed tier's throughput at each point, `auto_ratio`
    auto's over it."""
    out: dict = {"prompts": prompts, "batches": list(batches), "rows": [],
                 "hardware": {p: PROFILES[p].model_dump() for p in profiles}}
    for name in profiles:
        hw = PROFILES[name]
        for b in batches:
            row: dict = {"profile": name, "batch": b}
            for tier in TIER_LAYOUTS:
                a = dict(args, speculation=dict(args.get("speculation", {}), drafting_tier=tier))
                if tier == "colocated":  # colocated drafters have no replicas of their own to scale
                    a["drafters"] = [{k: v for k, v in d.items() if k != "deployment"} for d in args["drafters"]]
                row[tier] = simulate(a, "cosine", hw, requests, Workload("offline", count=prompts, prompt_tokens=256),
                                     max_batch=b)
            fixed = max(row["colocated"]["throughput_tok_s"], row["deployments"]["throughput_tok_s"])
            row["best_fixed"] = "colocated" if row["colocated"]["throughput_tok_s"] >= fixed else "deployments"
            row["auto_ratio"] = row["auto"]["throughput_tok_s"] / fixed
            out["rows"].append(row)
            log(f"  {name} batch {b}: " + ", ".join(f"{t} {row[t]['throughput_tok_s']:.0f} tok/s" for t in TIER_LAYOUTS)
                + f"; auto / best fixed {row['auto_ratio']:.3f}, remote rounds "
                f"{row['auto']['remote_round_share']:.0%}")
    return out
