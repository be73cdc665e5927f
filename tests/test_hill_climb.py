"""Minions' hill-climbing of the draft length, on synthetic goodput curves (no Ray, no models), and once through
the in-process loop on the shipped models (greedy output is the target's whatever k the climber moves to)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable

import pytest

from config import AppConfig
from speculation.latency import expected_tokens
from speculation.hill_climb import HillClimbController
from speculation.messages import SpeculationOverrides
from speculation.planner import DraftPlanner

# a batch of 8; a verify step costs 30 ms + 1 ms per token, drafting 4 ms per depth. The best k in 0..4 by
# acceptance: 0.1 -> 0, 0.7 -> 2 (k = 1..3 within 4% of it), 0.9 -> 4 (the cap)
BATCH, VERIFY_A, VERIFY_B, DRAFT_PER_DEPTH = 8, 0.030, 0.001, 0.004


def _step_s(ks: list[int]) -> float:
    return VERIFY_A + VERIFY_B * sum(1 + k for k in ks) + DRAFT_PER_DEPTH * max(ks)


def _best_k(acceptance: float, cap: int = 4) -> int:
    return max(range(cap + 1), key=lambda k: expected_tokens(acceptance, k) / _step_s([k] * BATCH))


def _run(c: HillClimbController, windows: int, acceptance: float | Callable[[int], float], noise: float = 0.0,
         caps: dict[str, int] | None = None, seed: int = 0,
         step_s: Callable[[list[int]], float] = _step_s) -> tuple[list[int], list[int], list[int]]:
    """Feed `c` as the loop does, for `windows` measurement windows: each step it chooses, every request accepts a
    geometric number of its draft tokens, the step takes `step_s` (times 1 + noise * N(0, 1)). Returns k, the
    best k and the longest draft after every step."""
    rng, rids = random.Random(seed), [f"r{i}" for i in range(BATCH)]
    ks, homes, longest = [], [], []
    for step in range(windows * (c.window + c.SETTLE)):
        a = acceptance(step) if callable(acceptance) else acceptance
        chosen = c.choose(rids, caps)
        accepted = {r: next((i for i in range(k) if rng.random() >= a), k) for r, k in chosen.items()}
        c.observe_step(step_s(list(chosen.values())) * max(0.1, 1 + noise * rng.gauss(0, 1)))
        for r in rids:
            c.observe_acceptance(r, chosen[r], accepted[r])
        ks.append(c.k)
        homes.append(c.home)
        longest.append(max(chosen.values()))
    return ks, homes, longest


def _turns(seq: list[int]) -> int:
    """How often a sequence changes direction."""
    moves = [b - a for a, b in zip(seq, seq[1:]) if b != a]
    return sum(1 for x, y in zip(moves, moves[1:]) if (x > 0) != (y > 0))


@pytest.mark.parametrize("acceptance,best", [(0.7, 2), (0.9, 4), (0.1, 0)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_climbs_to_the_best_draft_length(acceptance, best, seed):
    """From k = 4 (the configured k) to the best k of a unimodal curve: inside, at the cap, and k = 0 (speculation
    does not pay); once there it only leaves to probe a neighbour. Acceptance is random, so are the measurements:
    k = 1..3 are within 4% of each other at 0.7, k = 3 within 3% of k = 4 at 0.9."""
    assert _best_k(acceptance) == best
    ks, homes, _ = _run(HillClimbController(4), 100, acceptance, seed=seed)
    half = len(ks) // 2
    assert all(abs(k - best) <= 1 for k in homes[half:])
    assert sum(abs(k - best) <= 1 for k in ks[half:]) >= 0.8 * half  # probing a neighbour of a neighbour, at most
    if best == 0:  # k = 1 is 16% worse: it stays off, only probing
        assert set(homes[len(homes) // 2:]) == {0}


def test_follows_the_optimum_when_acceptance_changes():
    """Acceptance drops mid-run (the best k goes from 4 to 0: speculation off), then recovers: k = 0 probes k = 1
    and the climb starts again."""
    c = HillClimbController(4)
    steps = 40 * (c.window + c.SETTLE)
    ks, homes, _ = _run(c, 120, lambda step: 0.1 if steps <= step < 2 * steps else 0.9)
    assert homes[steps - 1] == 4 and homes[2 * steps - 1] == 0 and homes[-1] >= 3
    assert ks[steps:2 * steps].count(0) > 0.5 * steps  # it was off for most of the bad phase


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_does_not_flap_on_noise(seed):
    """Every step's time off by 30% (standard deviation): on a flat curve (acceptance 0: every k commits one token
    per request, and drafting costs nothing) the best k rarely moves, and on the unimodal one it stays near the
    optimum's side without turning back and forth (the rule "reverse when goodput drops" would turn about every
    other window). k itself only turns to probe, at most three times per round of probes."""
    _, homes, _ = _run(HillClimbController(4), 200, 0.0, noise=0.3, seed=seed, step_s=lambda ks: VERIFY_A)
    assert sum(1 for a, b in zip(homes, homes[1:]) if a != b) <= 8 and _turns(homes) <= 5

    c = HillClimbController(4)
    ks, homes, _ = _run(c, 200, 0.7, noise=0.3, seed=seed)
    assert _turns(homes) <= 5
    assert _turns(ks) <= 3 * 200 / (c.hold + 1)  # a round: at most two probes and two returns, then hold windows


def test_every_request_keeps_its_own_cap():
    c = HillClimbController(4)
    assert c.choose(["a", "b", "c"], {"a": 0, "b": 2}) == {"a": 0, "b": 2, "c": 4}
    _, _, longest = _run(c, 30, 0.9, caps={f"r{i}": 2 for i in range(BATCH)})
    assert max(longest) == 2


def _cfg(**controller) -> AppConfig:
    return AppConfig(verifier={"model": "target"}, drafters=[{"name": "a", "model": "a"}],
                     speculation={"k": 4, "gamma_max": 6, "controller": {"kind": "hill_climb", **controller}})


def test_the_planner_uses_the_hill_climber_within_request_bounds_and_gamma_max():
    planner = DraftPlanner(_cfg(window=4, hold=2))
    c = planner.controller
    assert isinstance(c, HillClimbController) and (c.k_max, c.window, c.hold) == (4, 4, 2)
    overrides = {"r1": SpeculationOverrides(), "r2": SpeculationOverrides(enabled=False),
                 "r3": SpeculationOverrides(max_draft_tokens=1), "r4": SpeculationOverrides()}
    batch = {d.request_id: d.k for d in planner.plan({r: [1] for r in overrides}, overrides)}
    assert batch == {"r1": 2, "r3": 1, "r4": 3}  # k = 4, r3's cap; then Gamma_max (6) trims the longest drafts
    assert planner.chosen == [4, 1, 4]
    for _ in range(c.SETTLE + c.window + 1):  # a measured window: k = 3 is probed
        planner.observe_step(tokens=3, seconds=0.01, wall_s=0.02)
        for r in overrides:
            planner.observe_acceptance(r, 1, 1, None)
    assert c.k == 3
    state = planner.state(True)
    assert state["kind"] == "hill_climb" and state["k"] == 3 and state["best_k"] == 4
    assert state["goodput_per_request_tok_s"] == pytest.approx(2 / 0.02)
    assert state["participation"] is None  # the configuration's, not chosen


def test_greedy_output_is_the_targets_while_k_moves(target, tokenizer, heldout, models):
    """The in-process loop with the hill climber, windows of two steps so k moves every few steps: the output is
    the target's own greedy decoding."""
    import torch
    from transformers import AutoModelForCausalLM

    from engines.sampling import SamplingParams
    from engines.verifier import TorchVerifierEngine
    from model_family.distill import greedy_continue
    from assembly.loop import build_loop, generate_all

    prompts = [tokenizer(heldout[d][3], add_special_tokens=False).input_ids[:n]
               for d, n in (("code", 40), ("literature", 12), ("legal", 60))]
    new = 24
    reference = [greedy_continue(target, torch.tensor([p]), new)[0, len(p):].tolist() for p in prompts]
    cfg = AppConfig(verifier={"model": "target", "max_batch": 2, "max_len": 256},
                    drafters=[{"name": "generic", "model": "generic", "max_len": 256}],
                    speculation={"k": 4, "draft_timeout_ms": 600_000,
                                 "controller": {"kind": "hill_climb", "window": 2, "hold": 0}})
    drafter = AutoModelForCausalLM.from_pretrained(models / "drafter-generic", dtype=torch.float32).eval()
    loop = build_loop(cfg, TorchVerifierEngine(target, max_batch=2, max_len=256), {"generic": drafter})
    out = asyncio.run(generate_all(loop, prompts, [SamplingParams(max_tokens=new, ignore_eos=True)] * len(prompts)))
    assert [o.token_ids for o in out] == reference
    assert len(set(loop.planner.recent_k)) >= 2  # k moved
