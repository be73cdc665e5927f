"""`cosine bench engine`: the speculative engines in one process against target-only decoding and HF.

Fixed-length generations of held-out prompts from all six domains on the bench target (the widened, cost-realistic
target), each prompt drafted by its own domain's drafter; greedy, or sampled at `--temperature`/`--top-p` with a seed
per request (every method the same seeds; outputs then checked by distribution, benchmarks/sampled.py, not against
target-only's). Beside every row the text statistics of its outputs (distinct tokens, repeated 4-gram share).
Everything runs side by side in one process, so the ratios are meaningful on a noisy shared machine. Besides tokens/s it reports the hardware-
independent figures (mean accepted length, target forward passes per generated token) and the limit: the
speed-up a system with free drafting and no overhead would reach with the measured acceptance and step costs.
"""

from __future__ import annotations

import asyncio
import itertools
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch
from transformers import AutoTokenizer

from config import AppConfig
from engines.cpu_kernels import packing_available
from engines.device_work import WORK, warmed_up
from engines.sampling import SamplingParams
from engines.drafter import DrafterEngine
from engines.runner import step_seconds
from engines.verifier import TorchVerifierEngine
from model_family import DOMAINS
from model_family.bench_target import ensure_bench_target, realistic_target
from speculation.goodput import GoodputController
from speculation.profiling import fit_draft_latency, fit_verify_latency
from assembly.loop import build_loop, generate_all
from speculation.messages import SpeculationOverrides
from benchmarks.common import Row, heldout_prompts, load_model, median_row
from benchmarks.engine_methods import Method, SlowedDrafting, methods
from benchmarks.metrics import save_json
from benchmarks.sampled import (P_FLOOR, Sampling, check_cell, check_header, distribution_pvalue, hf_sampling,
                                reference_model, text_columns)
from model_family.text_stats import text_stats


def _step_cost_ms(model, batch: int, context: int, new: int) -> float:
    return step_seconds(model, batch, context, new, repeats=7) * 1000


def run(models_dir: Path, per_domain: int = 2, new_tokens: int = 128, k: int = 4, batches=(1, 8),
        prompt_len: int = 64, include_hf: bool = True, repeats: int = 3, device: str = "cpu", log=print,
        only: list[str] | None = None, pool: tuple[str, ...] = ("auto",), target_scale: tuple[int, int] | None = None,
        dtype: str = "float32", on_repeat: Callable[[dict], None] | None = None,
        sampling: Sampling = Sampling(), slow_factor: float = 5.0, overlap: tuple[str, ...] = ("auto",),
        draft_timeout_ms: float | None = None) -> dict:
    """Every method at every batch size, warmed up, then `repeats` times round-robin; the median run counts.
    `device`: where every model runs ("cuda" on a GPU). `only`: the methods whose names contain one of these
    (target-only always runs: it is the reference; "HF" selects HF assisted generation). `pool`: the
    `speculation.pool_drafters` settings to run each of our speculative methods with (several: side by side, the
    setting in the method's name). `target_scale` (factor, layers): the trained target widened and deepened to
    that on the device instead of the bench target (model_family/bench_target.py `realistic_target`; HF assisted
    generation is left out then). `dtype`: every model's weights. `on_repeat`: given the result so far after every
    repeat (its `config.repeats_done` says how many), so that a run cut off keeps what it measured. `sampling`: every
    method at these settings (benchmarks/sampled.py), each prompt with its own seed, the same in every method.
    `slow_factor`: the methods with drafting slowed on purpose make every round this many recent verify steps
    longer. `overlap`: the `speculation.colocated_overlap` settings to run each of ours with, as `pool`.
    `draft_timeout_ms`: the verifier's wait for a round's drafts, fixed (None: the config's default, as shipped)."""
    bench = _Bench(models_dir, per_domain, new_tokens, k, prompt_len, device, dtype, target_scale, pool, sampling,
                   slow_factor, log, overlap, draft_timeout_ms)
    plan = bench.plan(batches, only, include_hf and not target_scale)
    for i, (method, batch, fn) in enumerate(plan):
        log(f"[warm-up] [{i + 1}/{len(plan)}] batch {batch}: {method}")
        fn(batch, True)
    warmed_up()  # every engine built and its graphs captured: a capture from now on is one in a timed run
    runs: dict[tuple[str, int], list[Row]] = {}
    config = bench.settings(repeats, dtype, target_scale)
    for rep in range(repeats):
        bench.current_run = rep + 1
        for i, (method, batch, fn) in enumerate(plan):
            log(f"[{rep + 1}/{repeats}] [{i + 1}/{len(plan)}] batch {batch}: {method}")
            runs.setdefault((method, batch), []).append(fn(batch, False))
        if on_repeat:  # what is measured so far, should the run be cut off
            on_repeat(_summary(runs, plan, bench.outputs, batches, config | {"repeats_done": rep + 1}, bench.sampled))
    costs = bench.step_costs(batches)
    result = _summary(runs, plan, bench.outputs, batches, config, bench.sampled) | {"step_costs_ms": costs}
    if not sampling.greedy:
        _check_distributions(result, bench.sampled, [p for _, p in bench.prompts], reference_model(bench.bench_dir),
                             sampling, log)
    return result


