"""CoSine's confidence-based token fusion (Sec. 4.2, Eq. 4, Alg. 1), as a plain class.

The chosen drafters draft in lockstep. At every step each proposes its next token with its confidence; the
token of the most confident drafter is chosen (Eq. 4) and fed back to all of them, so every drafter continues
from the fused prefix. The proposals that lost are kept as alternative branches: a sibling of the fused token at
that depth. At the end the tree is trimmed to the verification budget: the fused chain first (it is what every
drafter agreed to continue), then alternatives by confidence. Fused tokens are deterministic proposals, so the
verifier treats them as one-hot q, which is lossless for sampling too (see engines/rules.py).

Lockstep fusion costs a round trip to the drafters per depth. `fuse_chains` is its one-shot form: every drafter
drafts its own chain in one call, all from the same context; Eq. 4 picks the main path wherever the chains
disagree, and a losing chain stays a branch from there on (its continuation is conditioned on its own token, so
it is still a coherent guess). Without feedback a loser cannot win a later depth, which is what lockstep buys.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engines.draft_tree import Draft, TreeBuilder
from engines.interface import Proposal


@dataclass
class FusionTree:
    budget: int  # max draft nodes sent to the verifier
    alternatives_per_step: int = 2
    chain: list[tuple[int, float, str]] = field(default_factory=list)  # (token, confidence, drafter)
    alts: list[tuple[int, int, float, str]] = field(default_factory=list)  # (depth, token, confidence, drafter)

    def step(self, proposals: dict[str, Proposal]) -> int:
        """Fuse one step; returns the token every drafter must be fed next."""
        if not proposals:
            raise ValueError("no proposals to fuse")
        name, best = max(proposals.items(), key=lambda kv: (kv[1].prob, kv[0]))
        depth = len(self.chain)
        self.chain.append((best.token, best.prob, name))
        seen = {best.token}
        losers = sorted(((p.prob, p.token, n) for n, p in proposals.items() if p.token != best.token), reverse=True)
        # the winner's own runner-up tokens are alternatives too (CoSine keeps non-selected tokens as branches)
        runner_up = [(pr, t, name) for t, pr in zip(best.top_tokens, best.top_probs) if t != best.token]
        for prob, tok, n in sorted(losers + runner_up, reverse=True):
            if tok in seen:
                continue
            if sum(1 for a in self.alts if a[0] == depth) >= self.alternatives_per_step:
                break
            seen.add(tok)
            self.alts.append((depth, tok, prob, n))
        return best.token

    def build(self) -> Draft:
        """The fused chain (node i at depth i) plus alternatives as siblings, trimmed to the budget."""
        chain = self.chain[:self.budget]
        tokens = [t for t, _, _ in chain]
        parents = list(range(-1, len(chain) - 1))
        drafters = [n for _, _, n in chain]
        probs = [p for _, p, _ in chain]
        room = self.budget - len(chain)
        for depth, tok, prob, n in sorted(self.alts, key=lambda a: -a[2])[:max(0, room)]:
            if depth >= len(chain):
                continue
            tokens.append(tok)
            parents.append(depth - 1)
            drafters.append(n)
            probs.append(prob)
        # parents must precede children: alternatives only hang off chain nodes, which come first
        return Draft(tokens, parents, None, drafters, probs)


def fuse_chains(chains: dict[str, list[tuple[int, float]]], budget: int) -> Draft | None:
    """One-shot fusion of drafters' own chains [(token, confidence), ...], drafted from the same context: the main
    path takes the most confident token among the chains that agree with it so far (Eq. 4); each chain that
    disagrees becomes a branch at that depth. The main path goes in first, then the branches by the confidence
    of their diverging token, all trimmed to `budget` nodes. None when there is nothing to draft."""
    alive = {n: ch for n, ch in chains.items() if ch}
    main: list[tuple[int, float, str]] = []
    branches: list[tuple[float, str]] = []
    depth = 0
    while alive:
        here = {n: ch for n, ch in alive.items() if len(ch) > depth}
        if not here:
            break
        name = max(here, key=lambda n: (here[n][depth][1], n))
        tok = here[name][depth][0]
        main.append((tok, here[name][depth][1], name))
        branches += [(ch[depth][1], n) for n, ch in here.items() if ch[depth][0] != tok]
        alive = {n: ch for n, ch in here.items() if ch[depth][0] == tok}
        depth += 1
    if not main:
        return None
    tb = TreeBuilder(merge=True)
    tb.add_chain([t for t, _, _ in main], None, [n for _, _, n in main], [p for _, p, _ in main], budget)
    for _, n in sorted(branches, reverse=True):
        tb.add_chain([t for t, _ in chains[n]], None, n, [p for _, p in chains[n]], budget)
    return tb.build()
