import pytest

from speculation.goodput import GoodputController
from speculation.latency import LinearLatency, expected_tokens
from speculation.messages import Participation

ONE, FUSED = Participation(1), Participation(2, lockstep=True)


def test_expected_tokens():
    assert expected_tokens(0.0, 4) == 1.0
    assert abs(expected_tokens(0.5, 2) - 1.75) < 1e-9


def _ctrl(verify_a, verify_b, draft_a, draft_b, acc):
    c = GoodputController(k_max=8, prior_acceptance=acc)
    c.verify.a, c.verify.b, c.draft.a, c.draft.b = verify_a, verify_b, draft_a, draft_b
    return c


def test_gpu_like_costs_draft_long_for_agreeing_requests():
    # verifying extra tokens is nearly free, drafting is cheap: long drafts pay off
    ks = _ctrl(0.030, 0.0001, 0.001, 0.0001, acc=0.8).choose(["a", "b"])
    assert ks["a"] >= 6 and ks["b"] >= 6


def test_cpu_like_costs_at_large_batch_switch_speculation_off():
    # every verified token costs almost as much as a decode step: speculation cannot pay at batch 16
    ks = _ctrl(0.002, 0.004, 0.002, 0.0005, acc=0.5).choose([str(i) for i in range(16)])
    assert set(ks.values()) == {0}


def test_jumps_past_a_worse_k_of_one():
    # a fixed per-step drafter cost makes k=1 a loss, longer drafts a gain
    c = _ctrl(0.030, 0.001, 0.012, 0.0, acc=0.95)
    assert c.choose(["a"])["a"] >= 3


def test_acceptance_feedback_shortens_drafts_of_a_failing_request():
    c = _ctrl(0.030, 0.002, 0.002, 0.0, acc=0.8)
    for _ in range(10):
        c.observe_acceptance("bad", drafted=4, accepted=0)
        c.observe_acceptance("good", drafted=4, accepted=4)
    ks = c.choose(["bad", "good"])
    assert ks["good"] > ks["bad"]


def test_linear_latency_fit():
    lat = LinearLatency()
    for n in range(1, 9):
        lat.observe(n, 0.01 + 0.002 * n)
    assert abs(lat.a - 0.01) < 1e-6 and abs(lat.b - 0.002) < 1e-6


def test_a_full_window_refits_every_fourth_observation_not_every_one():
    """The window keeps the last 256 steps; a refit per observation once it is full cost the loop's thread ~0.1 ms
    a fit, twice a round."""
    lat = LinearLatency()
    for i in range(256):
        lat.observe(1 + i % 8, 0.01 + 0.002 * (1 + i % 8))
    fits = []
    for _ in range(8):
        lat.observe(4, 0.05)  # the machine slowed down
        fits.append((lat.a, lat.b))
    assert [i for i in range(1, 8) if fits[i] != fits[i - 1]] == [3, 7]


def test_a_request_held_at_zero_probes_and_recovers_when_drafts_turn_out_good():
    # a pessimistic prior switches speculation off; probes observe the real acceptance and switch it back on
    c = _ctrl(0.030, 0.006, 0.002, 0.0, acc=0.2)
    assert c.choose(["a"])["a"] == 0  # the first call never probes
    rounds_to_first_probe = None
    for i in range(1, 40):
        k = c.choose(["a"])["a"]
        if k > 0:
            rounds_to_first_probe = rounds_to_first_probe or i
            c.observe_acceptance("a", drafted=k, accepted=k)  # every probe is accepted whole
    assert rounds_to_first_probe == c.probe_interval
    assert c.choose(["a"])["a"] >= 3


def test_new_requests_start_from_the_pools_acceptance():
    c = _ctrl(0.030, 0.006, 0.002, 0.0, acc=0.2)
    for _ in range(20):
        c.observe_acceptance("old", drafted=4, accepted=4)
    assert c.pool_acceptance > 0.9
    assert c.choose(["new"])["new"] >= 3


