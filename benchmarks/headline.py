"""The README's headline table, rendered from the committed results it quotes: `cosine bench anchors`' JSON (ours
served against vLLM target-only and against vLLM's best `draft_model` run at concurrency 1 and 8) and `cosine bench
engine`'s (our loop in process against HF assisted generation at batch 1). tests/test_docs_results.py checks that
the README's table is exactly this on the latest committed runs, so a re-run needs only its JSON and

    python -m benchmarks.headline bench_results/anchors-k8.json bench_results/engine.json

pasted over the table. Several anchors runs (`--k 4` beside `--k 8`) give their rows one after the other, each
label naming its k:

    python -m benchmarks.headline bench_results/anchors-k4.json bench_results/anchors-k8.json bench_results/engine.json

A sampled anchors run (`--temperature 0.7 --top-p 0.95`) gives rows labelled with its sampling settings, beside the
greedy run's:

    python -m benchmarks.headline bench_results/anchors-k4.json bench_results/anchors-k4-t07.json \
        bench_results/engine.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from benchmarks.anchors import SERVED, TARGET_ONLY

ANCHORS_LINK = "docs/benchmarks.md#cosine-bench-anchors-ours-against-vllms-own-methods-2-core-cpu"
ENGINE_LINK = "docs/benchmarks.md#the-default-methods"
DRAFT_MODEL = "vLLM draft_model, "
DRAFTERS = {"vLLM draft_model, domain drafter": "each prompt's domain drafter",
            "vLLM draft_model, generic drafter": "the generic drafter"}
ENGINE_OURS, ENGINE_BASE = "ours: chain, domain drafter, k=4", "HF assisted generation (same packed kernels)"
HEADER = ["| result | ours | baseline | ours / baseline |", "|---|---|---|---|"]


def _row(label: str, link: str, ours: float, base: float) -> str:
    return f"| [{label}]({link}) | {ours:.1f} tok/s | {base:.1f} tok/s | {ours / base:.2f}x |"


def best_draft_model(anchors: dict, concurrency: int) -> dict:
    """vLLM's fastest `draft_model` row at `concurrency` (whichever drafter it ran with)."""
    rows = [r for r in anchors["rows"] if r["system"].startswith(DRAFT_MODEL) and r["concurrency"] == concurrency]
    return max(rows, key=lambda r: r["tokens_per_s"])


def rows(anchors: dict | list[dict], engine: dict) -> list[str]:
    """The rows of each anchors run (in the order given; labelled with its k where there are several), then the
    engine's."""
    runs = anchors if isinstance(anchors, list) else [anchors]

    def tps(result: dict, key: str, name: str, at: int) -> float:
        [r] = [r for r in result["rows"] if r[key] == name and r["concurrency" if key == "system" else "batch"] == at]
        return r["tokens_per_s"]

    out = []
    for run in runs:
        sampling = run["config"].get("sampling") or {"greedy": True}
        sampled = "" if sampling["greedy"] else \
            f", sampled (T = {sampling['temperature']:g}, top_p {sampling['top_p']:g})"
        for c in (1, 8):
            at = f"Concurrency {c}" + (f", k = {run['config']['k']}" if len(runs) > 1 else "") + sampled
            ours = tps(run, "system", SERVED, c)
            served = "ours served (Ray Serve, HTTP)" if c == 1 else "ours served"
            out.append(_row(f"{at}: {served} against vLLM target-only", ANCHORS_LINK, ours,
                            tps(run, "system", TARGET_ONLY, c)))
            best = best_draft_model(run, c)
            out.append(_row(f"{at}: ours served against vLLM's `draft_model` with {DRAFTERS[best['system']]}, "
                            "vLLM's best there", ANCHORS_LINK, ours, best["tokens_per_s"]))
    out.append(_row("In process, batch 1: our loop (torch engine, a chain from the prompt's domain drafter) against HF "
                    "assisted generation with the same pair and kernels", ENGINE_LINK,
                    tps(engine, "method", ENGINE_OURS, 1), tps(engine, "method", ENGINE_BASE, 1)))
    return out


def table(anchors: dict | list[dict], engine: dict) -> str:
    return "\n".join(HEADER + rows(anchors, engine))


if __name__ == "__main__":
    *anchors_paths, engine_path = sys.argv[1:]
    print(table([json.loads(Path(p).read_text()) for p in anchors_paths], json.loads(Path(engine_path).read_text())))
