"""Every benchmark's JSON keeps each repeat's figure beside the median and the range (the docs' ratios are read by
repeat, and a noisy baseline is judged by its repeats): the rows of `cosine bench engine` and `collaborative`
(benchmarks/common.py `median_row`) and of `cosine bench serve`."""

from __future__ import annotations

from dataclasses import asdict

from benchmarks.common import Row, median_row
from benchmarks.serve import median_run


def _row(tps: float) -> Row:
    return Row(method="chain", batch=1, tokens=100, seconds=100 / tps, tokens_per_s=tps, mean_accepted_length=None,
               target_passes_per_token=None)


def test_the_median_row_keeps_every_repeat_in_run_order_and_leaves_the_runs_as_they_were():
    runs = [_row(30.0), _row(10.0), _row(20.0), _row(40.0)]
    row = median_row(runs)
    assert row.tokens_per_s == 25.0 and (row.tokens_per_s_min, row.tokens_per_s_max, row.runs) == (10.0, 40.0, 4)
    assert row.tokens_per_s_by_repeat == [30.0, 10.0, 20.0, 40.0]
    # a summary written after each repeat reads the runs again: an even count's median must not overwrite one
    assert [r.tokens_per_s for r in runs] == [30.0, 10.0, 20.0, 40.0]
    assert median_row(runs[:3]).tokens_per_s_by_repeat == [30.0, 10.0, 20.0]
    assert asdict(row)["tokens_per_s_by_repeat"] == [30.0, 10.0, 20.0, 40.0]


def test_the_served_benchmarks_median_keeps_every_repeat_in_run_order():
    runs = [{"tokens_per_s": t, "texts": ["same"]} for t in (12.0, 9.0, 15.0)]
    row = median_run(runs)
    assert row["tokens_per_s"] == 12.0 and (row["tokens_per_s_min"], row["tokens_per_s_max"]) == (9.0, 15.0)
    assert row["tokens_per_s_by_repeat"] == [12.0, 9.0, 15.0]
