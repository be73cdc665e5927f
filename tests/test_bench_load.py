"""The load benchmark's pure parts: Poisson schedules, the per-rate summary, the system variants."""

from __future__ import annotations

import statistics

import pytest
import yaml

from benchmarks.load import SYSTEMS, arrivals, p99, replica_seconds, summarize, variant
from model_family.paths import REPO_ROOT


def test_arrivals_are_seeded_bounded_and_poisson():
    a = arrivals(2.0, 600.0, seed=1, cap=10_000)
    assert a == arrivals(2.0, 600.0, seed=1, cap=10_000) and a != arrivals(2.0, 600.0, seed=2, cap=10_000)
    assert all(0 <= x < 600 for x in a) and a == sorted(a)
    gaps = [y - x for x, y in zip(a, a[1:])]
    assert abs(len(a) / 600 - 2.0) < 0.25 and abs(statistics.fmean(gaps) - 0.5) < 0.06
    assert len(arrivals(100.0, 600.0, seed=1, cap=50)) == 50


def test_summary_and_replica_seconds():
    assert replica_seconds([(0.0, 1), (2.0, 3), (3.0, 2)]) == pytest.approx(1 * 2 + 3 * 1)
    reqs = [{"error": None, "ttft": 0.1, "tokens": 11, "tpot": 0.01 * (i + 1)} for i in range(100)]
    s = summarize(reqs + [{"error": "HTTP 429"}], window=10.0, replicas=[(0.0, 2), (10.0, 2)])
    assert s["requests"] == 101 and s["errors"] == 1 and s["goodput_tok_s"] == pytest.approx(110.0)
    assert s["tpot_ms_mean"] == pytest.approx(505.0) and s["tpot_ms_p99"] == pytest.approx(1000 * p99(
        [r["tpot"] for r in reqs])) and s["drafter_replica_s"] == pytest.approx(20.0)


def test_every_system_is_a_valid_variant_of_the_bench_config():
    from config import AppConfig

    base = yaml.safe_load((REPO_ROOT / "examples" / "bench.yaml").read_text())
    for s in SYSTEMS:
        AppConfig.model_validate(variant(base, s)["applications"][0]["args"])
    assert variant(base, "hill_climb")["applications"][0]["args"]["speculation"]["controller"]["kind"] == "hill_climb"
    auto = variant(base, "goodput+autoscaler")["applications"][0]
    assert auto["autoscaling_policy"]["policy_function"] == "autoscale.policy:DrafterAutoscaler"
    assert all(d["deployment"]["autoscaling_config"]["max_replicas"] == 3 for d in auto["args"]["drafters"])
    assert auto["args"]["speculation"]["drafting_tier"] == "deployments"
    min1 = variant(base, "goodput+autoscaler/min1")["applications"][0]["args"]["drafters"]
    assert all(d["deployment"]["autoscaling_config"]["min_replicas"] == 1 for d in min1)
    assert all(d["deployment"]["autoscaling_config"]["min_replicas"] == 0 for d in auto["args"]["drafters"])
    assert variant(base, "goodput+deployments")["applications"][0]["args"]["speculation"]["drafting_tier"] == \
        "deployments"
    assert variant(base, "k=6")["applications"][0]["args"]["speculation"]["k"] == 6
    assert "autoscaling_policy" not in base["applications"][0]  # the base is left alone


def test_the_table_of_a_sampled_run_has_its_check_and_text_statistics():
    from benchmarks.load import format_table
    from benchmarks.sampled import Sampling

    row = {"system": "k=4", "rate": 1.0, "goodput_tok_s": 50.0, "goodput_tok_s_min": 40.0, "goodput_tok_s_max": 60.0,
           "tpot_ms_mean": 20.0, "tpot_ms_p99": 30.0, "ttft_ms_mean": 100.0, "drafter_replica_s": 7.0, "errors": 0,
           "mean_k": None}
    greedy = {"config": {}, "rows": [row]}  # a result recorded before sampling: its table as printed then
    assert format_table(greedy).splitlines()[2] == "| k=4 | 1.0 | 50.0 (40.0-60.0) | 20.0 | 30.0 | 100 | 7 |  | 0 |"
    text = {"outputs": 2, "distinct_tokens": {"median": 30, "min": 20, "max": 40},
            "repeated_4gram_share": {"median": 0.1, "min": 0.0, "max": 0.25}}
    sampled = {"config": {"sampling": Sampling(0.7, 0.95, 0).as_dict()},
               "rows": [row | {"distribution_p": 0.5, "text": text}], "warnings": []}
    table = format_table(sampled)
    assert table.splitlines()[2].endswith("| 0 | p = 0.5 | 30 (20-40) | 0.10 (0.00-0.25) |")
    assert "chi-square p" in table.splitlines()[0] and "- sampling: T = 0.7, top_p 0.95, seed 0" in table
