"""Drafts sent to the verifier: a chain or a token tree, with the drafters' probabilities when known."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Draft:
    """Nodes in topological order (a parent precedes its children).

    parents[j] is the index of node j's parent, or -1 when it continues the committed context directly.
    q[j], if given, is the full distribution the drafter sampled node j's token from (conditioned on the
    parent's context); a node without q is a deterministic proposal and is verified as a one-hot q.
    drafters[j] names who proposed node j (for per-drafter statistics and routing feedback).
    """

    tokens: list[int]
    parents: list[int]
    q: list[torch.Tensor | None] | None = None
    drafters: list[str] | None = None
    probs: list[float] | None = None  # the drafter's probability of each token (its confidence)

    def __post_init__(self):
        if len(self.tokens) != len(self.parents):
            raise ValueError("tokens and parents differ in length")
        for j, p in enumerate(self.parents):
            if not -1 <= p < j:
                raise ValueError(f"node {j} has parent {p}: parents must precede children")
        if self.q is not None and len(self.q) != len(self.tokens):
            raise ValueError("q must have one entry per node")

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def chain(cls, tokens: list[int], q: list[torch.Tensor | None] | None = None, drafter: str | None = None,
              probs: list[float] | None = None) -> "Draft":
        return cls(list(tokens), list(range(-1, len(tokens) - 1)), q,
                   [drafter] * len(tokens) if drafter else None, probs)

    @property
    def depth(self) -> int:
        """The longest root-to-leaf path, in nodes (a chain's length)."""
        depths: list[int] = []
        for p in self.parents:  # parents precede their children
            depths.append(1 if p < 0 else depths[p] + 1)
        return max(depths, default=0)

    def children(self) -> dict[int, list[int]]:
        kids: dict[int, list[int]] = {-1: []}
        for j, p in enumerate(self.parents):
            kids.setdefault(p, []).append(j)
            kids.setdefault(j, [])
        return kids

    def best_chain(self) -> "Draft":
        """The tree's most confident root-to-leaf path as a chain (for engines that verify chains only): at each
        node the child the drafters were surest of (the first child where confidences are unknown)."""
        kids = self.children()
        path, cur = [], -1
        while kids.get(cur):
            cur = max(kids[cur], key=lambda c: self.probs[c] if self.probs and self.probs[c] is not None else 0.0)
            path.append(cur)
        if len(path) == len(self.tokens):
            return self

        def pick(xs):
            return None if xs is None else [xs[j] for j in path]

        return Draft([self.tokens[j] for j in path], list(range(-1, len(path) - 1)), pick(self.q), pick(self.drafters),
                     pick(self.probs))

    def following(self, extra: list[int]) -> "Draft | None":
        """What is left of this draft once its context has grown by `extra`: the rest of its best chain if `extra`
        is how that chain begins, else None (a draft made ahead, from a context that did not come true)."""
        chain = self.best_chain()
        m = len(extra)
        if chain.tokens[:m] != list(extra) or len(chain) <= m:
            return None

        def rest(xs):
            return None if xs is None else xs[m:]

        return Draft(chain.tokens[m:], list(range(-1, len(chain) - m - 1)), rest(chain.q), rest(chain.drafters),
                     rest(chain.probs))

    def truncated(self, n: int) -> "Draft":
        """The first n nodes (still a valid tree since parents precede children)."""
        sl = slice(0, n)
        return Draft(self.tokens[sl], self.parents[sl], None if self.q is None else self.q[sl],
                     None if self.drafters is None else self.drafters[sl],
                     None if self.probs is None else self.probs[sl])


@dataclass
class TreeBuilder:
    """Merges several drafters' chains into one tree; identical paths share nodes when `merge` is set.

    Merging is right for greedy verification (only the path matters). For sampling, siblings must be
    independent samples from their own q, so chains are kept apart (duplicate siblings are still lossless).
    """

    merge: bool = True
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    q: list = field(default_factory=list)
    drafters: list = field(default_factory=list)
    probs: list = field(default_factory=list)

    def add_chain(self, tokens: list[int], q: list | None, drafter: str | list[str] | None,
                  probs: list[float] | None, budget: int | None = None) -> None:
        """`drafter`: who proposed the chain, or one name per token."""
        parent = -1
        for i, tok in enumerate(tokens):
            existing = None
            if self.merge:
                existing = next((j for j, (t, p) in enumerate(zip(self.tokens, self.parents))
                                 if t == tok and p == parent), None)
            if existing is not None:
                parent = existing
                continue
            if budget is not None and len(self.tokens) >= budget:
                return
            self.tokens.append(tok)
            self.parents.append(parent)
            self.q.append(None if q is None else q[i])
            self.drafters.append(drafter[i] if isinstance(drafter, list) else drafter)
            self.probs.append(None if probs is None else probs[i])
            parent = len(self.tokens) - 1

    def build(self) -> Draft:
        has_q = any(x is not None for x in self.q)
        return Draft(self.tokens, self.parents, self.q if has_q else None, self.drafters, self.probs)
