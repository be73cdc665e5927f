"""`cosine bench breakdown`: how a step's time is read from token arrivals, and the rows' ratios against vLLM's own."""

from __future__ import annotations

import pytest

from benchmarks import breakdown, workers


def test_intervals_count_only_steps_after_the_last_prefill():
    # request a's first token at 1.0, b's at 1.5 (b prefilled later): only arrivals from 1.5 on are decode steps
    arrivals = {"a": [1.0, 1.5, 1.6, 1.7], "b": [1.5, 1.6, 1.7]}
    got = workers.step_intervals(arrivals, max(t[0] for t in arrivals.values()))
    assert sorted(round(x, 6) for x in got) == [0.1] * 4


def test_rows_compare_each_repeat_with_vllms_own_of_the_same_repeat():
    per_repeat = {(breakdown.VLLM, 1, 64): [20.0, 30.0, 25.0], (breakdown.OFF, 1, 64): [21.0, 30.0, 30.0],
                  (breakdown.VLLM_SERVE, 1, 64): [40.0, 40.0, 40.0], (breakdown.SERVED, 1, 64): [50.0, 40.0, 44.0]}
    rows = {r["system"]: r for r in breakdown.rows(per_repeat)}
    off = rows[breakdown.OFF]
    # per repeat: 20/21, 30/30, 25/30 -> median 0.952; the median step 30 against 25: 5 ms added
    assert off["speed_vs_baseline"] == pytest.approx(0.952, abs=1e-3)
    assert (off["speed_vs_baseline_min"], off["speed_vs_baseline_max"]) == (pytest.approx(0.833, abs=1e-3), 1.0)
    assert off["host_ms_added"] == 5.0 and off["ms_per_step_repeats"] == [21.0, 30.0, 30.0]
    served = rows[breakdown.SERVED]
    assert served["baseline"] == breakdown.VLLM_SERVE and served["speed_vs_baseline"] == pytest.approx(40 / 44, abs=1e-3)
    assert "| ours, speculation off | 1 | 64 | 30.00 (21.00-30.00) | 0.952x (0.833-1.000) | +5.00 | - | - |" in \
        breakdown.table({"rows": list(rows.values())})
