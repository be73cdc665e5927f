"""SpecRouter's chain choice (speculation/chains.py): the least predicted time per accepted token."""

from __future__ import annotations

import asyncio
import time

import pytest

from config import RoutingSpec
from speculation.chains import ChainCosts, expected_tokens
from speculation.coordinator import SpeculationCoordinator
from speculation.messages import DraftRequest, Proposal


def test_expected_tokens():
    assert expected_tokens(0.0, 4) == pytest.approx(1.0)
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert expected_tokens(1.0, 4) == pytest.approx(5.0, rel=0.01)  # clipped just below 1


def test_a_slow_accurate_chain_wins_only_when_its_acceptance_pays_for_its_time():
    costs = ChainCosts(ema=1.0, switch_margin=0.0)
    costs.observe_cycle(0.030)  # a 30 ms verify cycle
    costs.observe_call("small", 0.004, 4)  # 1 ms per token
    costs.observe_call("original", 0.048, 4)  # 12 ms per token
    costs.observe_call("assisted", 0.016, 4)  # the same chains as original, 4 ms per token
    for name, acc in (("small", 1), ("original", 4), ("assisted", 4)):
        costs.observe_acceptance("r", name, acc, 4)
    # per-token acceptance 0.5 (1 of 4, then a rejection) and 0.9 (4 of 4): 1.94 and 4.10 tokens per target pass
    assert costs.best("r", ["small", "original"], 4) == "small"  # (4 + 30) / 1.94 < (48 + 30) / 4.10
    assert costs.best("r", ["small", "original", "assisted"], 4) == "assisted"  # (16 + 30) / 4.10 is least
    costs.observe_cycle(0.300)  # verification dominates: acceptance is all that counts
    assert costs.best("r", ["small", "original"], 4) == "original"
    costs.switch_margin = 1.0  # original is predicted 1.85x faster: within a margin of 100%, small is kept
    assert costs.best("r", ["small", "original"], 4, current="small") == "small"
    costs.switch_margin = 0.5
    assert costs.best("r", ["small", "original"], 4, current="small") == "original"
    assert costs.best("r", ["unmeasured"], 4) is None  # nothing measured: routing decides
    # an unmeasured chain that could win at the quickest measured time is tried (at the prior acceptance, 0.6)
    assert costs.best("r", ["small", "unmeasured"], 4) == "unmeasured"
    costs.release("r")
    assert "r" not in costs.acceptance


def test_chains_of_one_model_share_acceptance_and_the_cheaper_is_tried_and_kept():
    """A 3-level chain drafts the 2-level chain's tokens: scored on one, the request is scored on both; the
    unmeasured one is tried once (it could be cheaper), then the cheaper one wins on time alone."""
    costs = ChainCosts(ema=1.0, switch_margin=0.2, families={"original": "target", "assisted": "target"})
    costs.observe_cycle(0.030)
    costs.observe_call("original", 0.048, 4)
    costs.observe_call("small", 0.004, 4)
    costs.observe_acceptance("r", "original", 4, 4)
    costs.observe_acceptance("r", "small", 0, 4)
    assert costs.tried("r", ["small", "original", "assisted", "other"]) == ["small", "original", "assisted"]
    assert costs.seconds_per_token("r", "assisted", 4, 0.012) == costs.seconds_per_token("r", "original", 4)
    assert costs.best("r", ["original", "assisted", "small"], 4, current="original") == "assisted"  # tried
    costs.observe_call("assisted", 0.016, 4)
    assert costs.best("r", ["original", "assisted", "small"], 4, current="assisted") == "assisted"
    assert costs.best("r", ["original", "assisted", "small"], 4, current="original") == "assisted"  # 1.6x
    costs.observe_call("assisted", 0.056, 4)  # now dearer than the original alone, by less than the margin
    assert costs.best("r", ["original", "assisted"], 4, current="assisted") == "assisted"


def test_the_coordinator_drafts_with_the_cheapest_chain_per_accepted_token():
    """Two drafters propose what the target commits, one taking 10 ms a token, the other 1 ms; a third is quick
    and always wrong. Whatever the router proposes (it explores at random here), once the quick accurate one has
    drafted it is kept: neither the slow one nor the wrong one, once timed, beats its time per accepted token."""
    truth = list(range(100, 200))

    async def step(name, calls):
        steps = max(c.steps for c in calls)  # a forward pass per drafted token
        await asyncio.sleep({"good-slow": 0.01, "good-quick": 0.001, "wrong-quick": 0.001}[name] * steps)
        out = {}
        for c in calls:
            at = len(c.context) - 3  # three prompt tokens
            toks = [truth[at + i] if name.startswith("good") else 7 for i in range(c.steps)]
            ll = -1.0 if c.score_context else None  # every drafter explains the prompt equally
            out[c.request_id] = [Proposal(t, 0.9, [t], [0.9], ll if i == 0 else None) for i, t in enumerate(toks)]
        return out

    names = ["good-slow", "good-quick", "wrong-quick"]
    coord = SpeculationCoordinator(names, RoutingSpec(drafters_per_request=1, chain_choice="latency", alpha=0.5,
                                                       beta=0.5))  # the router explores: chains get tried
    context = [1, 2, 3]
    used = []
    for _ in range(16):
        time.sleep(0.01)  # the verify cycle
        drafts = asyncio.run(coord.draft([DraftRequest("r", list(context), 4, 8)], step)).drafts
        d = drafts["r"]
        used.append(d.drafters[0])
        context += truth[len(context) - 3:len(context) - 3 + len(d) + 1]  # all accepted, plus the bonus
    first = used.index("good-quick")
    # once tried, it is kept: the slow one is never taken again, the wrong one at most once (routing's exploration
    # of a chain not yet timed: the prompt-scoring round's calls, which prefill the prompt, time nothing)
    assert first < 12 and "good-slow" not in used[first:] and used[first:].count("wrong-quick") <= 1, used
    assert used[-1] == "good-quick", used
    state = coord.state()
    assert state["chain_token_ms"]["good-slow"] > 5 * state["chain_token_ms"]["good-quick"]
    assert state["chain_cycle_ms"] is not None
