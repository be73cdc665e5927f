"""The soak benchmark's pure parts: the cyclic schedule with bursts, and the outcome summary."""

from __future__ import annotations

from benchmarks.soak import schedule, summarize


def test_schedule_has_bursts_mixed_clients_and_bounds():
    plans = schedule(600, rate=1.0, overload_rate=8.0, period=120, overload_share=0.25, hang_up_share=0.1,
                     prompts=48, max_requests=100_000, seed=0)
    assert plans == schedule(600, 1.0, 8.0, 120, 0.25, 0.1, 48, 100_000, seed=0)  # seeded
    assert [p.at for p in plans] == sorted(p.at for p in plans) and all(0 <= p.at < 600 for p in plans)
    calm = [p for p in plans if p.at % 120 < 90]
    burst = [p for p in plans if p.at % 120 >= 90]
    assert 0.7 < len(calm) / (5 * 90 * 1.0) < 1.3 and 0.8 < len(burst) / (5 * 30 * 8.0) < 1.2
    assert 0.4 < sum(p.stream for p in plans) / len(plans) < 0.6
    assert 0.05 < sum(p.hang_up for p in plans) / len(plans) < 0.15
    assert {p.prompt for p in plans} == set(range(48))
    assert len(schedule(600, 1.0, 8.0, 120, 0.25, 0.1, 48, max_requests=50, seed=0)) == 50


def test_summary_counts_only_unexpected_outcomes_as_failures():
    results = ([{"outcome": "completed", "latency": 0.1 * (i + 1)} for i in range(100)]
               + [{"outcome": "hung up (client)"}] * 5 + [{"outcome": "refused (429)"}] * 3
               + [{"outcome": "HTTP 500"}, {"outcome": "stream error: internal_error"}])
    s = summarize(results)
    assert s["requests"] == 110 and s["failed"] == 2
    assert s["outcomes"]["refused (429)"] == 3 and s["outcomes"]["hung up (client)"] == 5
    assert abs(s["latency_s_p50"] - 5.1) < 1e-9 and abs(s["latency_s_p99"] - 10.0) < 1e-9