class _Bench:
    """What every run of `cosine bench engine` shares: the models, loaded once; the prompts; the engines kept across
    runs; the outputs of every run so far; which run is under way (its requests' seeds)."""

    def __init__(self, models_dir: Path, per_domain: int, new_tokens: int, k: int, prompt_len: int, device: str,
                 dtype: str, target_scale: tuple[int, int] | None, pool: tuple[str, ...], sampling: Sampling,
                 slow_factor: float, log, overlap: tuple[str, ...], draft_timeout_ms: float | None):
        self.models_dir, self.new_tokens, self.k, self.prompt_len = models_dir, new_tokens, k, prompt_len
        self.device, self.torch_dtype, self.pool, self.overlap = device, getattr(torch, dtype), pool, overlap
        self.draft_timeout_ms = draft_timeout_ms
        self.sampling, self.slow_factor = sampling, slow_factor
        tok = AutoTokenizer.from_pretrained(models_dir / "tokenizer")
        if target_scale:
            self.bench_dir = models_dir / "target"  # the verifier's name in the config; the model is built here
            self.target = realistic_target(models_dir, *target_scale, device, self.torch_dtype)
        else:
            self.bench_dir = ensure_bench_target(models_dir, log)
            self.target = load_model(self.bench_dir, device=device, dtype=self.torch_dtype)
        self.target_params = sum(p.numel() for p in self.target.parameters())
        log(f"target: {self.target_params / 1e9:.2f}B parameters, {self.target.config.num_hidden_layers} layers, "
            f"{dtype}")
        self.names = list(DOMAINS) + ["generic"]
        self.drafters = {d: load_model(models_dir / f"drafter-{d}", device=device, dtype=self.torch_dtype)
                         for d in self.names}
        self.drafters["original"] = load_model(models_dir / "target", device=device, dtype=self.torch_dtype)
        self.levels = [{"name": "original", "model": "target"}] + [
            {"name": f"3level-{d}", "model": "target", "assistant": str(models_dir / f"drafter-{d}")} for d in DOMAINS]
        self.drafters |= {f"3level-{d}": self.drafters["original"] for d in DOMAINS}
        self.prompts = heldout_prompts(tok, per_domain, prompt_len)
        self.outputs: dict[tuple[str, int], list[list[int]]] = {}
        self.sampled: dict[tuple[str, int], list[list[list[int]]]] = {}  # every timed run's outputs
        self.current_run = 0  # 0: the warm-up, r + 1: repeat r (the requests' seeds)
        self.hf_models: dict = {}
        self.max_len = prompt_len + new_tokens + 16
        self.seeds: dict = {}  # fitted step-latency models that seed the goodput controller, per batch size
        self.kept_engines: dict = {}  # across runs: their caches and, on a GPU, captured CUDA graphs (not timed)

    def params(self, n: int) -> list[SamplingParams]:
        seeds = self.sampling.seeds(n, self.current_run) or [None] * n
        return [SamplingParams(max_tokens=self.new_tokens, ignore_eos=True, temperature=self.sampling.temperature,
                               top_p=self.sampling.top_p, seed=s) for s in seeds]

    def kept(self, key, make):
        if key not in self.kept_engines:
            self.kept_engines[key] = make()
        return self.kept_engines[key]

    def row_name(self, m: Method, pool_drafters: str, overlap: str) -> str:
        """The method's row: its overlap and pool settings named where several are compared."""
        tags = [f"overlap {overlap}"] * (len(self.overlap) > 1) + [f"pool {pool_drafters}"] * (len(self.pool) > 1)
        return m.name + "".join(f" [{t}]" for t in tags if m.mode != "off")

    def plan(self, batches, only: list[str] | None, include_hf: bool) -> list[tuple[str, int, Callable]]:
        """(row name, batch size, fn(batch, warmup) -> Row) of every row measured: the methods `only` selects at
        every batch size, ours with each pool setting, HF assisted generation at batch 1."""
        plan = []
        for batch in batches:
            for m in methods(self.k):
                if only and m.mode != "off" and not any(o in m.name for o in only):
                    continue
                settings = (self.pool, self.overlap) if m.mode != "off" else (self.pool[:1], self.overlap[:1])
                for p, o in itertools.product(*settings):
                    plan.append((self.row_name(m, p, o), batch,
                                 lambda b, w, m=m, p=p, o=o: self.ours(m, b, warmup=w, pool_drafters=p, overlap=o)))
            if include_hf and batch == 1 and (not only or any(o in "HF assisted generation" for o in only)):
                # CPU: HF with our packed kernels too, for a like-for-like ratio
                if packing_available(next(self.target.parameters())):
                    plan.append(("HF assisted generation (same packed kernels)", 1, lambda b, w: self.hf(True, w)))
                plan.append(("HF assisted generation (stock kernels)", 1, lambda b, w: self.hf(False, w)))
        return plan

    def config(self, m: Method, batch: int, pool_drafters: str, overlap: str) -> AppConfig:
        """The method as the configuration of one `VerifyLoop`."""
        max_len = self.max_len
        return AppConfig(verifier={"model": str(self.bench_dir), "max_batch": batch, "max_len": max_len},
                         drafters=[{"name": n, "model": f"drafter-{n}", "max_len": max_len,
                                    "max_requests": 2 * batch, "generalist": n == "generic"} for n in self.names]
                         + [{**d, "max_len": max_len, "max_requests": 2 * batch} for d in self.levels if m.levels],
                         speculation={"mode": m.mode, "k": 2 * self.k if m.adaptive else self.k,
                                      "tree_budget": 2 * self.k, "lockstep": m.lockstep, "adaptive": m.adaptive,
                                      "vote": {"per_request": m.vote_per_request}, "pool_drafters": pool_drafters,
                                      "colocated_overlap": overlap}
                         | ({"draft_timeout_ms": self.draft_timeout_ms} if self.draft_timeout_ms else {}),
                         routing={"drafters_per_request": 1 if m.chain_choice else 2 if m.drafters is None
                                  else max(1, len(m.drafters("code"))),
                                  "chain_choice": "latency" if m.chain_choice else "score"})

    def loop(self, m: Method, batch: int, pool_drafters: str, overlap: str, name: str, verifier):
        """The method's `VerifyLoop` on `verifier` and the kept drafter engines: its drafting slowed or the controller
        blind to what rounds cost where the method says, the goodput controller seeded with fitted step costs."""
        engines = {n: self.kept((n, batch), lambda n=n: DrafterEngine(self.drafters[n], name=n, max_requests=2 * batch,
                                                                      max_len=self.max_len)) for n in self.names}
        loop = build_loop(self.config(m, batch, pool_drafters, overlap), verifier, {**self.drafters, **engines})
        if m.slowed:
            loop.drafting = SlowedDrafting(loop.drafting, 0.2, self.slow_factor, loop.stats)
        if loop.planner.guard is not None:
            # the guard keeps what it learnt across the method's runs (warm-up included), as a running server does
            loop.planner.guard = self.kept(("guard", name, batch), lambda: loop.planner.guard)
        if m.blind:
            loop.planner.observe_round = lambda *args: None
        if isinstance(loop.controller, GoodputController) and not loop.controller.participations:
            if batch not in self.seeds:
                self.seeds[batch] = (fit_verify_latency(self.target, batch, self.prompt_len),
                                     fit_draft_latency(self.drafters["generic"], batch, self.prompt_len))
            loop.controller.verify, loop.controller.draft = self.seeds[batch]
        return loop

    def ours(self, m: Method, batch: int, warmup: bool, pool_drafters: str, overlap: str) -> Row:
        """All prompts through one `VerifyLoop` (continuous batching up to `batch`)."""
        name = self.row_name(m, pool_drafters, overlap)
        trees = "best chain" not in m.name
        verifier = self.kept(("verifier", batch, trees),
                             lambda: TorchVerifierEngine(self.target, max_batch=batch, max_len=self.max_len,
                                                         trees=trees))
        passes, seconds = verifier.forward_passes, verifier.runner.forward_seconds
        loop = self.loop(m, batch, pool_drafters, overlap, name, verifier)
        overrides = [SpeculationOverrides(drafters=m.drafters(d)) if m.drafters else None for d, _ in self.prompts]
        todo = [p for _, p in self.prompts]
        if warmup and self.device == "cpu":  # on a GPU every prompt: the run's step shapes get their graphs captured
            todo, overrides = todo[:2], overrides[:2]
        t, captures = time.perf_counter(), WORK.graph_captures
        res = asyncio.run(generate_all(loop, todo, self.params(len(todo)), overrides))
        dt = time.perf_counter() - t
        captures = WORK.graph_captures - captures
        for server in (loop.drafting.servers.values() if loop.drafting else ()):
            server.executor.shutdown(wait=True)  # its releases done before the next loop uses the engine
        self.outputs[(name, batch)] = [r.token_ids for r in res]
        if not warmup:
            self.sampled.setdefault((name, batch), []).append(self.outputs[(name, batch)])
        return _our_row(name, batch, res, dt, loop, verifier.forward_passes - passes,
                        verifier.runner.forward_seconds - seconds, captures)

    def hf(self, packed: bool, warmup: bool = False) -> Row:
        if packed not in self.hf_models:  # HF runs the model's own forward: give it the same packed kernels as ours
            self.hf_models[packed] = (load_model(self.bench_dir, packed, self.device, self.torch_dtype),
                                      {d: load_model(self.models_dir / f"drafter-{d}", packed, self.device,
                                                     self.torch_dtype) for d in DOMAINS})
        name = "HF assisted generation" + (" (same packed kernels)" if packed else " (stock kernels)")
        row = _hf_assisted(name, *self.hf_models[packed], self.prompts[:2] if warmup else self.prompts,
                           self.new_tokens, self.outputs, self.sampling, self.current_run)
        if not warmup:
            self.sampled.setdefault((name, 1), []).append(self.outputs[(name, 1)])
        return row

    def settings(self, repeats: int, dtype: str, target_scale: tuple[int, int] | None) -> dict:
        """The result's `config`: what was run, on what."""
        return {"new_tokens": self.new_tokens, "k": self.k, "prompts": len(self.prompts), "prompt_len": self.prompt_len,
                "threads": torch.get_num_threads(), "repeats": repeats, "draft_timeout_ms": self.draft_timeout_ms,
                "device": torch.cuda.get_device_name() if self.device.startswith("cuda") else "cpu",
                "prepacked_cpu_linears": packing_available(next(self.target.parameters())), "dtype": dtype,
                "target": {"params": self.target_params, "layers": self.target.config.num_hidden_layers,
                           "hidden": self.target.config.hidden_size,
                           "scale": list(target_scale) if target_scale else "bench-target"},
                "sampling": self.sampling.as_dict()}

    def step_costs(self, batches) -> dict:
        """Step costs, for reading the results (what one verify of k+1 tokens costs against one token), in ms."""
        ctx, k = self.prompt_len + self.new_tokens // 2, self.k
        costs = {}
        for b in batches:
            costs[b] = {"verify_1": _step_cost_ms(self.target, b, ctx, 1),
                        f"verify_{k + 1}": _step_cost_ms(self.target, b, ctx, k + 1),
                        f"verify_{2 * k + 1}": _step_cost_ms(self.target, b, ctx, 2 * k + 1),
                        "draft_1": _step_cost_ms(self.drafters["generic"], b, ctx, 1)}
        return {str(b): {n: round(v, 2) for n, v in c.items()} for b, c in costs.items()}


