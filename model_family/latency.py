"""Per-token decode latency of the family's models on this machine (transformers, fp32, batch 1)."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache


@torch.no_grad()
def decode_latency_ms(model, context: int = 256, repeats: int = 30, new_tokens: int = 1) -> float:
    """Median time of one cached decode step of `new_tokens` tokens after a `context`-token prefill."""
    ids = torch.randint(3, model.config.vocab_size, (1, context))
    times = []
    for _ in range(repeats):
        cache = DynamicCache()
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        step = torch.randint(3, model.config.vocab_size, (1, new_tokens))
        t = time.perf_counter()
        model(input_ids=step, past_key_values=cache, use_cache=True)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000


def measure_family(models_dir: Path, context: int = 256, repeats: int = 30) -> list[dict]:
    rows = []
    names = sorted(p.name for p in models_dir.iterdir() if (p / "config.json").exists())
    for name in names:
        model = AutoModelForCausalLM.from_pretrained(models_dir / name, dtype=torch.float32).eval()
        rows.append({"model": name, "params": sum(p.numel() for p in model.parameters()),
                     "decode_ms": round(decode_latency_ms(model, context, repeats), 2),
                     "verify5_ms": round(decode_latency_ms(model, context, repeats, new_tokens=5), 2)})
    return rows


def format_latencies(rows: list[dict]) -> str:
    lines = ["| model | params | 1-token decode (ms) | 5-token verify (ms) |", "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['params'] / 1e6:.2f}M | {r['decode_ms']:.2f} | {r['verify5_ms']:.2f} |")
    return "\n".join(lines)
