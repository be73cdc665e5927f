"""CoSine's adaptive request routing (Sec. 4.2, Eq. 1-3), as a plain class.

Per request and drafter the router keeps a routing score m in (0, 1) (the routing matrix M). After each
verification, a drafter's draft is scored position by position:

    d_i = cos(H(x_i), H(x_{n,i})) for positions before the first rejection (i < L_acc), else 0      (Eq. 1)
    m   = (1/K) sum_i  c_i d_i / (c_i d_i + (1 - c_i)(1 - d_i))                                       (Eq. 2)

where x_i is the token the target committed at position i, x_{n,i} the drafter's token, c_i the drafter's
confidence in it and H the target's input-embedding layer. The score the router keeps is an exponential moving
average of m over rounds.

Drafter choice (Eq. 3): the paper calls alpha > beta "exploration coefficients"; we read them as the probability
of filling a drafter place at random rather than by top score: alpha while the request's recent accepted length is
below tau (explore: its drafters are not working), beta otherwise (exploit).

Cold start: a new request's scores come from each drafter's mean log-likelihood of the prompt's first `score_tokens`
tokens (only the routed drafters read the rest of a longer context), a softmax over drafters: each domain drafter is
a language model of its domain, so this is a Bayes classifier of the prompt's domain with a flat prior. A generalist
drafter (trained on every domain) tends to give a prompt a higher likelihood than the matching specialist, yet
drafts its domain worse; it enters the softmax `generalist_margin` nats per token down, so it leads only on prompts
no domain drafter explains. Measured on 240 held-out 64-token prompts, own domain first: 141 raw, 186 with the
margin, 206 with the margin and the drafters' per-token floor (engines/drafter.py). Without prompt scores every
drafter starts equal.

Model-free drafters (n-gram, suffix: engines/model_free.py) take no place: the routed places go to the drafter
models, and every model-free drafter joins each routed round beside them (and the generalist participation's). They
cost a lookup, not a forward pass, and propose nothing where the context's end never occurred before. They are asked
first (the coordinator's `_model_free_first`): where one's chain is expected to have `routing.model_free_alone`
tokens accepted, the round is theirs alone, without the models' forwards (Snowflake's hybrid of suffix and model
drafts, chosen per step by the match's score); elsewhere fusion (Eq. 4) weighs a match's confidence (its
continuation's frequency) against the models' probabilities, token by token. A match's frequency is what the text
repeated, not what the target will accept: sampled text at T = 0.7 accepted 15% of the suffix drafter's tokens where
their confidences claimed far more. So each model-free drafter's confidences are calibrated per request by what the
target accepted (`calibrated`): scaled by the request's accepted tokens over the acceptance its confidences claimed,
on the positions the target judged (decayed sums, a new request starting from every request's), before fusion and
the alone-or-with-models choice see them. Their routing scores are kept by the same Eq. 1-2 as the models' (their
tokens are scored against what the target committed), so a request's ranking at release says which drafter its
output followed; they have no prompt likelihood, so the cold start leaves them at 0.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import torch

from config import RoutingSpec
from engines.interface import Proposal

# model-free drafters' calibration (`Router.calibrated`): a request's sums decay by this per round (the text's
# regime, copying or free, changes within a request), every request's by this per update; a new request's starts as
# this many claimed tokens at every request's ratio; the factor and the confidences it scales stay in these bounds
CALIBRATION_DECAY, CALIBRATION_DECAY_ALL, CALIBRATION_PRIOR = 0.7, 0.99, 2.0
FACTOR_BOUNDS, MAX_CONFIDENCE = (0.02, 4.0), 0.98


def alignment(committed: list[int], drafted: list[int], confidences: list[float], embeddings: torch.Tensor,
              fused: bool = True) -> float:
    """Eq. 1-2 for one drafter's draft: the routing score of this round, in [0, 1].

    `committed` is what the target committed since the round started: the accepted draft tokens, then the
    target's own token (correction or bonus), so L_acc = len(committed) - 1. With fusion every drafter was fed the
    fused token at each depth, so its proposal at depth i competes for the same position as the committed token:
    positions before L_acc score d = cos(H(x_i), H(x_{n,i})) (near-synonyms earn credit), the position of the
    target's own token scores 1 if the drafter guessed it (where the fused draft failed) and 0 otherwise, later
    positions 0. Without fusion a drafter's chain follows its own tokens, so it scores its exact prefix only.
    """
    k = len(drafted)
    if k == 0 or not committed:
        return 0.0
    l_acc = len(committed) - 1
    total = 0.0
    for i in range(min(k, len(committed))):
        if drafted[i] == committed[i]:
            d = 1.0
        elif fused and i < l_acc:
            a, b = embeddings[committed[i]], embeddings[drafted[i]]
            d = float(torch.nn.functional.cosine_similarity(a, b, dim=0).clamp(0.0, 1.0))
        else:
            d = 0.0
        c = min(max(confidences[i], 1e-6), 1 - 1e-6)
        num = c * d
        den = num + (1 - c) * (1 - d)
        total += num / den if den > 0 else 0.0
        if not fused and d < 1.0:
            break
    return total / k


@dataclass
class _RequestState:
    scores: dict[str, float]
    recent_accepted_length: float | None = None
    rounds: int = 0
    # drafted tokens accepted in rounds where drafter models drafted (EMA): what the models are worth to the request
    # while rounds go without them (the coordinator's pricing of a round's model forwards)
    model_accepted: float | None = None
    # per model-free drafter: [its tokens the target accepted, the acceptance its raw confidences claimed] (decayed)
    matched: dict[str, list[float]] = field(default_factory=dict)


@dataclass
class Router:
    drafters: list[str]
    config: RoutingSpec = field(default_factory=RoutingSpec)
    generalists: frozenset[str] = frozenset()  # drafters trained on every domain rather than one
    model_free: frozenset[str] = frozenset()  # n-gram and suffix drafters: in every routed round, no place taken

    def __post_init__(self):
        self.requests: dict[str, _RequestState] = {}
        self.rng = random.Random(self.config.seed)
        self.matched_all = {n: [1.0, 1.0] for n in self.model_free}  # every request's, as `_RequestState.matched`

    def add_request(self, rid: str, prompt_loglik: dict[str, float] | None = None) -> None:
        """Cold start from each drafter's mean log-likelihood per prompt token, when known (see module doc)."""
        if prompt_loglik:
            t, margin = self.config.cold_start_temperature, self.config.generalist_margin
            zs = {n: (prompt_loglik[n] - (margin if n in self.generalists else 0.0)) / t if n in prompt_loglik
                  else -math.inf for n in self.drafters}
            top = max(zs.values())
            ex = {n: math.exp(z - top) for n, z in zs.items()}
            s = sum(ex.values())
            scores = {n: v / s for n, v in ex.items()}
        else:
            scores = {n: 1.0 / len(self.drafters) for n in self.drafters}
        self.requests[rid] = _RequestState(scores)

    def release(self, rid: str) -> None:
        self.requests.pop(rid, None)

    def ranking(self, rid: str) -> list[str]:
        s = self.requests[rid].scores
        return sorted(self.drafters, key=lambda n: -s[n])

    def exploring(self, rid: str) -> bool:
        st = self.requests[rid]
        return st.recent_accepted_length is not None and st.recent_accepted_length < self.config.tau

    def route(self, rid: str, n: int | None = None, exclude: frozenset[str] | set[str] = frozenset()) -> list[str]:
        """Drafters for the next round: top-scored drafter models, each place taken at random with prob
        alpha/beta, then every model-free drafter; none of `exclude` (drafters sitting out)."""
        ranked = [d for d in self.ranking(rid) if d not in exclude and d not in self.model_free]
        n = min(n or self.config.drafters_per_request, len(ranked))
        p_random = self.config.alpha if self.exploring(rid) else self.config.beta
        chosen: list[str] = []
        for _ in range(n):
            rest = [d for d in ranked if d not in chosen]
            chosen.append(self.rng.choice(rest) if self.rng.random() < p_random else rest[0])
        return chosen + [d for d in self.drafters if d in self.model_free and d not in exclude]

    def update(self, rid: str, accepted_length: float, round_scores: dict[str, float]) -> None:
        """Feedback after a verification: the request's accepted length and each participating drafter's m."""
        st = self.requests.get(rid)
        if st is None:
            return
        w = self.config.ema
        st.recent_accepted_length = accepted_length if st.recent_accepted_length is None else (
            w * accepted_length + (1 - w) * st.recent_accepted_length)
        for name, m in round_scores.items():
            st.scores[name] = w * m + (1 - w) * st.scores[name]
        if any(n not in self.model_free for n in round_scores):
            drafted = accepted_length - 1
            st.model_accepted = drafted if st.model_accepted is None else w * drafted + (1 - w) * st.model_accepted
        st.rounds += 1

    # ------------------------------------------------------------------ model-free drafters' calibration
    def factor(self, rid: str, name: str) -> float:
        """What the target accepted of `name`'s drafts for the request over what their confidences claimed."""
        h_all, c_all = self.matched_all[name]
        st = self.requests.get(rid)
        h, c = st.matched.get(name, (0.0, 0.0)) if st is not None else (0.0, 0.0)
        f = (h + CALIBRATION_PRIOR * h_all / c_all) / (c + CALIBRATION_PRIOR)
        return min(max(f, FACTOR_BOUNDS[0]), FACTOR_BOUNDS[1])

    def calibrated(self, rid: str, name: str, chain: list[Proposal]) -> tuple[list[Proposal], float]:
        """A model-free drafter's chain with its confidences scaled by the request's factor, and the factor."""
        f = self.factor(rid, name)
        return [Proposal(p.token, min(p.prob * f, MAX_CONFIDENCE), p.top_tokens,
                         [min(q * f, MAX_CONFIDENCE) for q in p.top_probs], p.context_loglik) for p in chain], f

    def observe_matches(self, rid: str, committed: list[int], drafted: dict[str, list[tuple[int, float]]],
                        fused: bool) -> None:
        """The target committed `committed` after a round in which model-free drafters proposed `drafted` (token,
        raw confidence): each position the target judged (fed the committed prefix: with fusion every position up
        to the target's own token, without it up to the drafter's first miss) adds whether it was accepted and what
        its raw confidence claimed."""
        st = self.requests.get(rid)
        if st is None:
            return
        for name, props in drafted.items():
            if name not in self.model_free or not props:
                continue
            hits = claimed = 0.0
            for i in range(min(len(props), len(committed))):
                hit = props[i][0] == committed[i]
                hits, claimed = hits + hit, claimed + props[i][1]
                if not fused and not hit:
                    break
            if claimed == 0:
                continue
            mine = st.matched.setdefault(name, [0.0, 0.0])
            mine[0], mine[1] = CALIBRATION_DECAY * mine[0] + hits, CALIBRATION_DECAY * mine[1] + claimed
            every = self.matched_all[name]
            every[0] = CALIBRATION_DECAY_ALL * every[0] + hits
            every[1] = CALIBRATION_DECAY_ALL * every[1] + claimed