def _our_row(name: str, batch: int, res: list, dt: float, loop, rounds: int, t_verify: float, captures: int) -> Row:
    """One run of ours as a row: `rounds` verify forward passes taking `t_verify` s in all, `dt` s of wall time."""
    tokens = sum(len(r.token_ids) for r in res)
    drafts = sum(r.stats["num_drafts"] for r in res)
    accepted = sum(r.stats["num_accepted_tokens"] for r in res)
    mal = 1 + accepted / drafts if drafts else None
    # drafting overlaps the other pipeline half's verification: what costs is the time the loop waited for it
    t_wait = loop.stats.totals["draft_wait_s"]
    tier = loop.drafting.coordinator.stats if loop.drafting else None
    drafted = sum(r.stats["num_draft_tokens"] for r in res)
    return Row(name, batch, tokens, round(dt, 2), round(tokens / dt, 1),
               round(mal, 3) if mal else None, round(rounds / tokens, 3), rounds,
               round(t_verify, 3), round(1000 * t_wait / rounds, 2),
               round(1000 * t_verify / rounds, 2), round(1000 * (dt - t_verify - t_wait) / rounds, 2),
               round(1000 * tier["step_seconds"] / tier["rounds"], 3) if tier and tier["rounds"] else None,
               round(1000 * tier["step_seconds"] / drafted, 3) if tier and drafted else None,
               **_device(loop.stats.device_summary()), graph_captures=captures,
               guard_switched_off=loop.planner.guard.switched_off if loop.planner.guard else None)


