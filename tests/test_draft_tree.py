"""Drafts as the engines see them: a tree's best chain (what the vLLM engine verifies) and what is left of a draft
made ahead once the context has grown."""

from __future__ import annotations

from engines.draft_tree import Draft


def _tree() -> Draft:
    # 0:a -> 1:b -> 3:d ; 0:a -> 2:c (surer than b) -> 4:e ; 5:f a second root, less sure than a
    return Draft(tokens=[10, 11, 12, 13, 14, 15], parents=[-1, 0, 0, 1, 2, -1],
                 drafters=["x", "x", "y", "x", "y", "y"], probs=[0.9, 0.4, 0.6, 0.9, 0.5, 0.2])


def test_best_chain_follows_the_most_confident_child():
    chain = _tree().best_chain()
    assert chain.tokens == [10, 12, 14] and chain.parents == [-1, 0, 1]
    assert chain.drafters == ["x", "y", "y"] and chain.probs == [0.9, 0.6, 0.5]


def test_best_chain_without_confidences_takes_the_first_child():
    d = Draft(tokens=[1, 2, 3], parents=[-1, 0, 0])
    assert d.best_chain().tokens == [1, 2]
    chain = Draft.chain([4, 5, 6])
    assert chain.best_chain() is chain


def test_following_keeps_what_still_extends_the_context():
    d = _tree()
    assert d.following([]).tokens == [10, 12, 14]
    rest = d.following([10, 12])
    assert rest.tokens == [14] and rest.parents == [-1] and rest.drafters == ["y"]
    assert d.following([10, 11]) is None  # the context went another way
    assert d.following([10, 12, 14]) is None  # nothing left
