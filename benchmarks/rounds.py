"""`cosine bench rounds`: what the goodput controller's draft lengths buy, round by round, against fixed lengths.

Ours in process (examples/bench.yaml: the vLLM verifier, the bench target, the drafters), the same held-out prompts
and greedy 128 new tokens as `cosine bench anchors`, with five systems: the goodput controller choosing 0..k (the
configuration as shipped, up to two drafters per request), the same without its probe backoff (every participation
mode it does not use tried once every 32 rounds, as before the backoff), the same controller with one drafter per
request, and k always and k / 2 always, each with one drafter per request (lockstep fusion of two drafters costs
more than it buys on a CPU). The third system separates what the shipped configuration's second drafter costs from
what its draft lengths do. Every system is its own worker process, warmed up, the systems interleaved over the
repeats; tokens/s is the median run with min and max; the drafting cost (as in `cosine bench anchors`: the drafting tier's own time, routing, the drafters' steps and fusion,
per drafted token sent to verification and per round) is over all timed runs.

The round figures come from the verify loop's trace (`speculation.record_trace`: per request and verify step, the
draft's depth and the tokens accepted), pooled over the timed runs, and need no clock: the mean draft depth, the
share of drafts at k, tokens committed per drafted round, the conditional acceptance by depth of the rounds drafted
to k (the share of drafts accepted at depth d among those accepted up to d - 1: where a longer draft still pays),
and the correlation of a request's accepted share between consecutive rounds (how much a bad round predicts the
next: what a per-request draft length can exploit). From the trace's verify steps: the engine's time per step and the
wait for drafts before it, with the wait's share of the two (what drafting costs the loop, where no cheaper drafting
could buy more than that share).
"""

from __future__ import annotations

import statistics
import tempfile
from collections import defaultdict
from itertools import pairwise
from pathlib import Path

import numpy as np

from benchmarks.worker_handle import Worker
from benchmarks.common import cell, heldout_prompts, tps_cell
from benchmarks.metrics import save_json
from benchmarks.sampled import Sampling
from config import ControllerSpec
from speculation.trace import Trace

GREEDY = Sampling()  # the rounds compare outputs token for token

CONTROLLER = "goodput controller, k <= {k}"


