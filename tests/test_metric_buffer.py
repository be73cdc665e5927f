"""The verifier's metrics are recorded in process and published to Ray on a timer (deployments/verifier.py): one call
per counter and tag set with its sum, each gauge's last value, every histogram observation."""

from __future__ import annotations

import asyncio

from deployments.verifier import MetricBuffer


class Recorded:
    """Stands in for a Ray metric (the served tests scrape the real ones through Prometheus): records its calls."""

    def __init__(self):
        self.calls = []

    def inc(self, n, tags=None):
        self.calls.append(("inc", n, tags))

    def set(self, value, tags=None):
        self.calls.append(("set", value, tags))

    def observe(self, value):
        self.calls.append(("observe", value))


def test_a_step_records_nothing_in_ray_until_the_timer_publishes_the_aggregates(monkeypatch):
    monkeypatch.setattr(MetricBuffer, "PUBLISH_S", 0.05)
    counter, gauge, hist = Recorded(), Recorded(), Recorded()

    async def steps():
        out = MetricBuffer()
        for i in range(100):
            out.inc(counter)
            out.inc(counter, 2, tags={"drafter": "code"})
            out.set(gauge, i)
            out.observe(hist, i)
        assert counter.calls == gauge.calls == hist.calls == []  # nothing on the step's path
        await asyncio.sleep(0.2)
        out.inc(counter)  # after a publish, the next record arms the timer again
        await asyncio.sleep(0.2)

    asyncio.run(steps())
    assert counter.calls == [("inc", 100, None), ("inc", 200, {"drafter": "code"}), ("inc", 1, None)]
    assert gauge.calls == [("set", 99, None)]
    assert hist.calls == [("observe", i) for i in range(100)]