def _check_distributions(result: dict, sampled: dict, prompts: list[list[int]], model, sampling: Sampling,
                         log) -> None:
    """Every row's sampled outputs (all its timed runs) tested against the target's distribution: its p-value in
    the row, a warning in the result for a row that fails."""
    result["warnings"] = []
    for row in result["rows"]:
        test = distribution_pvalue(model, prompts, sampled[(row["method"], row["batch"])], sampling)
        row["distribution_p"], row["distribution_tokens"] = test["p"], test["tokens"]
        if test["p"] is not None and test["p"] < P_FLOOR:
            result["warnings"].append(f"{row['method']}, batch {row['batch']}: its sampled tokens do not follow the "
                                      f"target's distribution (chi-square p = {test['p']:.2g} over {test['tokens']} "
                                      f"tokens)")
            log("WARNING: " + result["warnings"][-1])


def _device(summary: dict) -> dict:
    """The loop's device work for a row (`LoopStats.device_summary`), rounded."""
    return {k: None if summary[k] is None else round(summary[k], 2) for k in
            ("drafter_forwards_per_depth", "host_reads_per_round", "host_reads_per_verify_step")}


def _summary(runs: dict, plan: list, outputs: dict, batches, config: dict, sampled: dict) -> dict:
    """The median row of every method's runs so far, with its speed-up, output identity (greedy) and the limit with
    free drafting: target-only's verify forward time over the row's (its measured acceptance at the step costs
    measured in the run itself, no drafting, no overhead); the text statistics of its outputs, every run's."""
    per_run = {f"{m} | batch {b}": [r.tokens_per_s for r in rs] for (m, b), rs in runs.items()}  # in run order
    rows = [median_row(runs[(m, b)]) for m, b, _ in plan if (m, b) in runs]
    best = {(r.method, r.batch): r for r in rows}
    ref = {b: outputs[("target-only (our engine)", b)] for b in batches}
    greedy = config["sampling"]["greedy"]
    for row in rows:
        base = best[("target-only (our engine)", row.batch)]
        row.speedup_vs_target = round(row.tokens_per_s / base.tokens_per_s, 3)
        row.identical_to_target = outputs[(row.method, row.batch)] == ref[row.batch] if greedy else None
        if row.mean_accepted_length and row.forward_seconds:
            row.limit_speedup = round(base.forward_seconds / row.forward_seconds, 3)
            row.efficiency = round(row.speedup_vs_target / row.limit_speedup, 3)
    first = batches[0]
    return {"config": config, "tokens_per_s_per_run": per_run,
            "rows": [asdict(r) | {"text": text_stats([o for run in sampled[(r.method, r.batch)] for o in run])}
                     | ({"identity": {"vs_target_only": identity(outputs[(r.method, r.batch)], ref[r.batch]),
                                      f"vs_target_only_batch_{first}": identity(outputs[(r.method, r.batch)],
                                                                                 ref[first])}} if greedy else {})
                     for r in rows]}


