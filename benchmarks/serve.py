"""`cosine bench serve`: the running application under a mixed six-domain workload, one variant at a time.

All variants run against the same deployed graph, chosen per request with the `speculation` extension field, so
they share the process layout, the models and the machine's state. With `--config` (the Serve config the graph
was deployed from) every variant also runs through the same `VerifyLoop` in this process, drafters included
(assembly/): the same algorithm and models without Ray's processes and hops, and the table prints
served / in-process. Every variant is warmed up first; then the variants (and both transports) are interleaved
over the repeats and each row reports the median run with its min and max. Greedy decoding with `ignore_eos`
gives every variant the same output length (and, losslessness, the same output). Reports tokens/s, time per
output token, mean accepted length and target forward passes per token.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path

import httpx

from model_family import DOMAINS

# Every variant is chosen per request (the `speculation` field), so each suite runs against one deployment. A name
# means one thing in every suite.
OFF = {"speculation off": lambda d: {"enabled": False}}
SINGLE = {"generic drafter only (vanilla SD)": lambda d: {"drafters": ["generic"], "lockstep": False},
          "oracle drafter (true domain)": lambda d: {"drafters": [d], "lockstep": False}}
SUITES = {
    # examples/bench.yaml: CoSine's parts, and Minions' vote, against the generic drafter
    "cosine": {
        **OFF, **SINGLE,
        "random routing": lambda d: {"routing": "random"},
        # the top routed drafter alone: picking the right drafter without combining drafters
        "routing without fusion": lambda d: {"lockstep": False, "drafters_per_request": 1},
        # two routed drafters every round, fused in lockstep / one-shot (the controller's participation overridden)
        "routing + lockstep fusion, 2 drafters": lambda d: {"drafters_per_request": 2, "lockstep": True},
        "routing + one-shot fusion, 2 drafters": lambda d: {"drafters_per_request": 2, "lockstep": False},
        "full CoSine (routing + fusion + adaptive)": lambda d: {},
        # Minions: every drafter drafts, the weighted-majority chain is verified (speculation.mode: vote per request)
        "Minions vote of every drafter": lambda d: {"mode": "vote"},
    },
    # examples/chains.yaml: SpecRouter's multi-level chains beside the 2-level ones, and its choice among them
    "chains": {
        **OFF, **SINGLE,
        "2-level chain: the 10M original": lambda d: {"drafters": ["original"]},
        "3-level chain: domain drafter -> 10M original": lambda d: {"drafters": [f"3level-{d}"]},
        # one routed drafter a round, the chain taken by routing.chain_choice: latency (the deployment's)
        "SpecRouter chain choice among all chains": lambda d: {"drafters_per_request": 1},
    },
    # examples/collaborative.yaml: CoS against token-by-token collaborative decoding (speculation off for the
    # request), the same combination either way
    "collaborative": {
        **OFF,
        "CoS, the partner drafts 1 a cycle": lambda d: {"max_draft_tokens": 1},
        "CoS, the partner drafts the deployment's k": lambda d: {},
    },
}
VARIANTS = {name: fn for suite in SUITES.values() for name, fn in suite.items()}


async def _one(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], domain: str, variant: str,
               new_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True,
            "speculation": VARIANTS[variant](domain)}
    t = time.perf_counter()
    r = await client.post(f"{url}/v1/completions", json=body)
    r.raise_for_status()
    out = r.json()
    return {"seconds": time.perf_counter() - t, "usage": out["usage"], "text": out["choices"][0]["text"]}


async def _served(url: str, model: str, prompts: list[tuple[str, list[int]]], variant: str, concurrency: int,
                  new_tokens: int) -> dict:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600) as client:
        async def run(d, p):
            async with sem:
                return await _one(client, url, model, p, d, variant, new_tokens)

        t = time.perf_counter()
        results = await asyncio.gather(*(run(d, p) for d, p in prompts))
        wall = time.perf_counter() - t
    return _row(variant, concurrency, results, wall)


async def _inprocess(loop, tokenizer, prompts: list[tuple[str, list[int]]], variant: str, concurrency: int,
                     new_tokens: int) -> dict:
    """The same requests through `loop` (a VerifyLoop with in-process drafters) instead of HTTP."""
    from engines.sampling import SamplingParams
    from speculation.messages import SpeculationOverrides

    sem = asyncio.Semaphore(concurrency)
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)

    async def run(d, p):
        async with sem:
            t, ids, stats = time.perf_counter(), [], {}
            async for chunk in loop.generate(p, params, overrides=SpeculationOverrides(**VARIANTS[variant](d))):
                ids += chunk.token_ids
                stats = chunk.usage or stats
            return {"seconds": time.perf_counter() - t, "usage": dict(stats, completion_tokens=len(ids)),
                    "text": tokenizer.decode(ids, skip_special_tokens=True)}

    t = time.perf_counter()
    results = await asyncio.gather(*(run(d, p) for d, p in prompts))
    return _row(variant, concurrency, results, time.perf_counter() - t)


def _row(variant: str, concurrency: int, results: list[dict], wall: float) -> dict:
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
        prompt_len: int = 64, repeats: int = 3, config: Path | None = None, variants: list[str] | None = None,
        suite: str = "cosine", log=print) -> dict:
    """Every variant at every concurrency, served and (with `config`) in process: one warm-up run each, then
    `repeats` interleaved timed runs; each row is the median run, with the min and max tokens/s."""
    from transformers import AutoTokenizer

    from model_family.paths import model_path
    from model_family.samples import heldout_texts

    tok = AutoTokenizer.from_pretrained(model_path("tokenizer"))
    texts = heldout_texts()
    # held-out passages the engine benchmark and the tests do not use
    prompts = [(d, tok(t, add_special_tokens=False).input_ids[:prompt_len])
               for d in DOMAINS for t in texts[d][20:20 + per_domain]]
    transports = {"served": lambda v, c, ps: asyncio.run(_served(url, model, ps, v, c, new_tokens))}
    inprocess = _InProcess(config, tok, new_tokens) if config is not None else None
    if inprocess is not None:
        transports["in-process"] = inprocess.run
    unknown = set(variants or []) - set(SUITES[suite])
    if unknown:
        raise SystemExit(f"unknown variants {sorted(unknown)}; the {suite} suite has: {list(SUITES[suite])}")
    # speculation off is every row's baseline
    chosen = [v for v in SUITES[suite] if not variants or v in variants or v == "speculation off"]
    rows = []
    for c in concurrencies:
        for v in chosen:
            for name, fn in transports.items():
                log(f"[warm-up] concurrency {c}: {v} ({name})")
                fn(v, c, prompts[:2])
        runs: dict[tuple[str, str], list[dict]] = {}
        for rep in range(repeats):
            for v in chosen:
                for name, fn in transports.items():
                    log(f"[{rep + 1}/{repeats}] concurrency {c}: {v} ({name})")
                    runs.setdefault((v, name), []).append(fn(v, c, prompts))
        for v in chosen:
            row = median_run(runs[(v, "served")])
            if "in-process" in transports:
                inproc = median_run(runs[(v, "in-process")])
                row["in_process_tokens_per_s"] = inproc["tokens_per_s"]
                row["served_vs_in_process"] = round(row["tokens_per_s"] / inproc["tokens_per_s"], 3)
                row["in_process_mean_accepted_length"] = inproc["mean_accepted_length"]
                row["in_process_same_output"] = inproc["texts"] == row["texts"]
            rows.append(row)
    for row in rows:
        base = next(r for r in rows if r["concurrency"] == row["concurrency"] and r["variant"] == "speculation off")
        row["speedup_vs_off"] = round(row["tokens_per_s"] / base["tokens_per_s"], 3)
        row["identical_to_off"] = row["texts"] is not None and row["texts"] == base["texts"]
    for row in rows:
        row.pop("texts")
    result = {"config": {"url": url, "suite": suite, "prompts": len(prompts), "new_tokens": new_tokens,
                         "repeats": repeats, "in_process_config": str(config) if config else None}, "rows": rows}
    if inprocess is not None:
        result["in_process_stats"] = inprocess.close()
    return result


class _InProcess:
    """A VerifyLoop built from the Serve config's application args, kept across runs (as the service's is)."""

    def __init__(self, config: Path, tokenizer, new_tokens: int):
        import yaml

        from config import AppConfig
        from assembly.loop import build_loop

        args = yaml.safe_load(Path(config).read_text())["applications"][0]["args"]
        self.loop = build_loop(AppConfig.model_validate(args))
        self.tokenizer, self.new_tokens = tokenizer, new_tokens
        self.aio = asyncio.new_event_loop()  # the loop's task and queues live on one event loop throughout

    def run(self, variant: str, concurrency: int, prompts) -> dict:
        return self.aio.run_until_complete(_inprocess(self.loop, self.tokenizer, prompts, variant, concurrency,
                                                      self.new_tokens))

    def close(self) -> dict:
        """Stops the loop; returns its timing summary (the same fields as the service's speculation_stats)."""
        stats = dict(self.loop.stats.summary(), controller=self.loop.controller_state())
        self.aio.run_until_complete(self.loop.stop())
        self.aio.close()
        return stats


def median_run(runs: list[dict]) -> dict:
    """The median run by tokens/s, with the spread; output that differed between runs is reported as such."""
    ordered = sorted(runs, key=lambda r: r["tokens_per_s"])
    row = dict(ordered[(len(ordered) - 1) // 2])
    row.update(tokens_per_s=round(statistics.median(r["tokens_per_s"] for r in runs), 2),
               tokens_per_s_min=ordered[0]["tokens_per_s"], tokens_per_s_max=ordered[-1]["tokens_per_s"],
               tokens_per_s_by_repeat=[r["tokens_per_s"] for r in runs], repeats=len(runs))
    if any(r["texts"] != runs[0]["texts"] for r in runs):
        row["texts"] = None
    return row


def format_table(result: dict) -> str:
    inproc = any("in_process_tokens_per_s" in r for r in result["rows"])
    lines = ["| variant | concurrency | tok/s median (min-max) | vs off | TPOT ms | mean accepted length "
             "| target passes/token | same output |" + (" in-process tok/s | served / in-process |" if inproc else ""),
             "|---|---|---|---|---|---|---|---|" + ("---|---|" if inproc else "")]
    for r in result["rows"]:
        line = (f"| {r['variant']} | {r['concurrency']} | {r['tokens_per_s']:.1f} ({r['tokens_per_s_min']:.1f}-"
                f"{r['tokens_per_s_max']:.1f}) | {r['speedup_vs_off']:.2f}x | {r['tpot_ms']:.1f} "
                f"| {r['mean_accepted_length']:.2f} | {r['target_passes_per_token']:.3f} "
                f"| {'yes' if r['identical_to_off'] else 'NO'} |")
        if inproc:
            line += f" {r['in_process_tokens_per_s']:.1f} | {r['served_vs_in_process']:.2f} |"
        lines.append(line)
    return "\n".join(lines)


def _loop_line(s: dict) -> str:
    return (f"verify {s['verify_ms_recent']:.1f} ms, draft round {s['draft_round_ms_recent']:.1f} ms, waited for "
            f"drafts {s['draft_wait_ms_recent']:.1f} ms, verify end to next start {s['between_steps_ms_recent']:.1f} "
            f"ms per step")


def main(args) -> int:
    from contextlib import nullcontext

    from benchmarks.metrics import MetricsSampler, require_plotting, save_json

    require_plotting(bool(args.plot_dir))

    with (MetricsSampler(args.metrics_url) if args.metrics_url else nullcontext()) as sampler:
        result = run(args.url, args.model, args.per_domain, args.new_tokens, tuple(args.concurrency),
                     repeats=args.repeats, config=Path(args.config) if args.config else None,
                     variants=args.variants, suite=args.suite)
    print(format_table(result))
    if sampler is not None:
        result["metrics"] = sampler.series()
        print(f"sampled the metrics {len(result['metrics'])} times ({sampler.errors} failed scrapes)")
        if args.plot_dir:
            from benchmarks.metrics import render

            for path in render(result["metrics"], Path(args.plot_dir)):
                print(f"wrote {path}")
    if result.get("in_process_stats"):
        print(f"in-process loop (recent steps): {_loop_line(result['in_process_stats'])}")
    try:
        stats = httpx.get(f"{args.url}/v1/internal/speculation_stats", timeout=30).json()
        print(f"served loop (recent steps):     {_loop_line(stats)}")
        result["speculation_stats"] = stats
        if stats.get("rounds"):
            print(f"\nper speculation round: {stats['round_ms'] / stats['rounds']:.1f} ms, of which drafter compute "
                  f"{stats['drafter_compute_ms'] / stats['rounds']:.1f} ms over {stats['drafter_calls'] / stats['rounds']:.1f} "
                  f"drafter calls; a drafter call costs {stats['drafter_call_ms'] / max(1, stats['drafter_calls']):.1f} ms "
                  f"(compute {stats['drafter_compute_ms'] / max(1, stats['drafter_calls']):.1f} ms)")
        if stats.get("controller"):
            c = stats["controller"]
            recent = f"mean draft length {c['mean_k_recent']:.2f}, {100 * c['zero_k_share']:.0f}% plain decoding"
            if c.get("kind") == "hill_climb":
                print(f"hill-climbing controller (recent rounds): {recent}, k now {c['k']}, best {c['best_k']}")
            else:
                print(f"goodput controller (recent rounds): {recent}, verify fit {c['verify_fit_ms'][0]:.1f} ms + "
                      f"{c['verify_fit_ms'][1]:.2f} ms/token, drafting per round by participation (ms + depth x (ms + ms per request)) "
                      f"{c['draft_round_fit_ms']}, pool acceptance {c['pool_acceptance'] or 0:.2f}, "
                      f"acceptance by participation {c['acceptance_by_participation']}, now {c['participation']}")
    except Exception:  # noqa: BLE001 - stats are optional
        pass
    save_json(result, args.json)
    return 0