def systems(k: int) -> dict[str, dict]:
    """name -> speculation / routing overrides of the configuration."""
    return {CONTROLLER.format(k=k): {},
            CONTROLLER.format(k=k) + ", no probe backoff": {"probe_backoff": False},
            CONTROLLER.format(k=k) + ", one drafter": {"drafters_per_request": 1},
            f"fixed k = {k}, one drafter": {"adaptive": False, "drafters_per_request": 1},
            f"fixed k = {k // 2}, one drafter": {"adaptive": False, "drafters_per_request": 1, "k": k // 2}}


def _config(config: str, k: int, overrides: dict, trace: Path, work: Path, name: str) -> tuple[str, int]:
    """`config` with its first application's speculation set for one system, tracing to `trace`; its path and k."""
    import yaml

    cfg = yaml.safe_load(Path(config).read_text())
    args = cfg["applications"][0]["args"]
    spec = args.setdefault("speculation", {})
    k = overrides.get("k", k)
    spec.update(k=k, record_trace=str(trace.resolve()))
    if "adaptive" in overrides:
        spec["adaptive"] = overrides["adaptive"]
    if overrides.get("probe_backoff") is False:  # the cap at the base rate: every unused mode tried as often
        ctl = spec.setdefault("controller", {})
        ctl["participation_probe_max"] = ctl.get("participation_probe", ControllerSpec().participation_probe)
    if "drafters_per_request" in overrides:
        args.setdefault("routing", {})["drafters_per_request"] = overrides["drafters_per_request"]
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path), k


def _records(trace: Path, offset: int) -> Trace:
    """The records `trace` holds after byte `offset` (request ids are unique, so the timed runs pool)."""
    with open(trace, "rb") as f:
        f.seek(offset)
        t = Trace()
        t.add(f.read().decode())
    return t


def step_stats(steps: list[dict]) -> dict:
    """Where a verify step's time goes (`step` trace records): the engine's verification, and the wait for drafts
    before it (drafting that did not overlap verification). Means per step, and drafting's share of the two."""
    if not steps:
        return {"verify_ms_per_step": None, "draft_wait_ms_per_step": None, "draft_wait_share": None}
    verify, wait = sum(s["verify_s"] for s in steps), sum(s["wait_s"] for s in steps)
    return {"verify_ms_per_step": round(1000 * verify / len(steps), 2),
            "draft_wait_ms_per_step": round(1000 * wait / len(steps), 2),
            "draft_wait_share": round(wait / (verify + wait), 3) if verify + wait > 0 else None}


def round_stats(records: list[dict], k: int) -> dict:
    """Clock-free figures of the drafted rounds among `records` (`verified` trace records in order)."""
    drafted = [r for r in records if r["depth"] > 0]
    if not drafted:
        return {"rounds": 0, "undrafted_steps": len(records), "mean_draft_depth": 0.0, "share_at_k": 0.0,
                "tokens_per_drafted_round": 0.0, "conditional_acceptance_at_k": [None] * k,
                "lag1_accepted_share_correlation": None}
    at_k = [r["accepted"] for r in drafted if r["depth"] == k]
    conditional = []
    for d in range(1, k + 1):
        at_risk = sum(1 for a in at_k if a >= d - 1)
        conditional.append(round(sum(1 for a in at_k if a >= d) / at_risk, 3) if at_risk else None)
    by_request: dict[str, list[float]] = defaultdict(list)
    for r in drafted:
        by_request[r["id"]].append(r["accepted"] / r["depth"])
    pairs = [pair for shares in by_request.values() for pair in pairwise(shares)]
    lag1 = None
    if len(pairs) > 2 and np.std([a for a, _ in pairs]) > 0 and np.std([b for _, b in pairs]) > 0:
        lag1 = round(float(np.corrcoef(np.array(pairs).T)[0, 1]), 3)
    return {"rounds": len(drafted), "undrafted_steps": len(records) - len(drafted),
            "mean_draft_depth": round(statistics.fmean(r["depth"] for r in drafted), 2),
            "share_at_k": round(len(at_k) / len(drafted), 3),
            "tokens_per_drafted_round": round(statistics.fmean(1 + r["accepted"] for r in drafted), 2),
            "conditional_acceptance_at_k": conditional,
            "lag1_accepted_share_correlation": lag1}


def run(config: str = "examples/bench.yaml", per_domain: int = 2, new_tokens: int = 128, concurrency: int = 1,
        k: int = 8, repeats: int = 3, log=print) -> dict:
    from transformers import AutoTokenizer

    from model_family.bench_target import ensure_bench_target
    from model_family.paths import model_path, models_dir

    ensure_bench_target(models_dir(), log)
    tok = AutoTokenizer.from_pretrained(model_path("tokenizer"))
    prompts = heldout_prompts(tok, per_domain, 64)
    work = Path(tempfile.mkdtemp(prefix="cosine-rounds-"))
    log(f"worker logs and traces: {work}")
    names = list(systems(k))
    workers, traces, ks, timed_from = {}, {}, {}, {}
    runs: dict[str, list[dict]] = {n: [] for n in names}
    try:
        for i, (name, overrides) in enumerate(systems(k).items()):
            log(f"[start {i + 1}/{len(names)}] {name}")
            traces[name] = work / f"{i}.jsonl"
            path, ks[name] = _config(config, k, overrides, traces[name], work, str(i))
            workers[name] = Worker({"kind": "ours", "config": path, "max_batch": max(8, concurrency),
                                     "k": ks[name]}, work / f"{i}.log")
        for name in names:
            log(f"[warm-up] {name}")
            workers[name].run([p for _, p in prompts[:2]], min(2, concurrency), 16, [d for d, _ in prompts[:2]],
                              GREEDY.for_requests(2, 0))
            timed_from[name] = traces[name].stat().st_size  # the warm-up's records are left out
        for rep in range(repeats):
            for i, name in enumerate(names):
                log(f"[{rep + 1}/{repeats}] [{i + 1}/{len(names)}] {name}")
                runs[name].append(workers[name].run([p for _, p in prompts], concurrency, new_tokens,
                                                    [d for d, _ in prompts],
                                                    GREEDY.for_requests(len(prompts), rep + 1)))
    finally:
        for w in workers.values():
            w.stop()
    reference = runs[names[0]][0]["outputs"]
    trace = {name: _records(traces[name], timed_from[name]) for name in names}
    rows = []
    for name in names:
        per_run = [sum(len(o) for o in r["outputs"]) / r["wall"] for r in runs[name]]  # in run order
        tps = sorted(per_run)
        # the drafting tier's own time (routing, the drafters' steps, fusion) over all timed runs
        draft_s = sum(r["draft_s"] for r in runs[name])
        drafted, rounds = (sum(r[key] for r in runs[name]) for key in ("draft_tokens", "draft_rounds"))
        rows.append({"system": name, "k": ks[name], "tokens_per_s": round(statistics.median(tps), 1),
                     "draft_ms_per_drafted_token": round(1000 * draft_s / drafted, 3) if drafted else None,
                     "draft_ms_per_round": round(1000 * draft_s / rounds, 3) if rounds else None,
                     "tokens_per_s_min": round(tps[0], 1), "tokens_per_s_max": round(tps[-1], 1),
                     "tokens_per_s_by_repeat": [round(t, 1) for t in per_run],
                     "runs": len(tps), **round_stats(trace[name].verified, ks[name]), **step_stats(trace[name].steps),
                     "identical_to_controller": all(r["outputs"] == reference for r in runs[name])})
    return {"config": {"prompts": len(prompts), "new_tokens": new_tokens, "concurrency": concurrency, "k": k,
                       "repeats": repeats, "ours": config},
            "rows": rows}


def format_table(result: dict) -> str:
    # the step columns where the run measured them (files from before them render as they were published)
    steps = any(r.get("verify_ms_per_step") is not None for r in result["rows"])
    extra = "| verify ms per step | drafts waited for, ms per step (share) " if steps else ""
    lines = [("| system | tok/s median (min-max) | drafting ms per drafted token | drafting ms per round "
              "| mean draft depth | drafts at k | tokens per drafted round "
              "| conditional acceptance by depth, drafts at k | lag-1 correlation of accepted share "
              f"{extra}| output = the controller's |"),
             "|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if steps else "")]
    for r in result["rows"]:
        cond = " ".join(cell(c) for c in r["conditional_acceptance_at_k"])
        step_cells = f"| {cell(r.get('verify_ms_per_step'))} | {_wait_cell(r)} " if steps else ""
        lines.append(f"| {r['system']} | {tps_cell(r)} | {cell(r.get('draft_ms_per_drafted_token'))} "
                     f"| {cell(r.get('draft_ms_per_round'))} | {r['mean_draft_depth']:.2f} | {100 * r['share_at_k']:.0f}% "
                     f"| {r['tokens_per_drafted_round']:.2f} | {cond} | {cell(r['lag1_accepted_share_correlation'])} "
                     f"{step_cells}| {'yes' if r['identical_to_controller'] else 'NO'} |")
    return "\n".join(lines)


def _wait_cell(row: dict) -> str:
    """The wait for drafts per step with its share of the step's time (files from before it have neither)."""
    if row.get("draft_wait_ms_per_step") is None:
        return "-"
    return f"{row['draft_wait_ms_per_step']:.2f} ({100 * row['draft_wait_share']:.0f}%)"


def main(args) -> int:
    result = run(args.config, per_domain=args.per_domain, new_tokens=args.new_tokens, concurrency=args.concurrency,
                 k=args.k, repeats=args.repeats)
    print(format_table(result))
    save_json(result, args.json)
    return 0
