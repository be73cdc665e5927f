"""`cosine bench collaborative`: CoS against token-by-token collaborative decoding, side by side in one process.

The bench target with the generic drafter as partner, on held-out prompts of every domain: the paper's weighted
ensemble (weight 0.5, temperature 1) and contrastive decoding (mu 0.1, greedy and temperature 1). Per combination,
the baseline (a pass of each model per token) against naive CoS and CoS with the alternate proposal framework.
Every configuration is warmed up, then run `repeats` times round-robin; the median run counts. Besides tokens/s
it reports the hardware-free figures: each model's forward passes per generated token (a batched pass counts
once) and the mean accepted length (tokens per cycle: 1 + accepted drafts and bonus tokens per verify step). Greedy outputs must equal the baseline's.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer

from benchmarks.common import cell, heldout_prompts, load_model, median_row, tps_cell
from benchmarks.metrics import save_json
from engines.collaborative import CollaborativeEngine, Combination
from engines.sampling import SamplingParams

CASES = [("ensemble w=0.5, T=1", Combination("ensemble", weight=0.5), 1.0),
         ("contrastive mu=0.1, greedy", Combination("contrastive", mu=0.1), 0.0),
         ("contrastive mu=0.1, T=1", Combination("contrastive", mu=0.1), 1.0)]


@dataclass
class Row:
    case: str
    method: str
    batch: int
    tokens: int
    seconds: float
    tokens_per_s: float
    target_passes_per_token: float  # forward passes (batched: one pass serves the batch) per generated token
    partner_passes_per_token: float
    mean_accepted_length: float | None  # tokens per verify step (1 + accepted per drafted cycle)
    speedup_vs_token_by_token: float | None = None
    identical_to_token_by_token: bool | None = None  # greedy only
    tokens_per_s_min: float | None = None
    tokens_per_s_max: float | None = None
    runs: int = 1


def _methods(k: int) -> list[tuple[str, int, bool]]:
    return [("token by token", 0, False), (f"naive CoS, k={k}", k, False), (f"CoS (APF), k={k}", k, True),
            ("CoS (APF), k=1", 1, True)]


def run(models_dir: Path, per_domain: int = 1, new_tokens: int = 96, k: int = 4, batches=(1, 8),
        prompt_len: int = 64, repeats: int = 3, partner: str = "drafter-generic", log=print) -> dict:
    tok = AutoTokenizer.from_pretrained(models_dir / "tokenizer")
    from model_family.bench_target import ensure_bench_target

    target, partner_model = load_model(ensure_bench_target(models_dir, log)), load_model(models_dir / partner)
    prompts = [p for _, p in heldout_prompts(tok, per_domain, prompt_len)]
    outputs: dict[tuple, list[list[int]]] = {}

    def one(case: str, comb: Combination, temperature: float, method: str, kk: int, alternate: bool, batch: int,
            warmup: bool) -> Row:
        engine = CollaborativeEngine(target, partner_model, comb, k=kk, alternate=alternate, max_batch=batch,
                                     max_len=prompt_len + new_tokens + 8)
        todo = prompts[:2] if warmup else prompts
        ids = [engine.add_request(p, SamplingParams(max_tokens=new_tokens, temperature=temperature, seed=i,
                                                    ignore_eos=True)) for i, p in enumerate(todo)]
        out = {i: [] for i in ids}
        prefills = sum(len(p) > 1 for p in todo)  # a prompt's prefill is one pass of each model, not counted
        t = time.perf_counter()
        while engine.has_unfinished():
            for o in engine.step():
                out[o.request_id] += o.new_token_ids
        dt = time.perf_counter() - t
        stats = [engine.finished_stats(i) for i in ids]
        outputs[(case, method, batch)] = [out[i] for i in ids]
        n = sum(len(v) for v in out.values())
        drafts, accepted = sum(s["num_drafts"] for s in stats), sum(s["num_accepted_tokens"] for s in stats)
        return Row(case, method, batch, n, round(dt, 2), round(n / dt, 1),
                   round((engine.forward_passes - prefills) / n, 3), round((engine.partner_passes - prefills) / n, 3),
                   round(1 + accepted / drafts, 3) if drafts else None)

    plan = [(case, comb, temp, m, kk, alt, b) for b in batches for case, comb, temp in CASES
            for m, kk, alt in _methods(k)]
    for i, p in enumerate(plan):
        log(f"[warm-up] [{i + 1}/{len(plan)}] batch {p[-1]}: {p[0]}, {p[3]}")
        one(*p, warmup=True)
    runs: dict[tuple, list[Row]] = {}
    for rep in range(repeats):
        for i, p in enumerate(plan):
            log(f"[{rep + 1}/{repeats}] [{i + 1}/{len(plan)}] batch {p[-1]}: {p[0]}, {p[3]}")
            runs.setdefault((p[0], p[3], p[-1]), []).append(one(*p, warmup=False))
    rows = [median_row(r) for r in runs.values()]
    base = {(r.case, r.batch): r for r in rows if r.method == "token by token"}
    for r in rows:
        ref = base[(r.case, r.batch)]
        r.speedup_vs_token_by_token = round(r.tokens_per_s / ref.tokens_per_s, 3)
        if "greedy" in r.case:
            r.identical_to_token_by_token = outputs[(r.case, r.method, r.batch)] == \
                outputs[(r.case, "token by token", r.batch)]
    return {"config": {"target": "bench-target", "partner": partner, "prompts": len(prompts),
                       "prompt_len": prompt_len, "new_tokens": new_tokens, "k": k, "repeats": repeats,
                       "threads": torch.get_num_threads()},
            "rows": [asdict(r) for r in rows]}


def format_table(result: dict) -> str:
    lines = ["| combination | method | batch | tok/s median (min-max) | speed-up vs token by token | target passes/token "
             "| partner passes/token | mean accepted length | identical (greedy) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        same = "-" if r["identical_to_token_by_token"] is None else ("yes" if r["identical_to_token_by_token"]
                                                                      else "NO")
        lines.append(f"| {r['case']} | {r['method']} | {r['batch']} | {tps_cell(r)} | "
                     f"{r['speedup_vs_token_by_token']:.2f}x | {r['target_passes_per_token']:.3f} | "
                     f"{r['partner_passes_per_token']:.3f} | {cell(r['mean_accepted_length'])} | {same} |")
    return "\n".join(lines)


def main(args) -> int:
    from model_family.paths import models_dir

    result = run(models_dir(), per_domain=args.per_domain, new_tokens=args.new_tokens, k=args.k,
                 batches=tuple(args.batches), repeats=args.repeats, partner=args.partner)
    print(format_table(result))
    save_json(result, args.json)
    return 0