def identity(outputs: list[list[int]], reference: list[list[int]]) -> dict:
    """How many outputs equal the reference's, and per prompt the first position where they differ (None: equal).
    In bf16 on a GPU a verify forward of several tokens rounds otherwise than one-token decoding: this says where."""
    first = [next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), None if len(o) == len(r) else min(len(o), len(r)))
             for o, r in zip(outputs, reference)]
    return {"prompts_identical": sum(f is None for f in first), "prompts": len(first), "first_difference": first}


@torch.no_grad()
def _hf_assisted(name, target, drafters, prompts, new_tokens, outputs, sampling: Sampling, run: int) -> Row:
    results, tokens = [], 0
    seeds = sampling.seeds(len(prompts), run)
    sample = hf_sampling(sampling.temperature, sampling.top_p)
    for model in (target, *drafters.values()):
        # no EOS: every generation runs to new_tokens with EOS sampled like any token, as our engine's ignore_eos
        # does (min_new_tokens would take EOS out of the distribution)
        model.generation_config.eos_token_id = None
    t = time.perf_counter()
    for i, (domain, p) in enumerate(prompts):
        ids = torch.tensor([p], device=target.device)
        if seeds:
            torch.manual_seed(seeds[i])
        out = target.generate(ids, assistant_model=drafters[domain], max_new_tokens=new_tokens, pad_token_id=0,
                              **sample)
        new = out[0, len(p):].tolist()
        results.append(new)
        tokens += len(new)
    dt = time.perf_counter() - t
    outputs[(name, 1)] = results
    return Row(name, 1, tokens, round(dt, 2), round(tokens / dt, 1), None, None)


