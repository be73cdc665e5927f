"""How repetitive a model's outputs are: distinct tokens per output and the share of its 4-grams that repeat (and,
for a repeated-context workload, the share of its 4-grams its prompt holds).

A model that loops (the same few tokens over and over) drafts well for any drafter, n-gram lookup included, so a
speed measured on its outputs says little about text a real model writes. These figures go beside every
benchmark's speed, and into the training report of a target (its greedy outputs on held-out prompts).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def repeated_ngram_share(tokens: Sequence[int], n: int = 4) -> float:
    """The share of the output's n-grams that repeat an earlier n-gram of the same output (0 when it has none):
    [1, 2, 3, 4, 1, 2, 3, 4] has 5 4-grams, of which one ((1, 2, 3, 4) at position 4) repeats -> 0.2."""
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    if not grams:
        return 0.0
    seen: set[tuple[int, ...]] = set()
    repeats = 0
    for g in grams:
        repeats += g in seen
        seen.add(g)
    return repeats / len(grams)


def copied_ngram_share(prompt: Sequence[int], output: Sequence[int], n: int = 4) -> float:
    """The share of the output's n-grams that occur in its prompt (0 when it has none): how much of what a model
    wrote it copied from what it was shown (a repeated-context workload's measure, benchmarks/repeated.py)."""
    grams = [tuple(output[i:i + n]) for i in range(len(output) - n + 1)]
    if not grams:
        return 0.0
    shown = {tuple(prompt[i:i + n]) for i in range(len(prompt) - n + 1)}
    return sum(g in shown for g in grams) / len(grams)


def _spread(values: list[float], digits: int) -> dict:
    return {"median": round(statistics.median(values), digits), "min": round(min(values), digits),
            "max": round(max(values), digits)}


def text_stats(outputs: Sequence[Sequence[int]]) -> dict | None:
    """Over a workload's outputs: distinct tokens per output and the repeated 4-gram share, each as median, min
    and max (None for no outputs)."""
    outputs = [list(o) for o in outputs]
    if not outputs:
        return None
    return {"outputs": len(outputs),
            "distinct_tokens": _spread([len(set(o)) for o in outputs], 1),
            "repeated_4gram_share": _spread([repeated_ngram_share(o) for o in outputs], 3)}


def copied_share_stats(prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]]) -> dict | None:
    """The copied 4-gram share of each output from its prompt, as median, min and max (None for no outputs)."""
    if not outputs:
        return None
    return _spread([copied_ngram_share(p, o) for p, o in zip(prompts, outputs)], 3)


def stats_cells(stats: dict | None) -> tuple[str, str]:
    """Two table cells: distinct tokens per output and repeated 4-gram share, median (min-max)."""
    if not stats:
        return "-", "-"
    d, r = stats["distinct_tokens"], stats["repeated_4gram_share"]
    return (f"{d['median']:.0f} ({d['min']:.0f}-{d['max']:.0f})",
            f"{r['median']:.2f} ({r['min']:.2f}-{r['max']:.2f})")
