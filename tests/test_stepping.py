"""The loop's step grouping (speculation/stepping.py): which requests a verify step takes and which drafting rounds
run beside it. The service's loop and the cluster simulator both run it; these tests pin its rules, and that the
simulator follows them (tests/test_engines.py checks the loop's pipelined steps on the torch engine)."""

from __future__ import annotations

import pytest
import yaml

from config import AppConfig
from model_family.paths import REPO_ROOT
from simulate.cluster import Simulation, Workload
from simulate.hardware import PROFILES
from simulate.replay import annotate
from simulate.report import DEFAULT_TRACE
from speculation.messages import Draft
from speculation.stepping import StepGrouping, carried
from speculation.trace import Trace


def _yes(_rid: str) -> bool:
    return True


def _pool(n: int) -> tuple[StepGrouping, list[str]]:
    g = StepGrouping(partial_steps=True)
    rids = [f"r{i}" for i in range(n)]
    for r in rids:
        g.join(r)
    return g, rids


def test_halves_take_arrivals_in_turn_and_steps_in_turn():
    g, rids = _pool(5)
    first = g.members(rids, drafting=True, overlaps=True, speculating=_yes)
    assert g.pipelined and first == ["r0", "r2", "r4"]
    assert g.verified(0.030, rids) == first  # this half drafts its next round while the other is verified
    assert g.members(rids, True, True, _yes) == ["r1", "r3"]
    assert g.verified(0.020, rids) == ["r1", "r3"]
    assert g.members(rids, True, True, _yes) == first


def test_an_empty_half_passes_its_turn():
    g, _ = _pool(3)
    g.leave("r1")
    rest = ["r0", "r2"]
    g.members(rest, True, True, _yes)
    g.verified(0.01, rest)
    assert g.members(rest, True, True, _yes) == rest  # half 1 has nobody: half 0 again


@pytest.mark.parametrize("partial_steps, drafting, overlaps, speculating", [
    (False, True, True, True),   # vLLM steps its whole pool
    (True, False, True, True),   # nothing drafts
    (True, True, False, True),   # drafters share the verifier's cores: halves only lose batching
    (True, True, True, False),   # nobody speculates
])
def test_the_whole_pool_steps_at_once_unless_halves_pay(partial_steps, drafting, overlaps, speculating):
    g = StepGrouping(partial_steps)
    rids = ["a", "b", "c"]
    for r in rids:
        g.join(r)
    assert g.members(rids, drafting, overlaps, lambda r: speculating) == rids and not g.pipelined
    assert g.verified(0.05, rids) == []  # no half's next round starts beside the step
    assert g.overlap(["a"], rids) == 0.0  # a round drafted before a whole-pool step runs beside nothing


def test_a_halfs_drafting_overlaps_the_other_halfs_last_step():
    g, rids = _pool(4)
    g.members(rids, True, True, _yes)
    nxt = g.verified(0.030, rids)  # half 0 verified in 30 ms
    assert g.overlap(nxt, rids) == 0.0  # half 1 has not been verified yet
    g.members(rids, True, True, _yes)
    g.verified(0.020, rids)  # half 1 in 20 ms
    assert g.overlap(["r0", "r2"], rids) == 0.020 and g.overlap(["r1"], rids) == 0.030
    assert g.overlap(["r0"], ["r0", "r2"]) == 0.0  # the other half is empty: nothing to hide behind


def test_drafting_ahead_only_for_whole_pool_steps_with_drafting_hardware():
    drafts = {"a": Draft.chain([1, 2])}
    assert StepGrouping(False).drafts_ahead(True, True, True, drafts)
    assert not StepGrouping(True).drafts_ahead(True, True, True, drafts)  # halves hide drafting instead
    assert not StepGrouping(False).drafts_ahead(True, True, False, drafts)  # it would slow the step as much
    assert not StepGrouping(False).drafts_ahead(False, True, True, drafts)  # turned off
    assert not StepGrouping(False).drafts_ahead(True, True, True, {})  # nothing verified to draft past


def test_a_draft_made_ahead_is_kept_only_where_it_still_extends_the_context():
    bases = {"whole": [1, 2, 3, 4], "cut": [1, 2, 3, 4], "gone": [5, 6]}
    made = {r: Draft.chain([9, 10, 11]) for r in bases}
    now = {"whole": [1, 2, 3, 4, 9], "cut": [1, 2, 3, 7]}  # "cut": the chain was rejected at its last token
    out = carried(bases, made, now.get)
    assert set(out) == {"whole"} and out["whole"].tokens == [10, 11]  # what follows the target's own next token
    assert carried(bases, made, lambda r: [1, 2, 3, 4, 8] if r == "whole" else None) == {}  # another token came


def _sim(engine: str, colocated: bool):
    args = yaml.safe_load((REPO_ROOT / "examples" / "local.yaml").read_text())["applications"][0]["args"]
    args["verifier"] = dict(args["verifier"], engine=engine, model="target", max_batch=8)
    args["speculation"].pop("drafting_tier")  # examples/local.yaml's auto: these use the default
    cfg = AppConfig.model_validate(args)
    requests = annotate(Trace.load(DEFAULT_TRACE).requests[:8], cfg)
    sim = Simulation(cfg, PROFILES["paper-llama"], requests, colocated=colocated)
    result = sim.run(Workload("offline", count=8))
    target = {r.rid: r.output for r in requests}
    assert all(f.output == target[f.rid.split("#")[0]] for f in result.finished)
    return result


def test_the_simulator_groups_steps_as_the_loop_does():
    """The torch engine with drafters on GPUs of their own verifies the pool's halves in turn (about twice the steps
    of one whole-pool step each); colocated, or on vLLM, the whole pool steps at once."""
    halves, whole = _sim("torch", colocated=False), _sim("torch", colocated=True)
    vllm = _sim("vllm", colocated=False)
    assert halves.steps > 1.6 * whole.steps
    assert halves.steps > 1.6 * vllm.steps
