"""Router (Eq. 1-3) and confidence fusion (Eq. 4) as plain classes."""

from __future__ import annotations

import torch

from engines.interface import Proposal
from speculation.fusion import FusionTree, fuse_chains
from config import RoutingSpec
from speculation.routing import Router, alignment


def _emb():
    e = torch.eye(6)
    e[5] = e[4] + 0.1 * e[3]  # token 5 is a near-synonym of token 4
    return e


def test_alignment_scores_exact_matches_high_and_misses_zero():
    e = _emb()
    assert alignment([1, 2, 3], [1, 2, 3], [0.9, 0.9, 0.9], e) > 0.99
    # unfused: a chain rejected at once scores 0 (its later tokens followed its own wrong token)
    assert alignment([1, 2, 3], [0, 2, 3], [0.9, 0.9, 0.9], e, fused=False) == 0.0
    # fused: every drafter was fed the accepted token, so its later positions still count
    assert abs(alignment([1, 2, 3], [0, 2, 3], [0.9, 0.9, 0.9], e) - 2 / 3) < 1e-9
    # fused round: the target accepted [4] (another drafter's token) then said 2; this drafter said 5 (a
    # near-synonym of 4) then 2: credit for the near-synonym, full credit for guessing the target's own token
    assert alignment([4, 2], [5, 2], [0.9, 0.9], e) > 0.9
    assert alignment([4, 2], [5, 2], [0.9, 0.9], e, fused=False) == 0.0  # its own chain broke at once
    # the target's own token (L_acc = 1 here) earns nothing unless guessed: a confident miss is not rewarded
    assert alignment([1, 4], [1, 5], [0.9, 0.9], e) == 0.5


def test_router_learns_the_drafter_that_agrees():
    r = Router(["code", "legal", "bio"], RoutingSpec(drafters_per_request=1, beta=0.0, alpha=0.0))
    r.add_request("x")
    for _ in range(5):
        r.update("x", 3.0, {"code": 0.2, "legal": 0.9, "bio": 0.1})
    assert r.ranking("x")[0] == "legal"
    assert r.route("x") == ["legal"]


def test_router_cold_start_follows_prompt_likelihood_and_explores_when_acceptance_is_low():
    r = Router(["code", "legal", "bio"], RoutingSpec(drafters_per_request=1, alpha=1.0, beta=0.0, tau=2.0))
    r.add_request("x", {"code": -2.0, "legal": -5.0, "bio": -6.0})
    assert r.ranking("x")[0] == "code" and r.route("x") == ["code"]
    r.update("x", 1.0, {"code": 0.1})  # poor acceptance: every place is now random
    picks = {r.route("x")[0] for _ in range(50)}
    assert len(picks) > 1


def _p(tok, prob, alts=()):
    return Proposal(tok, prob, [tok] + [a for a, _ in alts], [prob] + [p for _, p in alts])


def test_fusion_picks_the_most_confident_token_and_keeps_losers_as_branches():
    f = FusionTree(budget=6)
    assert f.step({"a": _p(10, 0.9), "b": _p(11, 0.4)}) == 10
    assert f.step({"a": _p(12, 0.3), "b": _p(13, 0.8)}) == 13
    d = f.build()
    assert d.tokens[:2] == [10, 13] and d.parents[:2] == [-1, 0]
    branches = {(t, p) for t, p in zip(d.tokens[2:], d.parents[2:])}
    assert (11, -1) in branches and (12, 0) in branches  # siblings of the fused token at each depth
    assert d.drafters[:2] == ["a", "b"]


def test_fusion_trims_to_budget_chain_first():
    f = FusionTree(budget=3)
    for _ in range(4):
        f.step({"a": _p(1, 0.9), "b": _p(2, 0.5)})
    d = f.build()
    assert len(d) == 3 and d.parents == [-1, 0, 1]


def test_one_shot_fusion_follows_the_more_confident_chain_where_they_disagree():
    chains = {"a": [(1, 0.9), (2, 0.4), (3, 0.8)], "b": [(1, 0.7), (5, 0.6), (6, 0.9)]}
    d = fuse_chains(chains, budget=8)
    # shared first token, then b is more confident (0.6 > 0.4): the main path is 1, 5, 6 and a's 2, 3 hang off 1
    assert d.tokens[:3] == [1, 5, 6] and d.parents[:3] == [-1, 0, 1]
    assert d.drafters[:3] == ["a", "b", "b"]  # the shared token is credited to its more confident proposer
    assert list(zip(d.tokens[3:], d.parents[3:])) == [(2, 0), (3, 3)]
    # the budget keeps the main path whole and cuts the branch
    small = fuse_chains(chains, budget=4)
    assert small.tokens == [1, 5, 6, 2]
    assert fuse_chains({"a": [], "b": []}, budget=4) is None


def test_cold_start_ranks_a_generalist_first_only_when_no_domain_drafter_explains_the_prompt():
    cfg = RoutingSpec(drafters_per_request=1, beta=0.0, generalist_margin=0.5)
    r = Router(["code", "legal", "generic"], cfg, frozenset({"generic"}))
    # in-domain prompt: the generalist explains it a little better than the code drafter, as it usually does
    r.add_request("x", {"code": -4.2, "legal": -5.1, "generic": -3.9})
    assert r.ranking("x") == ["code", "generic", "legal"]
    # a prompt no domain drafter knows: the generalist is far ahead
    r.add_request("y", {"code": -7.0, "legal": -7.2, "generic": -5.5})
    assert r.ranking("y")[0] == "generic"
    plain = Router(["code", "legal", "generic"], cfg)  # not marked as a generalist: raw likelihood decides
    plain.add_request("x", {"code": -4.2, "legal": -5.1, "generic": -3.9})
    assert plain.ranking("x")[0] == "generic"


def test_what_the_models_added_is_kept_from_rounds_where_they_drafted():
    """A request's `model_accepted` (drafted tokens accepted in rounds with drafter models) ignores rounds the
    model-free drafters drafted alone: it is what the coordinator weighs against the models' wait."""
    r = Router(["code", "ngram"], model_free=frozenset({"ngram"}))
    r.add_request("a")
    r.update("a", 3.0, {"ngram": 1.0})  # the n-gram drafter alone: 2 drafted tokens accepted, not the models'
    assert r.requests["a"].model_accepted is None
    r.update("a", 4.0, {"code": 0.5, "ngram": 0.2})
    assert r.requests["a"].model_accepted == 3.0
    r.update("a", 1.0, {"code": 0.0})
    assert 0.0 < r.requests["a"].model_accepted < 3.0  # an average over the rounds with models
