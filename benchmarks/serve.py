"""`cosine bench serve`: the running application under a mixed six-domain workload, one variant at a time.

All variants run against the same deployed graph, chosen per request with the `speculation` extension field, so
they share the process layout, the models and the machine's state; they are interleaved variant by variant within
one run. Greedy decoding with `ignore_eos` gives every variant the same output length (and, losslessness, the
same output). Reports tokens/s, time per output token, mean accepted length and target forward passes per token.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx

from model_family import DOMAINS

VARIANTS = {
    "speculation off": lambda d: {"enabled": False},
    "generic drafter only (vanilla SD)": lambda d: {"drafters": ["generic"], "fusion": False},
    "oracle drafter (true domain)": lambda d: {"drafters": [d], "fusion": False},
    "random routing": lambda d: {"routing": "random"},
    # the top routed drafter alone: picking the right drafter without combining drafters
    "routing without fusion": lambda d: {"fusion": False, "drafters_per_request": 1},
    # two routed drafters every round, fused in lockstep / one-shot (the controller's participation overridden)
    "routing + lockstep fusion, 2 drafters": lambda d: {"drafters_per_request": 2, "fusion": True},
    "routing + one-shot fusion, 2 drafters": lambda d: {"drafters_per_request": 2, "fusion": False},
    "full CoSine (routing + fusion + adaptive)": lambda d: {},
}


async def _one(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], domain: str, variant: str,
               new_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True,
            "speculation": VARIANTS[variant](domain)}
    t = time.perf_counter()
    r = await client.post(f"{url}/v1/completions", json=body)
    r.raise_for_status()
    out = r.json()
    return {"seconds": time.perf_counter() - t, "usage": out["usage"], "text": out["choices"][0]["text"]}


async def _variant(url: str, model: str, prompts: list[tuple[str, list[int]]], variant: str, concurrency: int,
                   new_tokens: int) -> dict:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600) as client:
        async def run(d, p):
            async with sem:
                return await _one(client, url, model, p, d, variant, new_tokens)

        t = time.perf_counter()
        results = await asyncio.gather(*(run(d, p) for d, p in prompts))
        wall = time.perf_counter() - t
    tokens = sum(r["usage"]["completion_tokens"] for r in results)
    drafts = sum(r["usage"].get("num_drafts", 0) for r in results)
    accepted = sum(r["usage"].get("num_accepted_tokens", 0) for r in results)
    steps = sum(r["usage"].get("verify_steps", 0) for r in results)
    return {"variant": variant, "concurrency": concurrency, "tokens": tokens, "seconds": round(wall, 2),
            "tokens_per_s": round(tokens / wall, 2),
            "tpot_ms": round(1000 * sum(r["seconds"] / max(1, r["usage"]["completion_tokens"])
                                        for r in results) / len(results), 2),
            "mean_accepted_length": round(1 + accepted / drafts, 3) if drafts else 1.0,
            "target_passes_per_token": round(steps / tokens, 3),
            "texts": [r["text"] for r in results]}


def run(url: str, model: str, per_domain: int = 2, new_tokens: int = 128, concurrencies=(1, 8),
        prompt_len: int = 64, repeats: int = 1, log=print) -> dict:
    """Every variant at every concurrency; with `repeats`, the variants run round-robin that many times and the
    fastest run of each counts (a noisy neighbour then has to slow every repeat of a variant to decide a ratio)."""
    from transformers import AutoTokenizer

    from model_family.samples import heldout_texts
    from model_family.paths import model_path

    tok = AutoTokenizer.from_pretrained(model_path("tokenizer"))
    texts = heldout_texts()
    # held-out passages the engine benchmark and the tests do not use
    prompts = [(d, tok(t, add_special_tokens=False).input_ids[:prompt_len])
               for d in DOMAINS for t in texts[d][20:20 + per_domain]]
    rows = []
    for c in concurrencies:
        best: dict[str, dict] = {}
        unstable = set()  # variants whose output differed between repeats (reported as different output)
        for rep in range(repeats):
            for v in VARIANTS:
                log(f"[{rep + 1}/{repeats}] concurrency {c}: {v}")
                row = asyncio.run(_variant(url, model, prompts, v, c, new_tokens))
                if v in best and row["texts"] != best[v]["texts"]:
                    unstable.add(v)
                if v not in best or row["tokens_per_s"] > best[v]["tokens_per_s"]:
                    best[v] = row
        rows += [dict(best[v], repeats=repeats, texts=None if v in unstable else best[v]["texts"]) for v in VARIANTS]
    for row in rows:
        base = next(r for r in rows if r["concurrency"] == row["concurrency"] and r["variant"] == "speculation off")
        row["speedup_vs_off"] = round(row["tokens_per_s"] / base["tokens_per_s"], 3)
        row["identical_to_off"] = row["texts"] is not None and row["texts"] == base["texts"]
    for row in rows:
        row.pop("texts")
    return {"config": {"url": url, "prompts": len(prompts), "new_tokens": new_tokens}, "rows": rows}


def format_table(result: dict) -> str:
    lines = ["| variant | concurrency | tok/s | vs off | TPOT ms | mean accepted length | target passes/token "
             "| same output |", "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['variant']} | {r['concurrency']} | {r['tokens_per_s']:.1f} | {r['speedup_vs_off']:.2f}x "
                     f"| {r['tpot_ms']:.1f} | {r['mean_accepted_length']:.2f} | {r['target_passes_per_token']:.3f} "
                     f"| {'yes' if r['identical_to_off'] else 'NO'} |")
    return "\n".join(lines)


def main(args) -> int:
    from contextlib import nullcontext

    from benchmarks.metrics import MetricsSampler

    with (MetricsSampler(args.metrics_url) if args.metrics_url else nullcontext()) as sampler:
        result = run(args.url, args.model, args.per_domain, args.new_tokens, tuple(args.concurrency),
                     repeats=args.repeats)
    print(format_table(result))
    if sampler is not None:
        result["metrics"] = sampler.series()
        print(f"sampled the metrics {len(result['metrics'])} times ({sampler.errors} failed scrapes)")
        if args.plot_dir:
            from benchmarks.metrics import render

            for path in render(result["metrics"], Path(args.plot_dir)):
                print(f"wrote {path}")
    try:
        stats = httpx.get(f"{args.url}/v1/internal/speculation_stats", timeout=30).json()
        result["speculation_stats"] = stats
        if stats.get("rounds"):
            print(f"\nper speculation round: {stats['round_ms'] / stats['rounds']:.1f} ms, of which drafter compute "
                  f"{stats['drafter_compute_ms'] / stats['rounds']:.1f} ms over {stats['drafter_calls'] / stats['rounds']:.1f} "
                  f"drafter calls; a drafter call costs {stats['drafter_call_ms'] / max(1, stats['drafter_calls']):.1f} ms "
                  f"(compute {stats['drafter_compute_ms'] / max(1, stats['drafter_calls']):.1f} ms)")
        if stats.get("controller"):
            c = stats["controller"]
            print(f"goodput controller (recent rounds): mean draft length {c['mean_k_recent']:.2f}, "
                  f"{100 * c['zero_k_share']:.0f}% plain decoding, verify fit {c['verify_fit_ms'][0]:.1f} ms + "
                  f"{c['verify_fit_ms'][1]:.2f} ms/token, drafting per round by participation (ms + ms per depth) "
                  f"{c['draft_round_fit_ms']}, pool acceptance {c['pool_acceptance'] or 0:.2f}, "
                  f"acceptance by participation {c['acceptance_by_participation']}, now {c['participation']}")
    except Exception:  # noqa: BLE001 - stats are optional
        pass
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")
    return 0
