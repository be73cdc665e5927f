"""The guard that keeps speculation from running slower than plain decoding (speculation/guard.py): what it chooses
from realised goodput, and, through the real loop with drafting made slow on purpose, that it switches speculation
off without changing the output."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

from benchmarks.engine_methods import SlowedDrafting
from config import AppConfig
from engines.sampling import SamplingParams
from engines.verifier import TorchVerifierEngine
from speculation.guard import SpeculationGuard
from speculation.messages import SpeculationOverrides
from assembly.loop import build_loop, generate_all
from speculation.planner import DraftPlanner, draft_timeout_s


def _plain(g: SpeculationGuard, n: int, seconds: float, steps: int = 1) -> None:
    for _ in range(steps):
        g.observe(n, n, seconds, speculated=False, prefill=False)


def _spec(g: SpeculationGuard, n: int, committed: int, seconds: float, steps: int = 1) -> None:
    for _ in range(steps):
        g.observe(n, committed, seconds, speculated=True, prefill=False)


def test_losing_speculation_is_switched_off_after_a_window_and_tried_again_later():
    g = SpeculationGuard(window=4, margin=0.5, patience=1, probe_steps=2, off_steps=3, off_steps_max=6)
    _spec(g, 8, 16, 0.5, steps=4)  # a full window and no plain step measured: a probe first
    assert not g.allow(8) and g.probing == 2
    _plain(g, 8, 0.1, steps=2)  # plain: 8 tokens in 0.1 s = 80/s; speculation gave 16 in 0.5 s = 32/s
    assert g.allow(8)
    _spec(g, 8, 16, 0.5)  # the verdict
    assert g.switched_off == 1 and g.last_ratio == pytest.approx(0.4)
    assert [g.allow(8) for _ in range(3)] == [False] * 3  # asking does not count down, steps do
    _plain(g, 8, 0.1, steps=6)  # off for the window's price, capped at off_steps_max (see below)
    assert g.allow(8)  # tried again
    _spec(g, 8, 16, 0.5, steps=2)  # loses again on trial: a verdict after a quarter window (here 2 steps)
    assert not g.allow(8) and g.switched_off == 2 and g.now.off_left == 6 and g.now.wait == 6
    _plain(g, 8, 0.1, steps=6)
    _spec(g, 8, 80, 0.5, steps=4)  # now it pays (160/s against 80/s): on, and the wait back to off_steps
    assert g.allow(8) and g.now.wait == 3 and g.last_ratio == pytest.approx(2.0)


def test_a_loads_first_verdict_waits_off_steps_and_every_later_one_its_price():
    """A verdict's wait keeps the next trial within half the margin of the plain steps before it; a load's first
    verdict is not priced (its window holds the load's first rounds), so a wrong one costs `off_steps` plain steps."""
    g = SpeculationGuard(window=4, margin=0.04, patience=1, off_steps=3, off_steps_max=10_000)
    _plain(g, 8, 0.1)
    _spec(g, 8, 16, 0.5, steps=2)  # 0.4x plain: far beyond noise, judged after a quarter window (here 2 steps)
    assert not g.allow(8) and g.now.off_left == 3  # off_steps, though 6 plain steps were lost
    _plain(g, 8, 0.1, steps=3)
    assert g.allow(8) and g.now.trial
    _spec(g, 8, 16, 0.5)
    assert g.allow(8)  # a trial is judged after a quarter window
    _spec(g, 8, 16, 0.5)  # 1 s for 32 tokens that plain decoding commits in 0.4 s: 6 plain steps lost
    assert g.now.off_left == 300 and g.now.wait == 600  # 6 / (0.04 / 2): a trial losing as much costs 2%
    _plain(g, 8, 0.1, steps=300)
    _spec(g, 8, 16, 0.5, steps=2)  # loses again: the doubled wait, longer than the price
    assert g.now.off_left == 600 and g.now.wait == 1200
    _plain(g, 8, 0.1, steps=600)
    _spec(g, 8, 80, 0.5, steps=4)  # pays: on, and the wait back to off_steps
    assert g.allow(8) and g.now.wait == 3
    _spec(g, 8, 16, 0.5, steps=2)  # loses after paying: priced, as the load lost before
    assert not g.allow(8) and g.now.off_left == 300


def test_one_losing_window_is_not_a_verdict_but_two_in_a_row_are():
    g = SpeculationGuard(window=2, patience=2, margin=0.5, severe=0.2, clear=0.2, off_steps=16)
    _plain(g, 4, 0.1)
    _spec(g, 4, 4, 0.21, steps=2)  # below half plain's speed: one loss (2.2 plain steps lost: priced 9 steps)
    assert g.allow(4) and g.now.losses == 1
    _spec(g, 4, 12, 0.1, steps=2)  # a window that pays clears it
    assert g.allow(4) and g.now.losses == 0
    _spec(g, 4, 4, 0.21, steps=4)  # two losses in a row
    assert not g.allow(4) and g.switched_off == 1 and g.now.off_left == 16  # off_steps: more than the price
    _plain(g, 4, 0.1, steps=16)
    _spec(g, 4, 4, 0.21, steps=2)  # tried again: one loss suffices, and the wait doubles
    assert not g.allow(4) and g.switched_off == 2 and g.now.off_left == 32


def test_a_loss_far_beyond_noise_is_a_verdict_after_a_quarter_window():
    g = SpeculationGuard(window=16, patience=2, severe=0.5)
    _plain(g, 8, 0.1)
    _spec(g, 8, 8, 0.3, steps=3)  # a third of plain's speed
    assert g.allow(8)
    _spec(g, 8, 8, 0.3)  # the fourth step: a quarter window
    assert not g.allow(8) and g.switched_off == 1 and g.last_ratio == pytest.approx(1 / 3)


def test_a_trial_losing_clearly_is_judged_after_a_quarter_window_a_slight_loss_after_half():
    """On trial a slight loss (0.9x plain, inside `clear`) over a quarter window is no verdict: sampled text lost such
    trials by noise between windows that paid; it is one after half a window. A clear loss (0.75x) takes a quarter."""
    for committed, steps in ((18, 8), (15, 4)):  # 0.9x and 0.75x plain's 16 tokens per 0.1 s
        g = SpeculationGuard(window=16, patience=2, severe=0.5, clear=0.85, off_steps=4)
        _plain(g, 16, 0.1)
        _spec(g, 16, 12, 0.1, steps=8)  # 0.75x: switched off after half a window
        assert not g.allow(16) and g.switched_off == 1
        _plain(g, 16, 0.1, steps=4)
        assert g.allow(16) and g.now.trial
        _spec(g, 16, committed, 0.125, steps=steps - 1)
        assert g.allow(16), (committed, steps)
        _spec(g, 16, committed, 0.125)
        assert not g.allow(16) and g.switched_off == 2, (committed, steps)


def test_an_early_verdict_needs_its_loss_beyond_the_windows_noise():
    """Sampled text at batch 1: a trial's quarter window of steps committing 1, 1, 1 and 2 tokens reads 0.83x plain,
    but one step's luck moves it by a third: no verdict until the loss is beyond a standard error of the steps'
    ratios; the same mean loss in steady steps is one after a quarter window, as before."""
    for committed, judged in (([1, 1, 1, 2], False), ([1, 1, 1, 1], True)):
        g = SpeculationGuard(window=16, patience=2, severe=0.5, clear=0.85, off_steps=4)
        _plain(g, 1, 0.1)
        _spec(g, 1, 1, 0.3, steps=4)  # a third of plain's speed: off after a quarter window
        assert not g.allow(1) and g.switched_off == 1
        _plain(g, 1, 0.1, steps=4)
        assert g.allow(1) and g.now.trial
        for c in committed:
            _spec(g, 1, c, 0.15)
        assert g.allow(1) is not judged and g.switched_off == 1 + judged, committed
    g = SpeculationGuard(window=16, patience=2, severe=0.5, clear=0.85, off_steps=4, noise=0.0)
    _plain(g, 1, 0.1)
    _spec(g, 1, 1, 0.3, steps=4)
    _plain(g, 1, 0.1, steps=4)
    for c in (1, 1, 1, 2):  # noise 0: the ratio alone, as before
        _spec(g, 1, c, 0.15)
    assert not g.allow(1) and g.switched_off == 2


def test_a_clear_loss_is_a_verdict_after_half_a_window_a_slight_one_after_two_windows():
    """Below `clear` (0.85x plain) speculation is switched off after half a window, within a batch-16 run of a few
    dozen steps; a loss within it (0.9x) waits for `patience` full windows, as noise may make one."""
    g = SpeculationGuard(window=16, patience=2, severe=0.5, clear=0.85)
    _plain(g, 16, 0.1)
    _spec(g, 16, 12, 0.1, steps=7)  # 0.75x plain
    assert g.allow(16)
    _spec(g, 16, 12, 0.1)  # the eighth step: half a window
    assert not g.allow(16) and g.switched_off == 1 and g.last_ratio == pytest.approx(0.75)
    g = SpeculationGuard(window=16, patience=2, severe=0.5, clear=0.85)
    _plain(g, 16, 0.1)
    _spec(g, 16, 18, 0.125, steps=16)  # 0.9x plain: one losing window
    assert g.allow(16) and g.now.losses == 1
    _spec(g, 16, 18, 0.125, steps=16)
    assert not g.allow(16) and g.switched_off == 1
    with pytest.raises(ValueError, match="clear .* is below severe"):
        AppConfig(verifier={"model": "target"}, drafters=[{"name": "a", "model": "a"}],
                  speculation={"guard": {"clear": 0.4, "severe": 0.5}})


def test_half_a_window_of_text_no_drafter_predicts_does_not_switch_off_speculation_that_paid():
    """Greedy text at 1.8x plain decoding had phases where every step committed one token; half a window of one was a
    clear verdict and switched speculation off. Where the load's last full window paid, a clear loss needs a full
    window; a severe one still takes a quarter."""
    g = SpeculationGuard(window=16, patience=2, severe=0.5, clear=0.85)
    _plain(g, 1, 0.025)
    _spec(g, 1, 4, 0.05, steps=16)  # 2x plain: the window pays
    assert g.allow(1) and g.last_ratio == pytest.approx(2.0)
    _spec(g, 1, 1, 0.032, steps=8)  # a dry phase: one token a step at 0.78x plain, half a window
    assert g.allow(1) and g.switched_off == 0
    _spec(g, 1, 4, 0.05, steps=8)  # the phase passes: the window, half dry, pays
    assert g.allow(1) and g.switched_off == 0 and g.last_ratio > 1
    _spec(g, 1, 1, 0.032, steps=16)  # a whole window dry, below `clear`: a verdict
    assert not g.allow(1) and g.switched_off == 1
    g = SpeculationGuard(window=16, patience=2, severe=0.5, clear=0.85)
    _plain(g, 1, 0.025)
    _spec(g, 1, 4, 0.05, steps=16)
    _spec(g, 1, 1, 0.1, steps=4)  # a quarter window at a quarter of plain's speed: severe, whatever paid before
    assert not g.allow(1) and g.switched_off == 1


def test_paying_speculation_stays_on_and_short_runs_never_see_the_guard():
    g = SpeculationGuard(window=16)
    _spec(g, 4, 12, 0.05, steps=15)
    assert g.allow(4) and g.probing == 0 and not g.plain  # no probe before a window is full
    _plain(g, 4, 0.04)
    _spec(g, 4, 12, 0.05)  # 240/s against 100/s
    assert g.allow(4) and g.switched_off == 0 and g.last_ratio == pytest.approx(2.4)


def test_speculation_within_the_margin_stays_on():
    g = SpeculationGuard(window=2, margin=0.05)
    _plain(g, 1, 0.1)
    _spec(g, 1, 1, 0.104, steps=2)  # 0.96x plain: inside the margin
    assert g.allow(1) and g.switched_off == 0


def test_prefill_steps_are_left_out_on_both_sides():
    g = SpeculationGuard(window=2)
    g.observe(4, 4, 5.0, speculated=False, prefill=True)  # a prompt's prefill: not a plain step's cost
    assert not g.plain
    _plain(g, 4, 0.1)
    g.observe(4, 4, 5.0, speculated=True, prefill=True)
    _spec(g, 4, 12, 0.1, steps=2)
    assert g.allow(4) and g.last_ratio == pytest.approx(3.0)


def test_a_plain_step_is_estimated_from_the_nearest_measured_size_generously():
    g = SpeculationGuard()
    _plain(g, 4, 0.04)
    _plain(g, 16, 0.08)
    assert g.plain_seconds(4) == pytest.approx(0.04)
    assert g.plain_seconds(3) == pytest.approx(0.04)  # below a measured size: its time (a GPU's step is flat)
    assert g.plain_seconds(6) == pytest.approx(0.06)  # above: linear in the requests
    assert g.plain_seconds(12) == pytest.approx(0.08)
    assert g._measured_near(8) and g._measured_near(32) and not g._measured_near(64)


def test_a_stale_plain_measurement_is_taken_again():
    g = SpeculationGuard(window=2, refresh_steps=10)
    _plain(g, 2, 0.1)
    _spec(g, 2, 6, 0.1, steps=12)  # verdicts every 2 steps; after 10 steps the measurement is stale
    assert g.probing == 2


def test_each_load_keeps_its_own_verdict():
    """Speculation that loses at batch 8 is switched off there and stays on at batch 1, where it pays; back at
    batch 8 the verdict still holds (no two windows lost again), and only steps at batch 8 count its wait down."""
    g = SpeculationGuard(window=4, margin=0.05, patience=2, off_steps=20, off_steps_max=20)
    _plain(g, 1, 0.04)
    _plain(g, 8, 0.1)
    _spec(g, 1, 3, 0.05, steps=4)  # batch 1: 60 tok/s against 25: pays
    _spec(g, 8, 18, 0.25, steps=8)  # batch 8: 72 tok/s against 80 (0.9x, no clear loss): two losing windows, off
    assert not g.allow(8) and g.switched_off == 1 and g.at(8).off_left == 20
    assert g.allow(1) and g.at(1).off_left == 0 and g.at(1).last_ratio == pytest.approx(2.4)
    _spec(g, 1, 3, 0.05, steps=4)  # batch 1 speculates on; its steps do not count batch 8's wait down
    assert g.allow(1) and g.at(8).off_left == 20
    assert not g.allow(6)  # 5-8 requests are one load: a batch of 6 is held off too
    _plain(g, 7, 0.1, steps=19)
    assert not g.allow(8) and g.at(8).off_left == 1
    assert g.allow(4)  # 3-4 requests: never judged, free to speculate
    state = g.state()["by_batch"]
    assert state["5-8"]["speculating"] is False and state["1"]["speculating"] is True
    _plain(g, 8, 0.1)
    assert g.allow(8) and g.at(8).trial  # tried again, on trial (one losing quarter window suffices)
    assert g.at(16).trial and not g.at(2).trial  # never judged: on trial above a load that lost, not below it


def test_a_hold_keeps_every_load_plain_for_its_steps():
    g = SpeculationGuard()
    g.hold_off(3)
    assert not g.allow(1) and not g.allow(8) and not g.speculating
    _plain(g, 2, 0.1, steps=3)
    assert g.allow(1) and g.allow(8) and g.speculating


def test_the_draft_timeout_is_a_share_of_the_recent_verify_step():
    cfg = AppConfig(verifier={"model": "target"}, drafters=[{"name": "a", "model": "a"}],
                    speculation={"draft_timeout_ms": 100, "draft_timeout_share": 2.0})
    spec = cfg.speculation
    assert draft_timeout_s(spec, [], scoring=False) == pytest.approx(0.1)  # nothing measured yet: the bound
    assert draft_timeout_s(spec, [0.01, 0.02, 0.5], scoring=False) == pytest.approx(0.04)  # 2 x the median
    assert draft_timeout_s(spec, [0.2], scoring=False) == pytest.approx(0.1)  # never beyond the bound
    assert draft_timeout_s(spec, [0.01], scoring=True) == pytest.approx(0.1)  # a prompt-scoring round: the bound
    off = spec.model_copy(update={"draft_timeout_share": None})
    assert draft_timeout_s(off, [0.01], scoring=False) == pytest.approx(0.1)


def test_the_guard_is_on_for_every_method_that_speculates():
    def planner(**speculation) -> DraftPlanner:
        return DraftPlanner(AppConfig(verifier={"model": "target"}, drafters=[{"name": "a", "model": "a"}],
                                      speculation=speculation))

    assert planner().guard is not None
    fixed = planner(adaptive=False)  # a fixed k can lose as any controller can
    assert fixed.controller is None and fixed.guard is not None
    fixed.guard.hold_off(1)
    assert fixed.plan({"r": [1, 2, 3]}, {"r": SpeculationOverrides()}) == []  # held off: no drafts
    assert [d.k for d in fixed.plan({"r": [1, 2, 3]}, {"r": SpeculationOverrides()})] == []  # a step not taken
    fixed.guard.observe(1, 1, 0.1, speculated=False, prefill=False)
    assert [d.k for d in fixed.plan({"r": [1, 2, 3]}, {"r": SpeculationOverrides()})] == [4]  # k again
    assert planner(guard={"enabled": False}).guard is None
    assert planner(mode="off").guard is None


@pytest.mark.slow
def test_slow_drafting_is_switched_off_by_the_guard_and_the_output_stays_the_targets(models, target, tokenizer,
                                                                                    heldout):
    """Every drafting round made to take ~10 verify steps, which the goodput controller is kept from pricing (as on
    a GPU, where rounds that mixed participation modes went unpriced and it kept drafting while it waited 123-147 ms
    per round against a 6.7 ms verify step, bench_results/history/engine-h200-9b-bf16-full-cosine.json):
    the guard switches speculation off after two losing windows and the later steps decode without drafts; the output
    is target-only's. What it chose is checked, not a clock."""
    max_len, new = 256, 96
    drafter = AutoModelForCausalLM.from_pretrained(models / "drafter-generic", dtype=torch.float32).eval()
    prompts = [tokenizer(heldout[d][0], add_special_tokens=False).input_ids[:24] for d in ("code", "legal")]

    def run(mode: str, slow: bool):
        cfg = AppConfig(verifier={"model": "target", "max_batch": 2, "max_len": max_len},
                        drafters=[{"name": "g", "model": "g", "max_len": max_len}],
                        speculation={"mode": mode, "k": 4, "fixed_drafters": ["g"], "draft_timeout_ms": 600_000,
                                     "draft_timeout_share": None,
                                     "guard": {"window": 8, "off_steps": 1000, "off_steps_max": 1000}})
        loop = build_loop(cfg, TorchVerifierEngine(target, max_batch=2, max_len=max_len), {"g": drafter})
        if slow:
            loop.drafting = SlowedDrafting(loop.drafting, delay_s=0.3)
            loop.planner.observe_round = lambda *args: None  # the controller never sees what a round costs
        out = asyncio.run(generate_all(loop, prompts, [SamplingParams(max_tokens=new, ignore_eos=True)] * 2))
        return [o.token_ids for o in out], loop

    reference, _ = run("off", slow=False)
    out, loop = run("chain", slow=True)
    guard = loop.planner.guard
    assert out == reference
    # the pipeline's halves and whole-pool steps are two loads (1 and 2 requests): each is switched off once
    assert [g.switched_off for g in guard.regimes.values()] == [1] * len(guard.regimes)
    assert not any(guard.allow(n) for n in (1, 2)) and guard.last_ratio < 0.5
    # per load at most a window of 8 speculating steps before its plain probe, the verdict (a loss far beyond noise,
    # below half plain's speed: one window suffices) and the prompts' first rounds; then none
    assert loop.drafting.rounds <= len(guard.regimes) * (8 + 1) + 2
    assert loop.stats.totals["steps"] > 40