def format_table(result: dict) -> str:
    text_head, text_sep, text_cells = text_columns(result)
    lines = ["| method | batch | tok/s median (min-max) | speed-up vs target-only | mean accepted length "
             f"| target passes/token | waited for drafts / verify / other ms per step "
             f"| {check_header(result, 'identical output')} | limit (free drafting) | efficiency |{text_head}",
             "|---|---|---|---|---|---|---|---|---|---|" + text_sep]
    f = lambda v, fmt="{:.2f}": "-" if v is None else fmt.format(v)  # noqa: E731
    for r in result["rows"]:
        spread = f" ({r['tokens_per_s_min']:.1f}-{r['tokens_per_s_max']:.1f})" if r.get("tokens_per_s_min") else ""
        lines.append(f"| {r['method']} | {r['batch']} | {r['tokens_per_s']:.1f}{spread} | {f(r['speedup_vs_target'])}x "
                     f"| {f(r['mean_accepted_length'])} | {f(r['target_passes_per_token'], '{:.3f}')} "
                     f"| {f(r['draft_ms_per_round'], '{:.1f}')} / {f(r['verify_ms_per_round'], '{:.1f}')} / "
                     f"{f(r['overhead_ms_per_round'], '{:.1f}')} "
                     f"| {check_cell(r, 'identical_to_target')} | {f(r['limit_speedup'], '{:.2f}x')} "
                     f"| {f(r['efficiency'])} |{text_cells(r)}")
    costs = "; ".join(f"batch {b}: " + ", ".join(f"{n} {v} ms" for n, v in c.items())
                      for b, c in result.get("step_costs_ms", {}).items())
    notes = [f"sampling: {Sampling.of(result['config']['sampling']).describe()}"] \
        if "sampling" in result["config"] else []
    notes += [f"WARNING: {w}" for w in result.get("warnings", [])]
    return "\n".join(lines) + f"\n\nstep costs (median): {costs}" + "".join(f"\n{n}" for n in notes)


