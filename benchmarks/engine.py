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
from engines.cpu_kernels import PackedLinears, pack_linear_modules
from engines.drafter import DrafterEngine
from engines.sampling import SamplingParams
from engines.speculative import SpeculativeGenerator
from engines.verifier import TorchVerifierEngine
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
    rounds: int | None = None
    forward_seconds: float | None = None  # verifier + drafter forward passes: the overhead-free time of this run
    draft_ms_per_round: float | None = None
    verify_ms_per_round: float | None = None
    overhead_ms_per_round: float | None = None
    speedup_vs_target: float | None = None
    identical_to_target: bool | None = None
    limit_speedup: float | None = None
    efficiency: float | None = None


def _load(path: Path, packed: bool = False, device: str = "cpu"):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().to(device)
    return pack_linear_modules(model) if packed else model


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
        prompt_len: int = 64, include_hf: bool = True, repeats: int = 1, device: str = "cpu", log=print) -> dict:
    """Every method at every batch size, `repeats` times round-robin (the fastest run of each counts, which
    keeps a noisy neighbour from deciding a ratio). `device`: where every model runs ("cuda" on a GPU)."""
    tok = AutoTokenizer.from_pretrained(models_dir / "tokenizer")
    bench_dir = models_dir / "bench-target"
    if not (bench_dir / "config.json").exists():
        from model_family.bench_target import build_bench_target

        log("building the bench target (cosine models bench-target) ...")
        build_bench_target(models_dir / "target", bench_dir)
    target = _load(bench_dir, device=device)
    drafters = {d: _load(models_dir / f"drafter-{d}", device=device) for d in list(DOMAINS) + ["generic"]}
    prompts = _prompts(tok, per_domain, prompt_len)
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    outputs: dict[tuple[str, int], list[list[int]]] = {}
    hf_models = {}

    def ours(method: str, batch: int, drafter_names, adaptive: bool = False) -> Row:
        """All prompts through one verifier with continuous batching; each request drafted by its own drafters."""
        max_len = prompt_len + new_tokens + 16
        verifier = TorchVerifierEngine(target, max_batch=batch, max_len=max_len)
        names = sorted({n for d, _ in prompts for n in drafter_names(d)})
        # all drafters share this process: one stacked engine drafts every (request, drafter) pair per step
        per_req = max(len(drafter_names(d)) for d, _ in prompts)
        engines = [DrafterEngine({n: drafters[n] for n in names}, max_requests=batch * per_req,
                                 max_len=max_len)] if names else []
        controller = None
        if adaptive:
            from speculation.goodput import SpeculationController
            from autoscale.profiling import fit_draft_latency, fit_verify_latency

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
        rounds = verifier.forward_passes
        t_verify = verifier.runner.forward_seconds
        t_draft = sum(e.runner.forward_seconds for e in engines)
        return Row(method, batch, tokens, round(dt, 2), round(tokens / dt, 1),
                   round(mal, 3) if mal else None, round(rounds / tokens, 3), rounds,
                   round(t_verify + t_draft, 3), round(1000 * t_draft / rounds, 2),
                   round(1000 * t_verify / rounds, 2), round(1000 * (dt - t_verify - t_draft) / rounds, 2))

    def hf(packed: bool) -> Row:
        if packed not in hf_models:  # HF runs the model's own forward: give it the same packed kernels as ours
            hf_models[packed] = (_load(bench_dir, packed, device),
                                 {d: _load(models_dir / f"drafter-{d}", packed, device) for d in DOMAINS})
        name = "HF assisted generation" + (" (same packed kernels)" if packed else " (stock kernels)")
        return _hf_assisted(name, *hf_models[packed], prompts, new_tokens, outputs)

    plan = []
    for batch in batches:
        plan += [(f"target-only (our engine)", batch, lambda b: ours("target-only (our engine)", b, lambda d: [])),
                 (f"ours: chain, domain drafter, k={k}", batch,
                  lambda b: ours(f"ours: chain, domain drafter, k={k}", b, lambda d: [d])),
                 (f"ours: tree, domain + generic drafters, k={k}", batch,
                  lambda b: ours(f"ours: tree, domain + generic drafters, k={k}", b, lambda d: [d, "generic"])),
                 (f"ours: chain, goodput-adaptive k<={2 * k}", batch,
                  lambda b: ours(f"ours: chain, goodput-adaptive k<={2 * k}", b, lambda d: [d], adaptive=True))]
        if include_hf and batch == 1:
            if PackedLinears(target).enabled:  # CPU: HF with our packed kernels too, for a like-for-like ratio
                plan += [("HF assisted generation (same packed kernels)", 1, lambda b: hf(True))]
            plan += [("HF assisted generation (stock kernels)", 1, lambda b: hf(False))]
    best: dict[tuple[str, int], Row] = {}
    for rep in range(repeats):
        for i, (method, batch, fn) in enumerate(plan):
            log(f"[{rep + 1}/{repeats}] [{i + 1}/{len(plan)}] batch {batch}: {method}")
            row = fn(batch)
            key = (method, batch)
            if key not in best or row.seconds < best[key].seconds:
                best[key] = row
    rows = [best[(m, b)] for m, b, _ in plan]

    # speed-up, output identity and the overhead-free limit: the forward passes this run needed (its measured
    # acceptance) at the step costs measured in the run itself, with no time between them
    ref = {b: outputs[("target-only (our engine)", b)] for b in batches}
    for row in rows:
        base = best[("target-only (our engine)", row.batch)]
        row.speedup_vs_target = round(row.tokens_per_s / base.tokens_per_s, 3)
        row.identical_to_target = outputs[(row.method, row.batch)] == ref[row.batch]
        if row.mean_accepted_length and row.forward_seconds:
            row.limit_speedup = round(base.forward_seconds / row.forward_seconds, 3)
            row.efficiency = round(row.speedup_vs_target / row.limit_speedup, 3)

    # step costs, for reading the results (what one verify of k+1 tokens costs against one token)
    ctx = prompt_len + new_tokens // 2
    costs = {}
    for b in batches:
        costs[b] = {"verify_1": _step_cost_ms(target, b, ctx, 1), f"verify_{k + 1}": _step_cost_ms(target, b, ctx, k + 1),
                    f"verify_{2 * k + 1}": _step_cost_ms(target, b, ctx, 2 * k + 1),
                    "draft_1": _step_cost_ms(drafters["generic"], b, ctx, 1)}
    return {"config": {"new_tokens": new_tokens, "k": k, "prompts": len(prompts), "prompt_len": prompt_len,
                       "threads": torch.get_num_threads(), "repeats": repeats,
                       "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
                       "prepacked_cpu_linears": PackedLinears(target).enabled},
            "step_costs_ms": {str(b): {n: round(v, 2) for n, v in c.items()} for b, c in costs.items()},
            "rows": [asdict(r) for r in rows]}


