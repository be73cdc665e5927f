"""What the model-free drafters share: per-request contexts kept as an index of the text seen, instead of a KV cache.

A model-free drafter (`ngram_drafter.NgramDrafterEngine`, `suffix_drafter.SuffixDrafterEngine`) implements the
same `DraftingEngine` protocol as the model drafters (engines/interface.py), so the drafter server, the coordinator,
routing and fusion take it as they take a model. It proposes the token that followed the longest earlier match of
the context's end, with a confidence counted from the text itself:

    prob(t) = count(match followed by t) / (count(match followed by anything) + UNSEEN / len(match))

the frequency of the continuation among the match's earlier occurrences, with pseudo-counts for the occurrence
being drafted (whose continuation is unknown) that weigh less the longer the match: seen once, a 1-token match
proposes its continuation at 0.2, a 4-token one at 0.5, a 16-token one at 0.8; seen three times, always followed by
the same token, a 4-token match at 0.75. Fusion (Eq. 4) sets this against the models' probabilities, so a short
match in free text rarely outbids a drafter model, a long repeat does. A request with no match gets no proposal
(it is left out of the step's answer, as a request a model drafter could not hold is), so the drafter drops out of
that request's round.

`sync` indexes the context it is given (a rollback first where it diverged from what was indexed: the fused prefix
of a lockstep round is indexed, then cut at the next round). The tokens fed after it (the drafter's own chain) are
matched against the index but not added to it. There is no model, so `model` and `runner` are None, no KV cache
(`kv_cache_bytes` 0) and no forward pass; `max_requests` and `max_len` bound the index memory.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from engines.interface import CacheFull, Proposal, common_prefix

# pseudo-counts of the unseen continuation, divided by the match length. Measured on the shipped family (6 held-out
# prompts, one per domain, 64 tokens, k 8, two domain drafters plus both model-free ones): 3.62 tokens per verify
# step with 1 (0.5 for any match seen once), 3.69 with 2, 4.0 with 4 and 8, 3.92 with 16; the two models alone 3.73
UNSEEN = 4.0
TOP_ALTERNATIVES = 4  # continuations reported per proposal (fusion keeps the winner's runner-ups as branches)


@dataclass
class Match:
    """The longest earlier match of a context's end: its length and the tokens that followed it, by count; ties go
    to the continuation seen first (an order that rollbacks keep: what stays indexed was indexed in its order)."""

    length: int
    counts: dict[int, tuple[int, int]]  # token -> (count, when first seen)

    def proposal(self) -> Proposal:
        ranked = sorted(self.counts.items(), key=lambda kv: (-kv[1][0], kv[1][1], kv[0]))[:TOP_ALTERNATIVES]
        total = sum(c for c, _ in self.counts.values()) + UNSEEN / self.length
        probs = [c / total for _, (c, _) in ranked]
        return Proposal(ranked[0][0], probs[0], [t for t, _ in ranked], probs)


@dataclass
class LookupState:
    """One request: the tokens indexed (its synced context), those fed since (not indexed), the tenant it came from
    and the length of its first synced context (its prompt, as far as the drafter knows)."""

    tokens: list[int] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)
    tenant: str | None = None
    prompt_len: int | None = None
    index: object = None  # the subclass's


class ModelFreeDrafter(ABC):
    """The `DraftingEngine` protocol over a per-request index; a subclass says how tokens are indexed, un-indexed
    and matched. Steps cost a lookup per request: `step` and `draft` never fail for want of a model."""

    model = None
    runner = None
    kv_cache_bytes = 0
    forward_passes = 0
    window: int  # the longest match looked for (the query's tokens)

    def __init__(self, name: str, max_requests: int = 64, max_len: int = 2048, min_prob: float = 0.0):
        """`min_prob`: a proposal less likely than this is not made (the chain ends there)."""
        self.name, self.max_requests, self.max_len, self.min_prob = name, max_requests, max_len, min_prob
        self.states: dict[str, LookupState] = {}

    # ------------------------------------------------------------------ what a subclass defines
    @abstractmethod
    def _new_index(self, state: LookupState) -> object:
        """An empty index for a new request."""

    @abstractmethod
    def _append(self, rid: str, token: int) -> None:
        """Index `token` after the request's indexed tokens (`self.states[rid].tokens` already holds it)."""

    @abstractmethod
    def _pop(self, rid: str) -> None:
        """Un-index the request's last indexed token (still in `self.states[rid].tokens`, removed after)."""

    @abstractmethod
    def _match(self, rid: str, query: list[int]) -> Match | None:
        """The longest earlier match of `query`'s end (the last `window` of the indexed tokens and those fed
        since), or None."""

    def _forget(self, rid: str) -> None:
        """The request is released (the suffix drafter keeps its output for its tenant)."""

    # ------------------------------------------------------------------ the DraftingEngine protocol
    def sync(self, rid: str, context: list[int], tenant: str | None = None) -> None:
        if len(context) + 1 > self.max_len:
            raise CacheFull(f"context of {len(context)} tokens exceeds {self.max_len}")
        st = self.states.get(rid)
        if st is None:
            if len(self.states) >= self.max_requests:
                raise CacheFull(f"{self.name} holds {self.max_requests} requests")
            st = self.states[rid] = LookupState(tenant=tenant, prompt_len=len(context))
            st.index = self._new_index(st)
        common = common_prefix(st.tokens, context, min(len(st.tokens), len(context)))
        while len(st.tokens) > common:
            self._pop(rid)
            st.tokens.pop()
        for t in context[common:]:
            st.tokens.append(t)
            self._append(rid, t)
        st.pending = []

    def feed(self, rid: str, tokens: list[int]) -> None:
        self.states[rid].pending.extend(tokens)

    def release(self, rid: str) -> None:
        if rid in self.states:
            self._forget(rid)
            del self.states[rid]

    def __contains__(self, rid: str) -> bool:
        return rid in self.states

    def step(self, rids: list[str], want_loglik: bool = False, alternatives: bool = False) -> dict:
        """The next proposal of each request that has a match (no prompt log-likelihood: there is no model; its
        ranked matches are the alternatives, whether asked or not)."""
        out = {}
        for r in rids:
            st = self.states[r]
            w = self.window
            m = self._match(r, (st.tokens[-w:] + st.pending)[-w:])
            if m is not None:
                p = m.proposal()
                if p.prob >= self.min_prob:
                    out[r] = p
        return out

    def draft(self, rids: list[str], k: int | dict[str, int], alternatives: bool = False) -> dict[str, list[Proposal]]:
        """Each request's chain, each proposal fed back, until k, no match, or the context's room ends."""
        ks = k if isinstance(k, dict) else {r: k for r in rids}
        chains: dict[str, list[Proposal]] = {r: [] for r in rids}
        for r in rids:
            st = self.states[r]
            while len(chains[r]) < ks.get(r, 0) and len(st.tokens) + len(st.pending) + 1 < self.max_len:
                p = self.step([r]).get(r)
                if p is None:
                    break
                chains[r].append(p)
                if len(chains[r]) < ks[r]:
                    self.feed(r, [p.token])
        return chains
