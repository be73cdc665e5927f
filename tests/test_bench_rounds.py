"""`cosine bench rounds`: its clock-free figures from the verify loop's trace records."""

from __future__ import annotations

import pytest

from benchmarks.rounds import format_table, round_stats, step_stats


def _v(rid: str, depth: int, accepted: int) -> dict:
    return {"kind": "verified", "id": rid, "depth": depth, "accepted": accepted}


def test_round_figures_from_verified_records():
    records = [_v("a", 0, 0), _v("a", 4, 4), _v("a", 4, 1), _v("a", 2, 2),
               _v("b", 0, 0), _v("b", 4, 0), _v("b", 4, 2)]
    s = round_stats(records, 4)
    assert s["rounds"] == 5 and s["undrafted_steps"] == 2
    assert s["mean_draft_depth"] == pytest.approx(18 / 5, abs=0.01)
    assert s["share_at_k"] == pytest.approx(4 / 5)
    assert s["tokens_per_drafted_round"] == pytest.approx((5 + 2 + 3 + 1 + 3) / 5)
    # drafts at k accepted 4, 1, 0, 2: depth 1 accepted by 3 of 4, depth 2 by 2 of 3, depth 3 by 1 of 2, depth 4 by 1
    assert s["conditional_acceptance_at_k"] == [0.75, 0.667, 0.5, 1.0]
    # consecutive shares within a request: a (1, .25), (.25, 1); b (0, .5): Pearson r = -0.2292 / 0.3975
    assert s["lag1_accepted_share_correlation"] == pytest.approx(-0.577, abs=1e-3)


def test_a_system_that_never_drafted_still_renders():
    empty = round_stats([_v("a", 0, 0)], 4)
    assert empty["rounds"] == 0 and empty["conditional_acceptance_at_k"] == [None] * 4
    row = {"system": "off", "tokens_per_s": 1.0, "tokens_per_s_min": 1.0, "tokens_per_s_max": 1.0,
           "identical_to_controller": True, **empty}
    assert "| off | 1.0 (1.0-1.0) | - | - | 0.00 | 0% |" in format_table({"rows": [row]})


def test_step_figures_split_verification_from_the_wait_for_drafts():
    steps = [{"kind": "step", "verify_s": 0.10, "wait_s": 0.02}, {"kind": "step", "verify_s": 0.12, "wait_s": 0.0}]
    s = step_stats(steps)
    assert s == {"verify_ms_per_step": 110.0, "draft_wait_ms_per_step": 10.0, "draft_wait_share": 0.083}
    assert step_stats([])["draft_wait_share"] is None
    row = {"system": "c", "tokens_per_s": 1.0, "tokens_per_s_min": 1.0, "tokens_per_s_max": 1.0,
           "identical_to_controller": True, **round_stats([_v("a", 4, 4)], 4), **s}
    assert "| 110.00 | 10.00 (8%) | yes |" in format_table({"rows": [row]})
    old = {k: v for k, v in row.items() if k not in s}  # a file from before these figures: as it was published
    assert format_table({"rows": [old]}).splitlines()[0].endswith("| lag-1 correlation of accepted share "
                                                                  "| output = the controller's |")
