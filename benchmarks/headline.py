"""The README's headline tables, rendered from the committed results they quote. tests/test_docs_results.py checks
that the README's tables are exactly this on the latest committed runs, so a re-run needs only its JSON and

    python -m benchmarks.headline bench_results/anchors-k4-1201c.json bench_results/anchors-k8-1130.json \
        bench_results/anchors-k4-t07-1201c.json bench_results/engine.json

pasted over the tables. The first table has one column per `cosine bench anchors` run (its k, greedy or its
sampling settings): ours served against vLLM target-only and against vLLM's fastest `draft_model` run (whichever
drafter), at concurrency 1 and 8, against `vllm serve` where a run has it (else "not in this run"), and the
workload's text statistics (vLLM target-only's outputs: distinct tokens per output, share of 4-grams repeating an
earlier one), so a speed-up is read beside the text it was measured on.
A sampled run's `draft_model` cell says so where vLLM's samples fail the distribution test (benchmarks/sampled.py).
The second is `cosine bench engine`'s: our loop in process against HF assisted generation at batch 1.

Noise is gated, not explained: a ratio whose baseline (the figure it divides by) spread more than SPREAD_LIMIT
(max / min over its repeats) is withheld, its cell saying which baseline spread how far (re-run it on a quiet
machine), and every published ratio carries its range over the repeats: ours' slowest over the baseline's fastest
to ours' fastest over the baseline's slowest (the JSON keeps each row's min and max, not which repeats they came
from). A noisy baseline withholds only the ratios that divide by it: the rest of its run is published.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from benchmarks.anchors import SERVED, TARGET_ONLY, VLLM_SERVE
from benchmarks.sampled import P_FLOOR

ANCHORS_LINK = "docs/benchmarks.md#cosine-bench-anchors-ours-against-vllms-own-methods-2-core-cpu"
ENGINE_LINK = "docs/benchmarks.md#the-default-methods"
DRAFT_MODEL = "vLLM draft_model, "
DRAFTERS = {"vLLM draft_model, domain drafter": "domain drafter", "vLLM draft_model, generic drafter": "generic drafter"}
ENGINE_OURS, ENGINE_BASE = "ours: chain, domain drafter, k=4", "HF assisted generation (same packed kernels)"
WORKLOAD = "Workload: distinct tokens per output, repeated 4-gram share (medians of vLLM target-only's outputs)"
SPREAD_LIMIT = 1.15


def spread(row: dict) -> float:
    """A row's tokens/s max / min over its repeats."""
    return row["tokens_per_s_max"] / row["tokens_per_s_min"]


def withheld(base: dict) -> str | None:
    """The cell of a ratio over `base` where `base` spread over SPREAD_LIMIT across its repeats, else None."""
    if spread(base) <= SPREAD_LIMIT:
        return None
    name = base.get("system") or base["method"]
    return (f"withheld: {name} spread {spread(base):.3f} over its repeats ({base['tokens_per_s_min']:.1f}-"
            f"{base['tokens_per_s_max']:.1f} tok/s), above the gate of {SPREAD_LIMIT}")


def best_draft_model(anchors: dict, concurrency: int) -> dict:
    """vLLM's fastest `draft_model` row at `concurrency` (whichever drafter it ran with)."""
    rows = [r for r in anchors["rows"] if r["system"].startswith(DRAFT_MODEL) and r["concurrency"] == concurrency]
    return max(rows, key=lambda r: r["tokens_per_s"])


def run_label(run: dict) -> str:
    """A run's column: its k, and greedy or its sampling settings."""
    s = run["config"].get("sampling") or {"greedy": True}
    how = "greedy" if s["greedy"] else f"sampled (T = {s['temperature']:g}, top_p {s['top_p']:g})"
    return f"k = {run['config']['k']}, {how}"


def _row(result: dict, key: str, name: str, at: int) -> dict:
    [r] = [r for r in result["rows"] if r[key] == name and r["concurrency" if key == "system" else "batch"] == at]
    return r