def test_drafter_groups_stepping_one_after_another_cost_more_than_in_parallel():
    # eight requests, each with its own drafter model: in one process their steps add up, in the graph they overlap
    rids = [str(i) for i in range(8)]
    groups = {r: r for r in rids}
    seq = _ctrl(0.030, 0.001, 0.004, 0.0, acc=0.7)
    par = _ctrl(0.030, 0.001, 0.004, 0.0, acc=0.7)
    par.parallel_groups = True
    assert seq._time([4] * 8, list(groups.values())) > par._time([4] * 8, list(groups.values())) + 0.1
    assert sum(seq.choose(rids, groups=groups).values()) < sum(par.choose(rids, groups=groups).values())


def test_acceptance_estimate_is_the_geometric_mle():
    c = GoodputController(prior_acceptance=0.5, ema=1.0)  # no memory: only the last round counts
    c.observe_acceptance("a", drafted=4, accepted=3)
    assert abs(c.acceptance["a"] - 3 / 4) < 1e-9  # three accepted, one rejection
    c.observe_acceptance("a", drafted=4, accepted=4)
    assert c.acceptance["a"] == 1.0  # whole chain accepted: no rejection observed


def test_fused_trees_accepted_along_their_depth_grow_to_long_drafts():
    # a fused draft of depth k carries k sibling branches too: judged by depth, whole-path acceptance is no rejection
    c = _ctrl(0.040, 0.0015, 0.0, 0.0, acc=0.5)
    c.drafters_per_request = 2
    ks = c.choose(["a"])
    for _ in range(12):
        k = ks["a"]
        c.observe_acceptance("a", drafted=k, accepted=k)  # depth k, every chain token accepted
        ks = c.choose(["a"])
    assert ks["a"] == c.k_max


def _participation_ctrl(verify_a, verify_b, accepted_by_mode, participations=(ONE, FUSED)):
    c = GoodputController(k_max=4, drafters_per_request=2, participations=participations, participation_probe=1000)
    c.verify.a, c.verify.b = verify_a, verify_b
    for m in participations:  # drafting time per round, per participation
        c.draft_model(m).a, c.draft_model(m).b = 0.005, 0.001
    for _ in range(20):  # rounds measured in each mode (pool-wide acceptance per mode)
        for m, accepted in accepted_by_mode.items():  # of 4 drafted: MLE 2 -> 0.67, 3 -> 0.75
            c.observe_acceptance(f"pool-{m}", drafted=4, accepted=accepted, participation=m)
    return c


def test_idle_verifier_lets_more_drafters_participate():
    # extra verify tokens are nearly free and two fused drafters are accepted more often than one
    c = _participation_ctrl(0.030, 0.0001, {ONE: 2, FUSED: 3})
    ks = c.choose(["a", "b"])
    assert c.participation == FUSED and min(ks.values()) >= 3


def test_loaded_verifier_drafts_with_fewer_drafters():
    # the same measured gain, but each verified token costs a tenth of a decode step of the batch: the second
    # drafter's sibling branches double the verify work, so one drafter per request pays more
    c = _participation_ctrl(0.030, 0.003, {ONE: 2, FUSED: 3})
    ks = c.choose([str(i) for i in range(8)])
    assert c.participation == ONE and any(ks.values())


def test_lockstep_round_trips_priced_against_one_shot_drafting():
    # fusion in lockstep is accepted a little more often than one-shot, but pays a 10 ms round trip per depth
    one_shot = Participation(2, lockstep=False)
    c = _participation_ctrl(0.030, 0.0001, {ONE: 2, FUSED: 3, one_shot: 3}, participations=(ONE, FUSED, one_shot))
    c.draft_model(FUSED).b = 0.010
    c.observe_acceptance("pool-fused", drafted=4, accepted=4, participation=FUSED)
    c.choose(["a"])
    assert c.participation == one_shot
    c.draft_model(FUSED).b = 0.001  # hops as cheap as one-shot's engine steps: the better acceptance wins
    c.choose(["a"])
    assert c.participation == FUSED


