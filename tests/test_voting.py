"""Minions' majority-voted speculator as a plain class (speculation/voting.py)."""

from __future__ import annotations

import pytest

from config import AppConfig
from speculation.voting import MajorityVote


def test_the_heaviest_path_of_the_trie_wins_not_the_heaviest_voter():
    # Minions' example: 'like' (a + b) beats 'likes' (c), then 'apple' (a) beats 'pear' (b)
    v = MajorityVote(["a", "b", "c"])
    v.weights_of("")  # equal weights
    v.weights[""] = {"a": 0.3, "b": 0.25, "c": 0.45}
    d = v.vote({"a": [(1, 0.5), (2, 0.5)], "b": [(1, 0.9), (3, 0.9)], "c": [(4, 0.99), (5, 0.99)]}, "r")
    assert d.tokens == [1, 2] and d.parents == [-1, 0]
    assert d.drafters == ["a", "a"] and d.probs == [0.5, 0.5]  # each node credited to its heaviest voter
    # a longer chain continues the path where the shorter voters stop; nothing drafted: no draft
    assert v.vote({"a": [(1, 0.5)], "b": [(1, 0.5), (7, 0.5)]}, "r").tokens == [1, 7]
    assert v.vote({"a": [], "b": []}, "r") is None


def test_a_tie_goes_to_the_heavier_voter_then_to_the_earlier_one():
    v = MajorityVote(["a", "b"])
    assert v.vote({"a": [(1, 0.1)], "b": [(2, 0.9)]}, "r").tokens == [1]  # equal weights: the first voter
    v.weights[""] = {"a": 0.4, "b": 0.6}
    assert v.vote({"a": [(1, 0.1)], "b": [(2, 0.9)]}, "r").tokens == [2]


def test_weights_move_toward_the_voters_that_agree_with_the_target_and_stay_clipped():
    v = MajorityVote(["good", "bad", "mid"], window=4, min_weight=0.05, max_weight=0.7)
    for _ in range(40):
        # the target committed 1 2 3; 'good' had it all, 'bad' nothing, 'mid' one of three
        v.observe("r", [1, 2, 3], {"good": [1, 2, 3, 4], "bad": [9, 9], "mid": [1, 5, 6]})
    w = v.weights_of("")
    assert w["good"] == pytest.approx(0.7) and w["bad"] == pytest.approx(0.05)
    assert 0.05 <= w["mid"] < w["good"]
    # now the bad voter is right and the good one wrong: the window forgets, the weights turn
    for _ in range(40):
        v.observe("r", [1, 2, 3], {"good": [9], "bad": [1, 2, 3], "mid": [1, 5, 6]})
    w = v.weights_of("")
    assert w["bad"] > w["good"]
    # now that the good voter lost, the old majority no longer wins a vote
    assert v.vote({"good": [(4, 0.9)], "bad": [(5, 0.1)]}, "r").tokens == [5]


def test_positions_the_target_did_not_reach_are_not_held_against_a_voter():
    v = MajorityVote(["a", "b"], window=8)
    v.observe("r", [1, 2], {"a": [1, 2, 7, 7, 7], "b": [1, 3]})
    assert list(v.history[""]["a"]) == [1.0] and list(v.history[""]["b"]) == [0.5]


def test_per_request_weights_are_separate_and_freed_at_release():
    v = MajorityVote(["a", "b"], per_request=True)
    for _ in range(5):
        v.observe("r1", [1], {"a": [1], "b": [2]})
        v.observe("r2", [2], {"a": [1], "b": [2]})
    assert v.weights["r1"]["a"] > v.weights["r1"]["b"] and v.weights["r2"]["b"] > v.weights["r2"]["a"]
    v.release("r1")
    assert set(v.weights) == {"r2"}


def _cfg(**vote):
    return {"verifier": {"model": "target"}, "drafters": [{"name": "a", "model": "drafter-code"},
                                                          {"name": "b", "model": "drafter-legal"}],
            "speculation": {"mode": "vote", "vote": vote}}


def test_the_vote_config_is_checked():
    assert AppConfig(**_cfg()).speculation.vote.drafters is None
    with pytest.raises(ValueError, match="unknown drafters"):
        AppConfig(**_cfg(drafters=["a", "zz"]))
    with pytest.raises(ValueError, match="at least two voters"):
        AppConfig(**_cfg(drafters=["a"]))
    with pytest.raises(ValueError, match="punish_threshold"):
        AppConfig(**_cfg(punish_threshold=0.9, reward_threshold=0.5))