def _has(result: dict, system: str, concurrency: int) -> bool:
    return any(r["system"] == system and r["concurrency"] == concurrency for r in result["rows"])


def repeat_range(ours: dict, base: dict) -> str:
    return f"{ours['tokens_per_s_min'] / base['tokens_per_s_max']:.2f}-" \
           f"{ours['tokens_per_s_max'] / base['tokens_per_s_min']:.2f}x"


def _ratio(ours: dict, base: dict, note: str = "") -> str:
    if (cell := withheld(base)) is not None:
        return cell
    o, b = ours["tokens_per_s"], base["tokens_per_s"]
    return f"{o / b:.2f}x ({o:.1f} / {b:.1f} tok/s{note}; repeats {repeat_range(ours, base)})"


def _workload(run: dict) -> str:
    w = run.get("workload")
    if not w:
        return "-"
    return f"{w['distinct_tokens']['median']:g}, {w['repeated_4gram_share']['median']:.2f}"


def anchors_table(runs: list[dict]) -> list[str]:
    lines = ["| result | " + " | ".join(run_label(r) for r in runs) + " |", "|---" * (len(runs) + 1) + "|"]
    for c in (1, 8):
        served = "ours served (Ray Serve, HTTP)" if c == 1 else "ours served"
        cells = [_ratio(_row(r, "system", SERVED, c), _row(r, "system", TARGET_ONLY, c)) for r in runs]
        lines.append(f"| [Concurrency {c}: {served} / vLLM target-only]({ANCHORS_LINK}) | " + " | ".join(cells) + " |")
        cells = []
        for r in runs:
            best = best_draft_model(r, c)
            wrong = best.get("distribution_p") is not None and best["distribution_p"] < P_FLOOR
            cells.append(_ratio(_row(r, "system", SERVED, c), best, f", {DRAFTERS[best['system']]}"
                                + ("; its samples fail the distribution test" if wrong else "")))
        lines.append(f"| [Concurrency {c}: ours served / vLLM's fastest `draft_model`]({ANCHORS_LINK}) | "
                     + " | ".join(cells) + " |")
        if any(_has(r, VLLM_SERVE, c) for r in runs):  # served against served, where the run has vLLM's server
            cells = [_ratio(_row(r, "system", SERVED, c), _row(r, "system", VLLM_SERVE, c))
                     if _has(r, VLLM_SERVE, c) else "not in this run" for r in runs]
            lines.append(f"| [Concurrency {c}: ours served / `vllm serve` (vLLM's OpenAI server, target-only, the same "
                         f"streaming client)]({ANCHORS_LINK}) | " + " | ".join(cells) + " |")
    lines.append(f"| {WORKLOAD} | " + " | ".join(_workload(r) for r in runs) + " |")
    return lines


def engine_table(engine: dict) -> list[str]:
    ours, base = _row(engine, "method", ENGINE_OURS, 1), _row(engine, "method", ENGINE_BASE, 1)
    o, b = ours["tokens_per_s"], base["tokens_per_s"]
    ratio = withheld(base) or f"{o / b:.2f}x (repeats {repeat_range(ours, base)})"
    return ["| result | ours | baseline | ours / baseline |", "|---|---|---|---|",
            f"| [In process, batch 1: our loop (torch engine, a chain from the prompt's domain drafter) against HF "
            f"assisted generation with the same pair and kernels]({ENGINE_LINK}) | {o:.1f} tok/s | {b:.1f} tok/s "
            f"| {ratio} |"]


def tables(anchors: list[dict], engine: dict) -> str:
    """Both tables, a blank line between them."""
    return "\n".join(anchors_table(anchors) + [""] + engine_table(engine))


if __name__ == "__main__":
    *anchors_paths, engine_path = sys.argv[1:]
    print(tables([json.loads(Path(p).read_text()) for p in anchors_paths], json.loads(Path(engine_path).read_text())))