def test_a_batch_spread_over_routed_drafters_consolidates_on_the_generalist_and_one_request_never_does():
    """Routed drafters step apart (here each request of 8 on a drafter of its own: 8 ms per depth) where the
    generalist steps the batch at once (1.5 ms per depth), for a little less acceptance: the batch drafts with the
    generalist. One request drafts with one drafter either way: the generalist is not offered."""
    shared = Participation(1, generalist=True)
    c = _participation_ctrl(0.030, 0.001, {ONE: 3, shared: 2}, participations=(ONE, shared))
    c.draft_model(ONE).c = 0.001
    c.draft_model(shared).b = 0.0015
    c.choose([str(i) for i in range(8)])
    assert c.participation == shared
    for _ in range(40):
        c.choose(["alone"])
        assert c.participation == ONE


def test_scoring_new_prompts_is_priced_into_routed_plans_as_measured():
    """A routed round that scores new prompts (a forward per drafter and prompt) takes longer than its participation's
    round model; the excess per context token scored, measured, is priced into routed plans for the requests still
    unscored: a batch whose routed drafters would win on acceptance drafts with the generalist while its prompts
    would cost more to score than routing gains, and routes once they are scored (or cost nothing to score)."""
    shared = Participation(1, generalist=True)
    c = _participation_ctrl(0.030, 0.001, {ONE: 3, shared: 2}, participations=(ONE, shared))
    rids = [str(i) for i in range(8)]
    new = dict.fromkeys(rids, 64)  # eight 64-token prompts no drafter has scored
    c.choose(rids, unscored=new)
    assert c.participation == ONE  # nothing measured of scoring yet: routing's acceptance wins
    model = c.priced(ONE)
    for _ in range(3):  # routed rounds of 8 requests, 4 deep, that scored 512 tokens: 40 ms beyond the model
        c.observe_scoring(ONE, 8, 4, 512, model(4, 8) + 0.040)
    assert c.scoring_s_per_token == pytest.approx(0.040 / 512)
    assert c.state()["scoring_ms_per_token"] == pytest.approx(40 / 512)
    c.choose(rids, unscored=new)
    assert c.participation == shared
    c.choose(rids, unscored={})  # scored: no such cost
    assert c.participation == ONE
    c.observe_scoring(shared, 8, 4, 512, 1.0)  # the generalist scores nothing: its rounds say nothing of it
    assert c.scoring_s_per_token == pytest.approx(0.040 / 512)
    # a lone request is scored whatever it drafts with: its plans are not charged for it
    lone = GoodputController(k_max=4, drafters_per_request=2, participations=(ONE, FUSED, shared))
    lone.verify.a, lone.verify.b, lone.scoring_s_per_token = 0.030, 0.001, 1.0
    for m in (ONE, FUSED):
        lone.draft_model(m).a, lone.draft_model(m).b = 0.005, 0.001
    assert lone.choose(["alone"], unscored={"alone": 64}) == lone.choose(["alone"]) and lone.participation == ONE
    for _ in range(20):  # scoring measured at nothing beyond the model (a pooled prefill, say): routed again
        c.observe_scoring(ONE, 8, 4, 512, model(4, 8))
    c.choose(rids, unscored=new)
    assert c.participation == ONE


def test_an_unmeasured_participation_is_priced_by_a_measured_one_scaled_by_its_drafters():
    """Before its own rounds are fitted, a participation is priced by the fitted one's model, scaled by drafters
    per request: an empty model priced two-drafter rounds at nothing, and they won the plan of a batch whose
    generalist drafted at a fraction of their cost. With nothing fitted yet, and for the generalist (one batched
    forward per depth), the first rounds draft at no price."""
    shared, two = Participation(1, generalist=True), Participation(2)
    c = GoodputController(k_max=8, drafters_per_request=2, participations=(shared, ONE, two), participation_probe=1000)
    c.verify.a, c.verify.b = 0.030, 0.0013
    rids = [str(i) for i in range(8)]
    assert sum(c.choose(rids).values()) > 0 and c.priced(two)(4, 8) == 0.0  # nothing measured: draft, and measure
    for depth in (2, 4, 6, 8):  # the generalist's rounds: 4 ms + 2 ms per depth for the batch
        c.observe_round(8, depth, {shared}, 0.004 + 0.002 * depth)
    assert c.priced(ONE)(4, 8) == pytest.approx(0.012) and c.priced(two)(4, 8) == pytest.approx(0.024)
    for _ in range(10):
        c.choose(rids)
        assert c.participation == shared
    for depth in (2, 4, 6, 8):  # once measured, its own rounds price it
        c.observe_round(8, depth, {two}, 0.001 * depth)
    assert c.priced(two)(4, 8) == pytest.approx(0.004)
    # the generalist steps the batch at once, cheaper than any routed round: measured at no price
    c = GoodputController(k_max=8, drafters_per_request=2, participations=(shared, ONE, two))
    for depth in (2, 4, 6, 8):
        c.observe_round(8, depth, {ONE}, 0.004 + 0.002 * depth)
    assert c.priced(shared)(4, 8) == 0.0 and c.priced(two)(4, 8) == pytest.approx(0.024)


