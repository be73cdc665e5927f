"""Lossless verification rules for chains and trees.

Both rules walk the draft from the committed context downwards and return the accepted path plus one token
from the target (the correction where a draft was rejected, or the bonus token after the last accepted node).

- greedy: follow the child whose token is the target's argmax; the target's argmax ends the walk.
- sampling (multi-candidate speculative sampling, as in SpecInfer): at each node, try its children in order;
  child c (token x, drawn from q_c) is accepted with probability min(1, r(x) / q_c(x)), where r starts as the
  target distribution p and becomes norm(max(0, r - q_c)) after each rejection; if every child is rejected the
  output token is drawn from the final r. For a single child this is standard speculative sampling (accept with
  min(1, p/q), resample from norm(max(0, p - q)), bonus from p after a full accept). Each step is a rejection-
  sampling step whose output is distributed as the current r, so the emitted token is distributed exactly as p.
  A deterministic proposal is a sample from a one-hot q: it is accepted with probability r(x) and removed from r
  on rejection, which is the same argument.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engines.draft_tree import Draft

EPS = 1e-12


def verify_greedy(draft: Draft | None, argmax_at: Callable[[int], int]) -> tuple[list[int], int]:
    """`argmax_at(j)` is the target's argmax after node j (j = -1: after the committed context)."""
    path: list[int] = []
    if draft is None or len(draft) == 0:
        return path, argmax_at(-1)
    kids = draft.children()
    cur = -1
    while True:
        want = argmax_at(cur)
        nxt = next((c for c in kids.get(cur, []) if draft.tokens[c] == want), None)
        if nxt is None:
            return path, want
        path.append(nxt)
        cur = nxt


def verify_sampling(draft: Draft | None, probs_at: Callable[[int], torch.Tensor],
                    gen: torch.Generator) -> tuple[list[int], int]:
    """`probs_at(j)` is the target's (temperature/top-k/top-p processed) distribution after node j."""
    path: list[int] = []
    kids = draft.children() if draft is not None and len(draft) else {-1: []}
    cur = -1
    while True:
        r = probs_at(cur)
        accepted = None
        for c in kids.get(cur, []):
            x = draft.tokens[c]
            q = draft.q[c] if draft.q is not None else None
            if q is None or float(q[x]) <= 0:  # deterministic proposal (or a q that cannot have produced x)
                q = None
            qx = 1.0 if q is None else float(q[x])
            u = float(torch.rand((), generator=gen))
            if u < min(1.0, float(r[x]) / qx):
                accepted = c
                break
            if q is None:
                r = r.clone()
                r[x] = 0.0
            else:
                r = torch.clamp(r - q, min=0.0)
            total = float(r.sum())
            r = r / total if total > EPS else probs_at(cur)  # r == q: rejection had probability zero
        if accepted is None:
            return path, int(torch.multinomial(r, 1, generator=gen))
        path.append(accepted)
        cur = accepted


def verify_token(x: int, d: torch.Tensor, r: torch.Tensor, gen: torch.Generator | None) -> tuple[bool, int]:
    """One proposal x drawn from d, checked against a target distribution r that need not be any model's (CoS's
    combined distributions): accept with min(1, r(x) / d(x)), else draw from norm(max(0, r - d)); the output is
    distributed as r. `gen` None: greedy, where r is one-hot and x is accepted if it is r's argmax."""
    if gen is None:
        want = int(r.argmax())
        return x == want, want
    dx = float(d[x])
    if dx > 0 and float(torch.rand((), generator=gen)) < min(1.0, float(r[x]) / dx):
        return True, x
    rest = torch.clamp(r - d, min=0.0)
    total = float(rest.sum())
    return False, int(torch.multinomial(rest / total if total > EPS else r, 1, generator=gen))
