"""What `cosine simulate` answers: the paper's settings, drafter sizing, where drafters on GPUs of their own pay,
and the drafting tier per load (validation against a real run or recorded ones: validation.py).

Systems, as variants of one application config:
- `no-spec`: target-only decoding (speculation off);
- `vanilla`: the generic drafter's chain, k = 4 fixed, run on the verifier's GPUs (vLLM's draft_model);
- `cosine`: the config as given (routing, fusion, the goodput controller), one drafter replica per deployment,
  each on a drafter GPU of its own, drafting pipelined with verification;
- `cosine+autoscaler`: the same, each drafter deployment scaled by the project's autoscaling policy (min 1).
"""

from __future__ import annotations

import copy
from pathlib import Path

import yaml

from config import AppConfig
from simulate.cluster import Simulation, Workload
from simulate.fleet import Autoscaling
from simulate.hardware import PROFILES, Hardware, paper_profile
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
        a["speculation"].pop("drafting_tier", None)  # `auto` needs the controller; the simulation colocates it
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