def test_modes_that_measure_alike_do_not_alternate():
    """A routed round whose domain drafters are parked routes to the generalist: the two modes then measure alike,
    within noise. The mode in use stays until another predicts `participation_hysteresis` more goodput."""
    shared = Participation(1, generalist=True)
    c = _participation_ctrl(0.030, 0.001, {ONE: 2, shared: 2}, participations=(ONE, shared))
    chosen = []
    for i in range(20):  # each mode's drafting 1% cheaper than the other's, by turns
        c.draft_model(ONE).a, c.draft_model(shared).a = (0.0050, 0.0049) if i % 2 else (0.0049, 0.0050)
        c.choose([str(r) for r in range(8)])
        chosen.append(c.participation)
    assert len(set(chosen)) == 1
    c.draft_model(chosen[0]).a = 0.030  # now clearly slower: the other mode takes over
    c.choose([str(r) for r in range(8)])
    assert c.participation != chosen[0]
    # a lone request is routed (the generalist is not offered to it), and that does not become the mode held
    c.draft_model(ONE).a = c.draft_model(shared).a = 0.005
    c.held_participation = shared
    c.choose(["alone"])
    c.choose([str(r) for r in range(8)])
    assert c.participation == shared


def test_a_request_estimate_moves_by_the_pools_difference_between_modes():
    c = _participation_ctrl(0.030, 0.0001, {ONE: 2, FUSED: 3})
    for _ in range(10):
        c.observe_acceptance("r", drafted=4, accepted=1, participation=ONE)  # measured with one drafter
    assert c._acceptance_at("r", ONE) < 0.55 and c._acceptance_at("r", FUSED) > c._acceptance_at("r", ONE) + 0.05


def test_an_untried_participation_mode_is_probed():
    c = GoodputController(k_max=4, drafters_per_request=2, participations=(ONE, FUSED), participation_probe=4)
    c.verify.a, c.verify.b = 0.030, 0.002
    c.draft_model(FUSED).a = 0.050  # fused drafting looks too slow to ever be chosen
    seen, probes = set(), set()
    for _ in range(12):
        c.choose(["a", "b"])
        seen.add(c.participation)
        if c.probing:
            probes.add(c.participation)
    assert seen == {ONE, FUSED} and probes == {FUSED}  # a probe says so: its drafting was not asked for


def test_a_mode_far_behind_is_probed_ever_less_often_and_at_the_base_rate_once_in_reach():
    c = GoodputController(k_max=4, drafters_per_request=2, participations=(ONE, FUSED), participation_probe=4,
                              participation_probe_max=16)
    c.verify.a, c.verify.b = 0.030, 0.002
    c.draft_model(FUSED).a = 0.050  # far behind: fused drafting costs more than a round's verification

    def probe_rounds(n: int) -> list[int]:
        at = []
        for i in range(n):
            c.choose(["a", "b"])
            if c.probing:
                assert c.participation == FUSED
                at.append(i)
        return at

    at = probe_rounds(80)
    gaps = [b - a for a, b in zip(at, at[1:])]
    assert gaps[:3] == [9, 17, 17] and at[0] == 4  # waits of 4, 8, 16 rounds unused, then the cap
    # now costing what one drafter does (free drafting, free verify tokens): a tie, kept on the first listed mode,
    # so fused is within reach and back to the base rate
    c.draft_model(FUSED).a, c.verify.b = 0.0, 0.0
    at = probe_rounds(40)
    assert [b - a for a, b in zip(at, at[1:])] == [5] * (len(at) - 1) and len(at) >= 7