@torch.no_grad()
def _hf_assisted(name, target, drafters, prompts, new_tokens, outputs) -> Row:
    results, tokens = [], 0
    t = time.perf_counter()
    for domain, p in prompts:
        ids = torch.tensor([p], device=target.device)
        out = target.generate(ids, assistant_model=drafters[domain], max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        new = out[0, len(p):].tolist()
        results.append(new)
        tokens += len(new)
    dt = time.perf_counter() - t
    outputs[(name, 1)] = results
    return Row(name, 1, tokens, round(dt, 2), round(tokens / dt, 1), None, None)


def format_table(result: dict) -> str:
    lines = ["| method | batch | tok/s | speed-up vs target-only | mean accepted length | target passes/token "
             "| draft / verify / other ms per round | identical output | limit | efficiency |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    f = lambda v, fmt="{:.2f}": "-" if v is None else fmt.format(v)  # noqa: E731
    for r in result["rows"]:
        lines.append(f"| {r['method']} | {r['batch']} | {r['tokens_per_s']:.1f} | {f(r['speedup_vs_target'])}x "
                     f"| {f(r['mean_accepted_length'])} | {f(r['target_passes_per_token'], '{:.3f}')} "
                     f"| {f(r['draft_ms_per_round'], '{:.1f}')} / {f(r['verify_ms_per_round'], '{:.1f}')} / "
                     f"{f(r['overhead_ms_per_round'], '{:.1f}')} "
                     f"| {'yes' if r['identical_to_target'] else 'NO'} | {f(r['limit_speedup'], '{:.2f}x')} "
                     f"| {f(r['efficiency'])} |")
    costs = "; ".join(f"batch {b}: " + ", ".join(f"{n} {v} ms" for n, v in c.items())
                      for b, c in result["step_costs_ms"].items())
    return "\n".join(lines) + f"\n\nstep costs (median): {costs}"


def main(args) -> int:
    from model_family.paths import models_dir

    result = run(models_dir(), per_domain=args.per_domain, new_tokens=args.new_tokens, k=args.k,
                 batches=tuple(args.batches), include_hf=not args.no_hf, repeats=args.repeats, device=args.device)
    print(format_table(result))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")
    return 0
