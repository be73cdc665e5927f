"""SpecRouter's chain choice (`routing.chain_choice: latency`), as a plain class.

A request drafting with one drafter drafts with one chain: a drafter alone (drafter -> target) or a drafter with an
assistant (assistant -> drafter -> target, engines/cascade.py). SpecRouter picks, per request and round, the chain
with the least predicted time per token the target accepts (its Eq. 7, read as the digest recommends):

    T_eff(d) = (k * t_d + t_cycle) / E(a_rd, k),    E(a, k) = (1 - a^(k+1)) / (1 - a)

t_d is the drafter's measured time per drafted token (its calls, hops included: an assisted drafter is cheaper
per token than the same drafter alone); t_cycle the measured time a request spends between two of its rounds
(verification, the loop); a_rd the request's per-token acceptance of drafter d, from the drafters' proposals
scored against what the target committed, each round it drafts for the request. Chains ending in the same drafter
model draft the same tokens (an assistant changes the cost, not the chain), so they share the request's acceptance.
The candidates of a round are the router's pick (its ranking and exploration bring new chains in, at the prior
acceptance) and the chains the request has already drafted with, or whose model it has. A candidate whose time per
token is not measured yet is tried once if it could match the best at the quickest measured time. E is the expected tokens
per target pass with i.i.d. acceptance, bonus included.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def expected_tokens(a: float, k: int) -> float:
    """Tokens per target pass for a chain of k drafts, each accepted with probability a (bonus included)."""
    a = min(max(a, 0.0), 0.999)
    return (1 - a ** (k + 1)) / (1 - a)


@dataclass
class ChainCosts:
    ema: float = 0.3  # weight of the newest measurement
    prior_acceptance: float = 0.6  # a drafter's acceptance for a request before it was scored on it
    # a request keeps its chain unless another is predicted this much faster: a chain new to the request first
    # catches up on its context (measured without the margin: 9% slower, bench_results/engine-chain-choice.json)
    switch_margin: float = 0.2

    # drafter -> its chains' model (drafters with the same model draft the same tokens); default: its own name
    families: dict[str, str] = field(default_factory=dict)

    def __post_init__(self):
        self.token_s: dict[str, float] = {}  # drafter -> seconds per drafted token
        self.acceptance: dict[str, dict[str, float]] = {}  # request -> chain model -> per-token acceptance
        self.cycle_s: float | None = None

    def _family(self, name: str) -> str:
        return self.families.get(name, name)

    def tried(self, rid: str, drafters: list[str]) -> list[str]:
        """The drafters whose chains the request has been scored on (itself, or a chain of the same model)."""
        scored = self.acceptance.get(rid, {})
        return [d for d in drafters if self._family(d) in scored]

    def _blend(self, old: float | None, new: float) -> float:
        return new if old is None else self.ema * new + (1 - self.ema) * old

    def observe_call(self, name: str, seconds: float, tokens: int) -> None:
        if tokens > 0:
            self.token_s[name] = self._blend(self.token_s.get(name), seconds / tokens)

    def observe_cycle(self, seconds: float) -> None:
        self.cycle_s = self._blend(self.cycle_s, seconds)

    def observe_acceptance(self, rid: str, name: str, accepted: int, drafted: int) -> None:
        """A drafter's chain against the committed tokens: `accepted` of its `drafted` tokens matched. The
        per-token estimate counts the rejection that ended a partly accepted chain as a trial (smoothed by 1/2)."""
        if drafted <= 0:
            return
        trials = accepted + 1 if accepted < drafted else drafted
        per, fam = self.acceptance.setdefault(rid, {}), self._family(name)
        per[fam] = self._blend(per.get(fam), (accepted + 0.5) / (trials + 1))

    def release(self, rid: str) -> None:
        self.acceptance.pop(rid, None)

    def seconds_per_token(self, rid: str, name: str, k: int, token_s: float | None = None) -> float | None:
        """T_eff of drafting k with `name` for this request (at `token_s` per drafted token if given); None until
        the drafter's latency is measured."""
        t = self.token_s.get(name) if token_s is None else token_s
        if t is None or k <= 0:
            return None
        a = self.acceptance.get(rid, {}).get(self._family(name), self.prior_acceptance)
        return (k * t + (self.cycle_s or 0.0)) / expected_tokens(a, k)

    def best(self, rid: str, candidates: list[str], k: int, current: str | None = None) -> str | None:
        """The candidate with the least T_eff, or the request's `current` chain unless that is `switch_margin`
        slower. An unmeasured candidate is returned to be tried if, at the quickest measured time per token, it
        would be as good as the best (a chain of the best one's model, cheaper or not, is tried once). None if the
        first candidate, routing's pick, is unmeasured: routing decides, and its exploration brings new chains in."""
        costs = {n: self.seconds_per_token(rid, n, k) for n in candidates}
        measured = {n: c for n, c in costs.items() if c is not None}
        if not candidates or costs[candidates[0]] is None:
            return None
        best = min(measured, key=measured.get)
        quickest = min(self.token_s[n] for n in measured)
        for n in candidates:
            if costs[n] is None and self.seconds_per_token(rid, n, k, quickest) <= measured[best]:
                return n
        if current in measured and measured[current] <= (1 + self.switch_margin) * measured[best]:
            return current
        return best
