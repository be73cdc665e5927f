"""Drafting ahead (`speculation.draft_ahead`) in the simulator, as speculation/loop.py runs it: while a step is
verified, the next round is drafted from the context the step's full acceptance would give; afterwards each such
draft is used for what of it still extends the context."""

from __future__ import annotations

import pytest
import yaml

from config import AppConfig
from model_family.paths import REPO_ROOT
from simulate.cluster import Simulation, Workload
from simulate.hardware import Hardware, Linear
from simulate.replay import annotate
from simulate.report import DEFAULT_TRACE
from speculation.trace import Trace


def _cfg(draft_ahead: bool) -> AppConfig:
    args = yaml.safe_load((REPO_ROOT / "examples" / "local.yaml").read_text())["applications"][0]["args"]
    args["verifier"] = dict(args["verifier"], engine="vllm", model="target")
    args["speculation"].pop("drafting_tier")  # examples/local.yaml's auto: these use the default
    args["speculation"] = dict(args["speculation"], mode="chain", adaptive=False, k=4, fixed_drafters=["generic"],
                               draft_timeout_ms=60000, draft_ahead=draft_ahead,
                               guard={"enabled": False})  # what drafting ahead gives, not the guard's verdict
    return AppConfig.model_validate(args)


@pytest.fixture(scope="module")
def requests():
    return annotate(Trace.load(DEFAULT_TRACE).requests[:6], _cfg(True))


def _hw(draft_ms: float, hop_ms: float) -> Hardware:
    """A 10 ms verify step; a round of k = 4 drafter steps and a hop."""
    return Hardware(name="even", description="test", verifier_gpu="A100-80GB", verify=Linear(a=10.0),
                    drafter_gpu="RTX3090", draft=Linear(a=draft_ms), hop_ms=hop_ms)


def _run(requests, draft_ahead: bool, hw: Hardware):
    sim = Simulation(_cfg(draft_ahead), hw, requests)
    assert not sim.grouping.partial_steps
    return sim.run(Workload("closed", count=len(requests), concurrency=1))


def test_drafting_ahead_hides_drafting_as_long_as_verifying(requests):
    """Drafting a round (4 x 2 ms + a 2 ms hop) takes as long as verifying it (10 ms). Without drafting ahead every
    round costs 10 + 10 ms. Drafted ahead (k + 1 = 5 steps, 12 ms beside the step), a round whose chain was accepted
    whole costs max(10, 12) = 12 ms; any other waits out the ahead round (2 ms past the step), drafts afresh and
    verifies: 22 ms. So the speed-up is 20 / (12 u + 22 (1 - u)) for the share u of ahead drafts used, no more than
    free drafting gives, and the output is the target's either way."""
    ahead, serial = _run(requests, True, _hw(2.0, 2.0)), _run(requests, False, _hw(2.0, 2.0))
    free = _run(requests, False, _hw(0.0, 0.0)).summary()["throughput_tok_s"]
    on, off = ahead.summary(), serial.summary()
    u = on["ahead_used_share"]
    assert 0.2 < u < 1 and off["ahead_used_share"] == 0
    assert on["throughput_tok_s"] / off["throughput_tok_s"] == pytest.approx(20 / (12 * u + 22 * (1 - u)), rel=0.03)
    assert off["throughput_tok_s"] * 1.05 < on["throughput_tok_s"] < free
    assert on["mean_accepted_length"] == off["mean_accepted_length"]  # a draft made ahead is used only where exact
    target = {r.rid: r.output for r in requests}
    for result in (ahead, serial):
        assert all(f.output == target[f.rid.split("#")[0]] for f in result.finished)


def test_drafting_ahead_pays_nothing_where_drafting_is_free(requests):
    """Nothing to hide: drafting ahead changes no step's timing, only which rounds are drafted when."""
    free = _hw(0.0, 0.0)
    on, off = _run(requests, True, free).summary(), _run(requests, False, free).summary()
    assert on["throughput_tok_s"] == pytest.approx(off["throughput_tok_s"], rel=0.02)
