"""Minions' majority-voted speculator (Minions Sec. 3.1, digest-smartspec-minions.md part B), as a plain class.

Every voter drafts its own chain from the same context. The chains are merged into a token trie whose nodes weigh
the sum of the weights of the voters passing through them, and one path is verified: from the root, always the
heaviest child. So the verifier checks one chain per request, as with a single drafter, and where voters agree
their weights add up.

Weights follow the weighted-majority rule of Minions (Eq. 1) with the fixes the digest notes:
- a voter's acceptance rate (ACR) is the mean over its last `window` observations, not all history;
- weights are renormalised and clipped to [min_weight, max_weight], so no voter is silenced or made a dictator
  for good;
- every voter is observed each round, not only the voted one (full information): its chain is compared with what
  the target committed. For a deterministic proposal x the chance that the target commits x is p(x), which is
  also the chance that verification would accept it, so the comparison estimates acceptance under sampling too.

Lossless under sampling: drafters draft greedily, so the voted chain is a deterministic function of the context
and of the weights (which depend only on the past). Its proposal distribution is one-hot, and the verifier's
min(1, p/q) rule with that one-hot q is exact (engines/rules.py). Minions' min(1, p/q_voted) with the voted
drafter's softmax q would not be: the chain was selected among several drafters' outputs.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engines.draft_tree import Draft

GLOBAL = ""  # the scope of weights shared by every request


@dataclass
class MajorityVote:
    voters: list[str]
    window: int = 32
    reward_threshold: float = 0.6
    punish_threshold: float = 0.3
    reward_factor: float = 1.2
    punish_factor: float = 0.8
    min_weight: float = 0.02
    max_weight: float = 0.6
    per_request: bool = False  # weights per request (seeded equal) instead of one set for all requests
    weights: dict[str, dict[str, float]] = field(default_factory=dict)  # scope -> voter -> weight
    history: dict[str, dict[str, deque]] = field(default_factory=dict)  # scope -> voter -> recent acceptance rates

    def scope(self, rid: str) -> str:
        return rid if self.per_request else GLOBAL

    def weights_of(self, scope: str) -> dict[str, float]:
        if scope not in self.weights:
            self.weights[scope] = {v: 1 / len(self.voters) for v in self.voters}
            self.history[scope] = {v: deque(maxlen=self.window) for v in self.voters}
        return self.weights[scope]

    def _with(self, scope: str, names) -> dict[str, float]:
        """The scope's weights, with a drafter a request chose beyond the configured voters at a new voter's."""
        w = self.weights_of(scope)
        for n in names:
            if n not in w:
                w[n], self.history[scope][n] = 1 / len(self.voters), deque(maxlen=self.window)
        return w

    def vote(self, chains: dict[str, list[tuple[int, float]]], rid: str) -> Draft | None:
        """The heaviest root-to-leaf path of the voters' chains [(token, confidence), ...]; each node is credited
        to the heaviest voter through it. None when no voter drafted anything."""
        w = self._with(self.scope(rid), chains)
        alive = {n: ch for n, ch in chains.items() if ch}
        tokens: list[int] = []
        drafters: list[str] = []
        probs: list[float] = []
        depth = 0
        while alive:
            here = {n: ch for n, ch in alive.items() if len(ch) > depth}
            if not here:
                break
            weight: dict[int, float] = {}
            for n, ch in here.items():
                weight[ch[depth][0]] = weight.get(ch[depth][0], 0.0) + w[n]
            # ties go to the token of the heaviest voter among them, then to the earlier voter in the list
            rank = {n: (w[n], -list(w).index(n)) for n in here}
            tok = max(weight, key=lambda t: (weight[t], max(rank[n] for n, ch in here.items() if ch[depth][0] == t)))
            alive = {n: ch for n, ch in here.items() if ch[depth][0] == tok}
            lead = max(alive, key=rank.get)
            tokens.append(tok)
            drafters.append(lead)
            probs.append(alive[lead][depth][1])
            depth += 1
        if not tokens:
            return None
        return Draft(tokens, list(range(-1, len(tokens) - 1)), None, drafters, probs)

    def observe(self, rid: str, committed: list[int], chains: dict[str, list[int]]) -> None:
        """A round's chains against what the target committed after them: each voter's acceptance rate over the
        positions that can be checked (its chain and the committed tokens both reach them), then the update."""
        scope = self.scope(rid)
        w, hist = self._with(scope, chains), self.history[scope]
        for n, toks in chains.items():
            checked = min(len(toks), len(committed))
            if not checked:
                continue
            matched = 0
            while matched < checked and toks[matched] == committed[matched]:
                matched += 1
            hist[n].append(matched / checked)
        for n, rates in hist.items():
            if rates:
                acr = sum(rates) / len(rates)
                if acr > self.reward_threshold:
                    w[n] *= self.reward_factor
                elif acr < self.punish_threshold:
                    w[n] *= self.punish_factor
        total = sum(w.values())
        for n in w:
            w[n] = min(self.max_weight, max(self.min_weight, w[n] / total))

    def release(self, rid: str) -> None:
        if self.per_request:
            self.weights.pop(rid, None)
            self.history.pop(rid, None)