def device_table(result: dict) -> str:
    """Per row, the device work of its median run: drafter forwards per drafting depth, host reads (syncs on a GPU)
    per drafting round and per verify step, CUDA graph captures during the run."""
    f = lambda v: "-" if v is None else f"{v:g}"  # noqa: E731
    lines = ["| method | batch | drafter forwards per depth | host reads per round / per verify step "
             "| graph captures in the run |", "|---|---|---|---|---|"]
    for r in result["rows"]:
        if "graph_captures" in r and r["rounds"] is not None:
            lines.append(f"| {r['method']} | {r['batch']} | {f(r['drafter_forwards_per_depth'])} "
                         f"| {f(r['host_reads_per_round'])} / {f(r['host_reads_per_verify_step'])} "
                         f"| {f(r['graph_captures'])} |")
    return "\n".join(lines)


POOLED_NAMES = (" [pool on]", " [pool auto]")  # runs before `auto` came to mean "on a GPU" named the pooled rows auto


def pool_table(result: dict) -> str:
    """Each method run with the drafter pool on and off: the tokens/s ratio per repeat (median, min-max; the runs
    were interleaved, so repeat i of both ran side by side), drafting costs, acceptance and output identity."""
    rows = {(r["method"], r["batch"]): r for r in result["rows"]}
    runs = result["tokens_per_s_per_run"]
    lines = ["| batch | tok/s pool / no pool, median (min-max) | drafting ms per drafted token, pool / no pool "
             "| drafting ms per round, pool / no pool | mean accepted length, pool / no pool | output = target-only |",
             "|---|---|---|---|---|---|"]
    for (name, batch), on in rows.items():
        pooled = next((p for p in POOLED_NAMES if name.endswith(p)), None)
        if pooled is None:
            continue
        off = rows[(name.replace(pooled, " [pool off]"), batch)]
        ratios = sorted(a / b for a, b in zip(runs[f"{name} | batch {batch}"], runs[f"{off['method']} | batch {batch}"]))
        pair = lambda k: f"{on[k]:.3f} / {off[k]:.3f}"  # noqa: E731
        yes = lambda r: "yes" if r["identical_to_target"] else "NO"  # noqa: E731
        lines.append(f"| {batch} | {statistics.median(ratios):.3f} ({ratios[0]:.3f}-{ratios[-1]:.3f}) "
                     f"| {pair('drafting_ms_per_drafted_token')} | {pair('drafting_ms_per_round')} "
                     f"| {pair('mean_accepted_length')} | {yes(on)} / {yes(off)} |")
    return "\n".join(lines)


def main(args) -> int:
    from model_family.paths import models_dir

    result = run(models_dir(), per_domain=args.per_domain, new_tokens=args.new_tokens, k=args.k,
                 batches=tuple(args.batches), include_hf=not args.no_hf, repeats=args.repeats, device=args.device,
                 only=args.methods, pool=tuple(args.pool), overlap=tuple(args.overlap),
                 draft_timeout_ms=args.draft_timeout_ms,
                 target_scale=tuple(args.target_scale) if args.target_scale else None, dtype=args.dtype,
                 slow_factor=args.slow_drafting,
                 on_repeat=lambda partial: save_json(partial, args.json), sampling=Sampling.from_args(args))
    print(format_table(result))
    print("\n" + device_table(result))
    if len(args.pool) > 1:
        print("\n" + pool_table(result))
    save_json(result, args.json)
    return 0
