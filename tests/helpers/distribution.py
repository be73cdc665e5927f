"""The check that sampled speculation draws from the target's distribution: the first two sampled tokens of many
requests of one prompt against the target's joint distribution of them (chi-square)."""

from __future__ import annotations

import numpy as np
import torch
from scipy.stats import chisquare

from engines.sampling import SamplingParams, target_probs


def assert_first_two_tokens_follow_the_target(target, prompt: list[int], params: dict, outputs: list) -> None:
    """`outputs`: the generations (`.token_ids`, two each) of `len(outputs)` requests of `prompt` sampled at
    `params`; fails where any pair lies outside the target's support or the counts reject its distribution."""
    n = len(outputs)
    pairs = [tuple(o.token_ids) for o in outputs]
    sp = SamplingParams(**params)
    with torch.no_grad():
        p1 = target_probs(target(input_ids=torch.tensor([prompt])).logits[0, -1], sp)
        firsts = p1.nonzero().flatten().tolist()
        p2 = {a: target_probs(target(input_ids=torch.tensor([prompt + [a]])).logits[0, -1], sp) for a in firsts}
    cells = [(a, b) for a in firsts for b in p2[a].nonzero().flatten().tolist()]
    expected = np.array([float(p1[a] * p2[a][b]) for a, b in cells])
    observed = np.array([pairs.count(c) for c in cells], dtype=float)
    assert observed.sum() == n  # nothing outside the target's support
    assert chisquare(observed, expected / expected.sum() * n).pvalue > 1e-3
