"""Each drafted chain cut where its next token is no longer worth verifying, from the drafters' own confidences.

The goodput controller picks a request's draft length before the round from the request's past acceptance; the
drafters' confidence in each token they just proposed says more about this round. Measured on the bench drafters
(greedy, 8 requests, k = 8, 2-core CPU): a token drafted at probability under 0.2 was accepted 67% of the times it
was reached, one over 0.6 99%. Where verifying costs per token (a loaded verifier: ~0.9 ms a token at batch 8
here), a chain's tail of doubtful tokens costs more verify time than the tokens it is expected to commit.

`ConfidenceCut` keeps, per drafter, how often a token drafted at each confidence (ten bins) was accepted once
reached (decayed counts, so drift is followed), and before a verify step cuts the step's chains to the prefixes
that maximise the step's expected goodput:

    (requests + sum of kept tokens' P) / (T_fixed + b * kept tokens)

where P is the calibrated probability that the whole prefix up to a token is accepted (the product of its tokens'
calibrated acceptances, so it falls along a chain), b the verify model's seconds per token and T_fixed the rest of
the step (the verify model's intercept, a token per request, this round's drafting). Taking tokens by falling P
while P exceeds the current ratio times b finds the optimum, and it is a prefix of every chain.

Lossless: a cut depends only on the drafts and on past rounds, never on this step's verification, and any prefix of
a chain is verified exactly (greedy: the target's tokens; sampled: speculative sampling's distribution).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engines.draft_tree import Draft

BINS = 10
CELLS = BINS * 4
DECAY = 0.998  # per observed token: a drafter's counts follow its last ~500 tokens
PRIOR = 2.0  # pseudo-observations at the pooled (or, before any, the raw) confidence


# a chain's positions, grouped: reaching a deep position says the drafter is in step with the target, so a token
# there is accepted more often than one of the same confidence early in a chain
DEPTH_GROUPS = (0, 1, 2, 2, 3)


def _bin(p: float | None, j: int) -> int:
    """The calibration cell of a token at position `j` (0-based) drafted at confidence `p`."""
    b = BINS - 1 if p is None else min(BINS - 1, max(0, int(p * BINS)))
    return DEPTH_GROUPS[min(j, len(DEPTH_GROUPS) - 1)] * BINS + b


def _decay(table: list[list[float]], factor: float) -> None:
    for row in table:
        row[0] *= factor
        row[1] *= factor


@dataclass
class ConfidenceCut:
    """Calibrated acceptance by drafter and confidence, and the goodput-maximising cut of a step's chains."""

    counts: dict[str, list[list[float]]] = field(default_factory=dict)  # drafter -> bin -> [accepted, reached]
    pooled: list[list[float]] = field(default_factory=lambda: [[0.0, 0.0] for _ in range(CELLS)])
    verified: dict[str, Draft] = field(default_factory=dict)  # what the last step verified, per request
    kept_tokens: int = 0
    cut_tokens: int = 0

    def acceptance(self, drafter: str | None, p: float | None, j: int) -> float:
        """The calibrated chance that a token `drafter` proposed at confidence `p`, position `j` of its chain, is
        accepted once reached."""
        b = _bin(p, j)
        raw = (b % BINS + 0.5) / BINS
        acc, seen = self.pooled[b]
        prior = (acc + PRIOR * raw) / (seen + PRIOR)
        own = self.counts.get(drafter or "")
        if own is None:
            return prior
        acc, seen = own[b]
        return (acc + PRIOR * prior) / (seen + PRIOR)

    def prefix_probs(self, chain: Draft) -> list[float]:
        """P of each prefix of `chain`: every token up to it accepted."""
        out, P = [], 1.0
        drafters = chain.drafters or [None] * len(chain)
        probs = chain.probs or [None] * len(chain)
        for j, (d, p) in enumerate(zip(drafters, probs)):
            P *= self.acceptance(d, p, j)
            out.append(P)
        return out

    def cut(self, chains: dict[str, Draft], requests: int, fixed_s: float, per_token_s: float) -> dict[str, Draft]:
        """The chains cut to the prefixes that maximise the step's expected goodput (see the module's docstring);
        a chain with nothing worth verifying is left out. Without a per-token cost nothing is cut. What is returned
        is what the step verifies: `observe` calibrates on it."""
        if per_token_s <= 0 or not chains:
            self.verified = dict(chains)
            return chains
        items = sorted(((P, rid, j) for rid, c in chains.items() for j, P in enumerate(self.prefix_probs(c))),
                       reverse=True)
        tokens, seconds = float(requests), fixed_s + per_token_s * requests
        keep: dict[str, int] = {}
        for P, rid, j in items:
            if P * seconds <= tokens * per_token_s:  # below the step's goodput: this and every later one
                break
            tokens, seconds = tokens + P, seconds + per_token_s
            keep[rid] = max(keep.get(rid, 0), j + 1)
        out = {rid: chains[rid].truncated(keep[rid]) for rid in chains if rid in keep}
        self.verified = out
        kept = sum(keep.values())
        self.kept_tokens += kept
        self.cut_tokens += sum(len(c) for c in chains.values()) - kept
        return out

    def observe(self, rid: str, accepted: int) -> None:
        """The target accepted the first `accepted` tokens of what `rid` verified last step."""
        chain = self.verified.pop(rid, None)
        if chain is None:
            return
        reached = list(zip(chain.drafters or [None] * len(chain), chain.probs or [None] * len(chain)))[:accepted + 1]
        for name in {d or "" for d, _ in reached}:
            own = self.counts.setdefault(name, [[0.0, 0.0] for _ in range(CELLS)])
            _decay(own, DECAY ** sum(1 for d, _ in reached if (d or "") == name))
        _decay(self.pooled, DECAY ** len(reached))
        for j, (d, p) in enumerate(reached):
            b, ok = _bin(p, j), 1.0 if j < accepted else 0.0
            for table in (self.counts[d or ""], self.pooled):
                table[b][0] += ok
                table[b][1] += 1.0

    def state(self) -> dict:
        total = self.kept_tokens + self.cut_tokens
        return {"cut_share": self.cut_tokens / total if total else None,
                "acceptance_by_confidence": {d: [round(a / s, 3) if s >= 1 else None for a, s in rows]
                                             for d, rows in self.counts.items()}}