def test_drafting_hidden_behind_the_other_halfs_verification_costs_nothing():
    # 15 ms per lockstep depth; alone, drafting adds to every round, but while the other pipeline half is being
    # verified for 60 ms, four depths are free
    c = _ctrl(0.040, 0.001, 0.015, 0.0, acc=0.7)
    c.parallel_groups = True
    alone = c.choose(["a"])["a"]
    hidden = c.choose(["a"], overlap_s=0.060)["a"]
    assert alone <= 2 and hidden >= 4



def test_a_request_drafting_alone_is_priced_as_one_not_as_the_batch():
    """Rounds measured at a batch of 6 (12 ms per depth there, 2 ms of it per request): the last request of the
    batch, drafting alone, costs a sixth of that per depth and drafts; a model in depth alone held it at k = 0."""
    from speculation.latency import RoundLatency

    m = RoundLatency()
    for depth in (1, 2, 3, 4) * 3:
        for n in (6, 5):
            m.observe(depth, n, 0.001 + depth * 0.002 * n)
    m.observe(2, 1, 0.001 + 2 * 0.002)
    m.refit()
    assert m(4, 1) == pytest.approx(0.009, rel=0.05) and m(4, 6) == pytest.approx(0.049, rel=0.05)
    c = GoodputController(k_max=4, drafters_per_request=2, participations=(ONE,), participation_probe=1000)
    c.verify.a, c.verify.b = 0.030, 0.0015
    c.participation_draft[ONE] = m
    for _ in range(5):
        c.observe_acceptance("last", drafted=4, accepted=3, participation=ONE)
    assert c.choose(["last"])["last"] >= 3


def test_round_latency_keeps_its_coefficients_non_negative():
    from speculation.latency import RoundLatency

    m = RoundLatency()
    for depth, n, s in [(1, 1, 0.010), (2, 1, 0.011), (3, 1, 0.012), (4, 1, 0.013), (1, 8, 0.009), (4, 8, 0.012)]:
        m.observe(depth, n, s)
    m.refit()
    assert min(m.a, m.b, m.c) >= 0 and m(4, 1) == pytest.approx(0.013, abs=0.002)


def test_a_round_drafted_ahead_is_priced_one_token_deeper():
    """Drafted ahead, a round drafts k + 1 tokens beside the step being verified (the planner adds the target's
    bonus token), and the loop awaits it whatever is accepted: the controller prices the deeper round. With a
    13.5 ms verify step, 19 ms drafter steps (eager, remote) and acceptance 0.95: one token ahead is priced
    19 ms beside the step (5.5 ms beyond it: 1.95 tokens in 19 ms beat 1 in 13.5), two tokens 38 ms (24.5 ms
    beyond it: a loss), so the controller drafts without the extra depth and not with it."""
    c = _ctrl(0.0135, 0.0, 0.019, 0.0, acc=0.95)
    assert c.choose(["a"], {"a": 1}, overlap_s=0.0135)["a"] == 1
    assert c.choose(["a"], {"a": 1}, overlap_s=0.0135, ahead=True)["a"] == 0
    assert c._time([1], overlap=0.0135, ahead=True) == pytest.approx(0.0135 + 2 * 0.019 - 0.0135)
    assert c._time([0], overlap=0.0135, ahead=True) == pytest.approx(0.0135)  # nothing drafted, nothing deeper


