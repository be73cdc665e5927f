"""The sampling rules are lossless: emitted tokens are distributed exactly as the target's.

A small synthetic "target" and "drafters" (tables of distributions over a 5-token vocabulary, conditioned on the
previous token) let the rules run tens of thousands of times in a second. The first two emitted tokens are
compared with their exact joint distribution by a chi-square test. A deliberately wrong rule must be caught.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from engines.draft_tree import Draft, TreeBuilder
from engines.rules import verify_sampling

V = 5
N_SAMPLES = 12000
ALPHA = 1e-3


def _tables(seed: int) -> torch.Tensor:
    """[V + 1, V]: row 0 = after the prompt, row 1 + x = after token x."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(V + 1, V, generator=g) * 1.5
    return torch.softmax(logits, -1)


P = _tables(1)  # the target
Q = [_tables(2), _tables(3)]  # two drafters that disagree with the target and with each other


def _row(ctx: list[int]) -> int:
    return 0 if not ctx else 1 + ctx[-1]


def _draft(ctx: list[int], drafters: list[int], k: int, with_q: bool, gen: torch.Generator) -> Draft:
    tb = TreeBuilder(merge=False)
    for d in drafters:
        toks, qs, c = [], [], list(ctx)
        for _ in range(k):
            q = Q[d][_row(c)]
            x = int(torch.multinomial(q, 1, generator=gen)) if with_q else int(q.argmax())
            toks.append(x)
            qs.append(q if with_q else None)
            c.append(x)
        tb.add_chain(toks, qs, f"d{d}", None)
    return tb.build()


def _first_two(rule, drafters: list[int], k: int, with_q: bool, gen: torch.Generator) -> tuple[int, int]:
    ctx: list[int] = []
    while len(ctx) < 2:
        draft = _draft(ctx, drafters, k, with_q, gen)

        def probs_at(j, ctx=list(ctx), draft=draft):
            path = []
            while j >= 0:
                path.append(draft.tokens[j])
                j = draft.parents[j]
            return P[_row(ctx + path[::-1])]

        path, extra = rule(draft, probs_at, gen)
        ctx += [draft.tokens[j] for j in path] + [extra]
    return ctx[0], ctx[1]


def _exact_joint() -> np.ndarray:
    return np.array([[float(P[0][a] * P[1 + a][b]) for b in range(V)] for a in range(V)]).ravel()


def _p_value(rule, drafters, k, with_q, seed=0) -> float:
    gen = torch.Generator().manual_seed(seed)
    counts = np.zeros(V * V)
    for _ in range(N_SAMPLES):
        a, b = _first_two(rule, drafters, k, with_q, gen)
        counts[a * V + b] += 1
    expected = _exact_joint()
    return chisquare(counts, expected / expected.sum() * counts.sum()).pvalue


@pytest.mark.parametrize("drafters,k,with_q", [
    ([0], 1, True), ([0], 3, True), ([0], 3, False),  # chains, with and without q
    ([0, 1], 2, True), ([0, 1], 2, False), ([0, 0], 2, True),  # trees; [0, 0]: two samples of one drafter
])
def test_speculative_sampling_matches_target_distribution(drafters, k, with_q):
    assert _p_value(verify_sampling, drafters, k, with_q) > ALPHA


def _wrong_rule(draft, probs_at, gen):
    """A plausible mistake: on rejection, resample from the target p instead of the residual."""
    path, cur = [], -1
    kids = draft.children()
    while True:
        p = probs_at(cur)
        acc = None
        for c in kids.get(cur, []):
            x, q = draft.tokens[c], draft.q[c]
            if float(torch.rand((), generator=gen)) < min(1.0, float(p[x] / q[x])):
                acc = c
                break
        if acc is None:
            return path, int(torch.multinomial(p, 1, generator=gen))
        path.append(acc)
        cur = acc


def test_a_wrong_rule_is_caught():
    assert _p_value(_wrong_rule, [0], 3, True) < ALPHA
    assert _p_value(_wrong_rule, [0, 1], 2, True) < ALPHA
