"""`cosine bench engine`: the speculative engines in one process against target-only decoding and HF.

Greedy, fixed-length generations of held-out prompts from all six domains on the bench target (the widened,
cost-realistic target), each prompt drafted by its own domain's drafter. Everything runs side by side in one
process, so the ratios are meaningful on a noisy shared machine. Besides tokens/s it reports the hardware-
independent figures (mean accepted length, target forward passes per generated token) and the limit: the
speed-up an overhead-free system would reach with the measured acceptance and measured step costs.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from autoscale.profiling import step_seconds
from deployments.engines.drafter import DrafterEngine
from deployments.engines.sampling import SamplingParams
from deployments.engines.speculative import SpeculativeGenerator
from deployments.engines.verifier import TorchVerifierEngine
from model_family import DOMAINS
from model_family.samples import heldout_texts


@dataclass
class Row:
    method: str
    batch: int
    tokens: int
    seconds: float
    tokens_per_s: float
    mean_accepted_length: float | None
    target_passes_per_token: float | None
    speedup_vs_target: float | None = None
    identical_to_target: bool | None = None
    limit_speedup: float | None = None
    efficiency: float | None = None


def _load(path: Path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _prompts(tokenizer, per_domain: int, length: int) -> list[tuple[str, list[int]]]:
    texts = heldout_texts()
    out = []
    for d in DOMAINS:
        for t in texts[d][:per_domain]:
            out.append((d, tokenizer(t, add_special_tokens=False).input_ids[:length]))
    return out


def _step_cost_ms(model, batch: int, context: int, new: int) -> float:
    return step_seconds(model, batch, context, new, repeats=7) * 1000


def run(models_dir: Path, per_domain: int = 2, new_tokens: int = 128, k: int = 4, batches=(1, 8),
        prompt_len: int = 64, include_hf: bool = True, log=print) -> dict:
    tok = AutoTokenizer.from_pretrained(models_dir / "tokenizer")
    bench_dir = models_dir / "bench-target"
    if not (bench_dir / "config.json").exists():
        from model_family.bench_target import build_bench_target

        log("building the bench target (cosine models bench-target) ...")
        build_bench_target(models_dir / "target", bench_dir)
    target = _load(bench_dir)
    drafters = {d: _load(models_dir / f"drafter-{d}") for d in list(DOMAINS) + ["generic"]}
    prompts = _prompts(tok, per_domain, prompt_len)
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    rows: list[Row] = []
    outputs: dict[tuple[str, int], list[list[int]]] = {}

    def ours(method: str, batch: int, drafter_names, adaptive: bool = False) -> Row:
        """All prompts through one verifier with continuous batching; each request drafted by its own drafters."""
        max_len = prompt_len + new_tokens + 16
        verifier = TorchVerifierEngine(target, max_batch=batch, max_len=max_len)
        names = sorted({n for d, _ in prompts for n in drafter_names(d)})
        engines = [DrafterEngine(drafters[n], name=n, max_requests=batch, max_len=max_len) for n in names]
        controller = None
        if adaptive:
            from autoscale.goodput import SpeculationController
            from autoscale.profiling import fit_draft_latency, fit_verify_latency

            per_req = len(drafter_names(prompts[0][0]))
            controller = SpeculationController(k_max=2 * k, drafters_per_request=per_req,
                                               verify=fit_verify_latency(target, batch, prompt_len),
                                               draft=fit_draft_latency(drafters["generic"], batch, prompt_len))
        gen = SpeculativeGenerator(verifier, engines, k=k if engines else 0, tree_budget=2 * k,
                                   controller=controller)
        t = time.perf_counter()
        res = gen.generate([p for _, p in prompts], params, [drafter_names(d) for d, _ in prompts])
        dt = time.perf_counter() - t
        outputs[(method, batch)] = [r.token_ids for r in res]
        tokens = sum(len(r.token_ids) for r in res)
        drafts = sum(r.stats["num_drafts"] for r in res)
        accepted = sum(r.stats["num_accepted_tokens"] for r in res)
        mal = 1 + accepted / drafts if drafts else None
        return Row(method, batch, tokens, round(dt, 2), round(tokens / dt, 1),
                   round(mal, 3) if mal else None, round(verifier.forward_passes / tokens, 3))

    for batch in batches:
        log(f"batch {batch}: target only")
        rows.append(ours("target-only (our engine)", batch, lambda d: []))
        log(f"batch {batch}: chain (domain drafter)")
        rows.append(ours(f"ours: chain, domain drafter, k={k}", batch, lambda d: [d]))
        log(f"batch {batch}: tree (domain + generic drafters)")
        rows.append(ours(f"ours: tree, domain + generic drafters, k={k}", batch, lambda d: [d, "generic"]))
        log(f"batch {batch}: chain with goodput-adaptive draft lengths")
        rows.append(ours(f"ours: chain, goodput-adaptive k<={2 * k}", batch, lambda d: [d], adaptive=True))
        if include_hf and batch == 1:
            log("batch 1: HF assisted generation")
            rows.append(_hf_assisted(target, drafters, prompts, new_tokens, outputs))

    # speed-up, output identity and the overhead-free limit
    ref = {b: outputs[("target-only (our engine)", b)] for b in batches}
    ctx = prompt_len + new_tokens // 2
    costs = {}
    for row in rows:
        base = next(r for r in rows if r.batch == row.batch and r.method.startswith("target-only"))
        row.speedup_vs_target = round(row.tokens_per_s / base.tokens_per_s, 3)
        row.identical_to_target = outputs[(row.method, row.batch)] == ref[row.batch]
        if row.mean_accepted_length and "adaptive" not in row.method:
            b = row.batch
            nodes = k if "chain" in row.method else 2 * k
            if b not in costs:
                costs[b] = {"verify_1": _step_cost_ms(target, b, ctx, 1),
                            "draft_1": _step_cost_ms(drafters["generic"], b, ctx, 1)}
            key = f"verify_{nodes + 1}"
            if key not in costs[b]:
                costs[b][key] = _step_cost_ms(target, b, ctx, nodes + 1)
            n_drafters = 2 if "tree" in row.method else 1
            round_cost = n_drafters * k * costs[b]["draft_1"] + costs[b][f"verify_{nodes + 1}"]
            limit = row.mean_accepted_length * costs[b]["verify_1"] / round_cost
            row.limit_speedup = round(limit, 3)
            row.efficiency = round(row.speedup_vs_target / limit, 3)
    return {"config": {"new_tokens": new_tokens, "k": k, "prompts": len(prompts), "prompt_len": prompt_len,
                       "threads": torch.get_num_threads()},
            "step_costs_ms": {str(b): {n: round(v, 2) for n, v in c.items()} for b, c in costs.items()},
            "rows": [asdict(r) for r in rows]}


@torch.no_grad()
def _hf_assisted(target, drafters, prompts, new_tokens, outputs) -> Row:
    results, tokens, rounds, accepted = [], 0, 0, 0
    t = time.perf_counter()
    for domain, p in prompts:
        ids = torch.tensor([p])
        out = target.generate(ids, assistant_model=drafters[domain], max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        new = out[0, len(p):].tolist()
        results.append(new)
        tokens += len(new)
    dt = time.perf_counter() - t
    outputs[("HF assisted generation (default schedule)", 1)] = results
    return Row("HF assisted generation (default schedule)", 1, tokens, round(dt, 2), round(tokens / dt, 1),
               None, None)


def format_table(result: dict) -> str:
    lines = ["| method | batch | tok/s | speed-up vs target-only | mean accepted length | target passes/token "
             "| identical output | limit | efficiency |", "|---|---|---|---|---|---|---|---|---|"]
    f = lambda v, fmt="{:.2f}": "-" if v is None else fmt.format(v)  # noqa: E731
    for r in result["rows"]:
        lines.append(f"| {r['method']} | {r['batch']} | {r['tokens_per_s']:.1f} | {f(r['speedup_vs_target'])}x "
                     f"| {f(r['mean_accepted_length'])} | {f(r['target_passes_per_token'], '{:.3f}')} "
                     f"| {'yes' if r['identical_to_target'] else 'NO'} | {f(r['limit_speedup'])}x "
                     f"| {f(r['efficiency'])} |")
    costs = "; ".join(f"batch {b}: " + ", ".join(f"{n} {v} ms" for n, v in c.items())
                      for b, c in result["step_costs_ms"].items())
    return "\n".join(lines) + f"\n\nstep costs (median): {costs}"


def main(args) -> int:
    from serve_app.paths import models_dir

    result = run(models_dir(), per_domain=args.per_domain, new_tokens=args.new_tokens, k=args.k,
                 batches=tuple(args.batches), include_hf=not args.no_hf)
    print(format_table(result))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")
    return 0