def _search_by_full_passes(c: GoodputController, rids, caps, acc, participation, overlap, ahead):
    """The allocation's greedy search, each plan priced by a full pass (`_time`): the oracle for the fast search."""
    ks = {r: 0 for r in rids}

    def goodput(kv):
        t = c._time(list(kv.values()), None, participation, overlap, ahead)
        return sum(expected_tokens(acc[r], k) for r, k in kv.items()) / max(t, 1e-9)

    best = goodput(ks)
    while True:
        cand = None
        for r in rids:
            for j in range(ks[r] + 1, caps[r] + 1):
                g = goodput({**ks, r: j})
                if g > best * (1 + 1e-3) and (cand is None or g > cand[1]):
                    cand = ({**ks, r: j}, g)
        for j in range(1, max(caps.values()) + 1):
            kv = {r: max(ks[r], min(j, caps[r])) for r in rids}
            if kv != ks and (g := goodput(kv)) > best * (1 + 1e-3) and (cand is None or g > cand[1]):
                cand = (kv, g)
        if cand is None:
            return ks, best
        ks, best = cand


def test_the_fast_search_chooses_what_full_passes_choose():
    """Priced from running totals, the search makes the same choices as pricing every plan by a full pass, over
    random batches, acceptances, caps, round models, overlaps and drafting ahead."""
    import random

    rng = random.Random(1)
    for _ in range(2000):
        c = GoodputController(k_max=8)
        c.verify.a, c.verify.b = rng.uniform(0.002, 0.03), rng.uniform(0.0, 0.004)
        p = Participation(rng.choice([1, 2]), rng.random() < 0.5)
        m = c.draft_model(p)
        m.a, m.b, m.c = rng.uniform(0, 0.005), rng.uniform(0, 0.004), rng.uniform(0, 0.002)
        rids = [f"r{i}" for i in range(rng.randint(1, 12))]
        caps = {r: rng.randint(0, 8) for r in rids}
        acc = {r: rng.uniform(0.0, 0.99) for r in rids}
        overlap, ahead = (0.0, False) if rng.random() < 0.5 else (rng.uniform(0, 0.02), rng.random() < 0.5)
        if max(caps.values()) == 0:
            continue
        fast = c._allocate_fast(rids, caps, acc, p, overlap, ahead)
        ks, g = _search_by_full_passes(c, rids, caps, acc, p, overlap, ahead)
        assert fast[0] == ks and fast[1] == pytest.approx(g, rel=1e-9)


def test_a_plan_is_reused_while_its_inputs_are_unchanged_and_made_again_when_one_changes():
    """Each participation's plan is searched again only when something it is planned from changed: a request's
    acceptance, the latency models, the caps, the requests or their order, the overlap, drafting ahead."""
    c = GoodputController(k_max=8, participations=(ONE, FUSED))
    c.verify.a, c.verify.b = 0.02, 0.001
    for p in (ONE, FUSED):
        m = c.draft_model(p)
        m.a, m.b, m.c = 0.001, 0.002, 0.0005
    searched = []
    search = c._search
    c._search = lambda rids, caps, acc, groups, p, overlap, ahead, scoring: searched.append(p) or search(
        rids, caps, acc, groups, p, overlap, ahead, scoring)
    rids, caps = ["a", "b"], {"a": 8, "b": 8}

    def plans(**kw):
        searched.clear()
        return {p: c._allocate(kw.get("rids", rids), kw.get("caps", caps), None, p, kw.get("overlap", 0.0),
                               kw.get("ahead", False), kw.get("scoring", 0.0)) for p in (ONE, FUSED)}

    first = plans()
    assert sorted(map(str, searched)) == sorted(map(str, (ONE, FUSED)))
    first[ONE][0]["a"] = 99  # what `choose` does to a plan (its probes) does not reach the kept one
    again = plans()
    assert not searched and again[ONE][0]["a"] != 99 and again[FUSED] == first[FUSED]
    changes = [lambda: c.observe_acceptance("a", 4, 1, ONE), lambda: setattr(c.verify, "b", 0.0012),
               lambda: setattr(c.draft_model(FUSED), "c", 0.0006)]
    for change in changes:
        change()
        plans()
        assert searched, change
        plans()
        assert not searched
    for kw in ({"caps": {"a": 8, "b": 4}}, {"rids": ["b", "a"]}, {"rids": ["a"]}, {"overlap": 0.004},
               {"ahead": True}, {"scoring": 0.003}):
        plans(**kw)
        assert sorted(map(str, searched)) == sorted(map(str, (ONE, FUSED))), kw
        assert plans(**kw) and not searched, kw
