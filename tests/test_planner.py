"""Draft planning without Ray or models: each request's bounds, Gamma_max, participation."""

import pytest

from config import AppConfig
from speculation.messages import DraftRequest, Participation, SpeculationOverrides
from speculation.planner import DraftPlanner


def _cfg(**speculation) -> AppConfig:
    return AppConfig(verifier={"model": "target"}, drafters=[{"name": n, "model": n} for n in ("a", "b", "c")],
                     speculation={"k": 4, "adaptive": False, **speculation}, routing={"drafters_per_request": 2})


def test_requests_bound_their_own_drafts_and_gamma_max_bounds_the_batch():
    planner = DraftPlanner(_cfg(gamma_max=7))
    contexts = {"r1": [1, 2], "r2": [3], "r3": [4, 5, 6], "r4": [7]}
    overrides = {"r1": SpeculationOverrides(), "r2": SpeculationOverrides(enabled=False),
                 "r3": SpeculationOverrides(max_draft_tokens=1), "r4": SpeculationOverrides()}
    batch = {d.request_id: d for d in planner.plan(contexts, overrides)}
    assert "r2" not in batch  # speculation off for this request: plain decoding
    assert batch["r3"].k == 1
    assert sum(d.k for d in batch.values()) <= 7  # the longest drafts were shortened first
    assert batch["r1"].k + batch["r4"].k == 6 and abs(batch["r1"].k - batch["r4"].k) <= 1
    assert batch["r1"].context == [1, 2]


def test_participation_follows_the_request_then_the_configuration():
    planner = DraftPlanner(_cfg(lockstep=False))
    assert planner.participation(SpeculationOverrides()) == Participation(2, lockstep=False)
    assert planner.participation(SpeculationOverrides(drafters=["a"])) == Participation(1)
    assert planner.participation(SpeculationOverrides(drafters_per_request=3, lockstep=True)) == Participation(3, True)
    chain = DraftPlanner(_cfg(mode="chain"))
    assert chain.participation(SpeculationOverrides(lockstep=True)) == Participation(1)
    # a vote: every voter (all drafters unless the request or speculation.vote names them), whatever the server mode
    assert planner.participation(SpeculationOverrides(mode="vote")) == Participation(len(planner.cfg.drafters),
                                                                                     vote=True)
    assert chain.participation(SpeculationOverrides(mode="vote", drafters=["a", "b"])) == Participation(2, vote=True)
    # the tree budget: up to n nodes per depth
    [d] = planner.plan({"r": [1]}, {"r": SpeculationOverrides(drafters_per_request=3)})
    assert d.budget == min(8, 3 * 4) and d.participation.drafters_per_request == 3


def test_the_adaptive_controller_offers_every_participation_mode():
    planner = DraftPlanner(_cfg(adaptive=True))
    assert set(planner.controller.participations) == {Participation(1), Participation(2, True), Participation(2, False)}
    assert DraftPlanner(_cfg(adaptive=True, adaptive_drafters=False)).controller.participations == ()
    assert DraftPlanner(_cfg(mode="off", adaptive=True)).controller is None
    # with a generalist drafter, one more: every request on it (also with one drafter per request)
    cfg = _cfg(adaptive=True)
    cfg.drafters[2].generalist = True
    assert Participation(1, generalist=True) in DraftPlanner(cfg).controller.participations
    cfg.routing.drafters_per_request = 1
    planner = DraftPlanner(cfg)
    assert set(planner.controller.participations) == {Participation(1), Participation(1, generalist=True)}
    planner.controller.participation = Participation(1, generalist=True)
    assert planner.participation(SpeculationOverrides()) == Participation(1, generalist=True)
    # a request that fixes its drafters or their number is routed as it asks
    assert planner.participation(SpeculationOverrides(drafters_per_request=1)) == Participation(1)
    assert planner.participation(SpeculationOverrides(drafters=["a"])) == Participation(1)


def test_the_controller_starts_from_profiled_step_models(tmp_path):
    """`cosine profile`'s seeds price the first rounds; the online fit replaces them."""
    from config import AppConfig
    from speculation.planner import make_controller

    cfg = AppConfig.model_validate({
        "verifier": {"model": "target"}, "drafters": [{"name": "code", "model": "drafter-code"}],
        "speculation": {"controller": {"verify_seed_ms": [30.0, 0.5], "draft_seed_ms": [2.0, 0.1]}}})
    c = make_controller(cfg)
    assert (c.verify.a, c.verify.b, c.draft.a, c.draft.b) == (0.03, 0.0005, 0.002, 0.0001)
    for n in (1, 5, 9, 13):
        c.verify.observe(n, 0.01 + 0.001 * n)
    assert abs(c.verify.a - 0.01) < 1e-9 and abs(c.verify.b - 0.001) < 1e-9


def test_stopping_the_loop_outlasts_a_swallowed_cancellation():
    """On Python 3.11 `asyncio.wait_for` drops a cancellation that arrives as its inner call completes, and a task
    awaiting it runs on (seen as a hang of the whole suite at the end of a drafted-ahead run): `stop` cancels until
    the task is done."""
    import asyncio
    from types import SimpleNamespace

    from speculation.loop import VerifyLoop

    cfg = AppConfig.model_validate({"verifier": {"model": "target"}, "speculation": {"mode": "off"}})
    loop = VerifyLoop(SimpleNamespace(partial_steps=False), cfg, None)  # an engine the stopped task never steps

    async def run() -> bool:
        async def stubborn():
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                pass  # what wait_for does on 3.11 when its call has just completed
            await asyncio.sleep(60)  # the loop going back to wait for requests

        loop.task = asyncio.get_running_loop().create_task(stubborn())
        await asyncio.sleep(0)
        stopping = asyncio.get_running_loop().create_task(loop.stop())
        done, _ = await asyncio.wait({stopping}, timeout=10)  # unlike wait_for, cancels nothing on timeout
        loop.task.cancel()
        return stopping in done and loop.task.cancelled()

    assert asyncio.run(run())


def _retiring_cfg(**retirement) -> AppConfig:
    scaled = {"autoscaling_config": {"min_replicas": 0, "max_replicas": 2}}
    return AppConfig(verifier={"model": "target"},
                     drafters=[{"name": "a", "model": "a", "deployment": scaled},
                               {"name": "b", "model": "b", "deployment": scaled},
                               {"name": "g", "model": "g", "generalist": True}],
                     speculation={"k": 4, "retirement": {"window_rounds": 20, "min_rounds": 4, **retirement}},
                     routing={"drafters_per_request": 1})


def test_domain_drafters_retire_when_the_controller_routes_few_rounds_and_return_when_it_routes_again():
    """Below `below` of the window's rounds routed by the controller's choice, the remaining routed rounds draft on
    the generalist too (no call reaches a domain drafter the autoscaler may be taking away); above `above`, they
    are routed again. The share counts the controller's choices, not what retirement made of them, so a lone
    request's rounds (always routed) bring them back; the window is a count of request rounds, so a pause in
    traffic keeps it as it was."""
    from speculation.retirement import DomainDrafterRetirement

    retirement = DomainDrafterRetirement(_retiring_cfg().speculation.retirement, tree_budget=8)
    assert retirement.take() == 0.0
    for _ in range(3):  # under min_rounds: too few to judge
        retirement.observe(drafted=1, routed=0)
    assert not retirement.retired
    retirement.observe(drafted=8, routed=0)
    assert retirement.retired and retirement.take() == 0.0  # not retired through the whole interval yet
    assert retirement.take() == 1.0  # an interval without rounds (a pause) keeps it
    routed = DraftRequest("r", [1], 4, budget=4, participation=Participation(1))
    fixed = DraftRequest("f", [1], 4, budget=4, participation=Participation(1), drafters=["a"])
    pair = DraftRequest("p", [1], 3, budget=6, participation=Participation(2, lockstep=True))
    out = retirement.apply([routed, fixed, pair])
    assert [d.participation for d in out] == [Participation(1, generalist=True), Participation(1),
                                              Participation(1, generalist=True)]
    assert out[2].budget == 3 and out[1] is fixed  # the request's own drafters are left as asked
    retirement.observe(drafted=8, routed=0)  # 19 request rounds, none routed
    for _ in range(6):  # lone requests after the pause: 6 of the last 22 routed, between the thresholds
        retirement.observe(drafted=1, routed=1)
    assert retirement.retired and retirement.drafted == 22 and 0.1 < retirement.share() < 0.3
    retirement.observe(drafted=1, routed=1)  # 7 of 23
    assert not retirement.retired and retirement.take() == 0.0
    assert retirement.apply([routed]) == [routed]


def test_the_planner_retires_domain_drafters_only_where_the_autoscaler_can_take_them():
    from speculation.retirement import DomainDrafterRetirement

    assert DomainDrafterRetirement.from_config(_retiring_cfg()) is not None
    assert DomainDrafterRetirement.from_config(_cfg(adaptive=True)) is None  # no generalist, nothing autoscaled
    colocated = _retiring_cfg().model_copy(deep=True)
    colocated.speculation.drafting_tier = "colocated"
    assert DomainDrafterRetirement.from_config(colocated) is None
    planner = DraftPlanner(_retiring_cfg())
    c, chosen = planner.controller, [Participation(1, generalist=True)]

    def choose(rids, caps, **_):  # the controller's choice of participation, set by the test
        c.participation, c.probing = chosen[0], False
        return dict(caps)

    c.choose = choose
    contexts = {f"r{i}": [i] for i in range(4)}
    overrides = {r: SpeculationOverrides() for r in contexts}
    for _ in range(5):
        planner.plan(contexts, overrides)
    assert planner.retirement.retired
    chosen[0] = Participation(1)  # the controller routes: drafted on the generalist while retired
    assert all(d.participation.generalist for d in planner.plan(contexts, overrides))  # 4 of 20 routed by choice
    batch = planner.plan(contexts, overrides)  # 8 of 20
    assert not planner.retirement.retired and not any(d.participation.generalist for d in batch)


def test_a_routed_probe_waits_for_a_round_without_prompts_to_score():
    """While the generalist is held, a due probe of a routed participation is not run in a round with a request
    whose prompt no routed round has scored (it would score them with every drafter, stalling the batch, and price
    nothing); in a round of scored requests it is."""
    cfg = _cfg(adaptive=True, lockstep=False)
    cfg.drafters[2].generalist = True
    cfg.routing.drafters_per_request = 1
    planner = DraftPlanner(cfg)
    c, shared = planner.controller, Participation(1, generalist=True)
    c.participation_probe = c.participation_probe_max = 2
    c.verify.a, c.verify.b = 0.030, 0.001
    for p, seconds in ((shared, 0.002), (Participation(1), 0.020)):  # the generalist's rounds are the cheaper
        for depth in (2, 4, 6, 8):
            c.observe_round(4, depth, {p}, seconds * depth)
    contexts = {r: [1, 2, 3] for r in ("a", "b", "c", "d")}
    overrides = {r: SpeculationOverrides() for r in contexts}
    held, probes = [], 0
    for _ in range(12):
        batch = planner.plan(contexts, overrides, unscored=frozenset({"d"}))
        held.append({d.participation for d in batch})
    assert held and all(p == {shared} for p in held)  # every probe due was held back
    for _ in range(12):
        batch = planner.plan(contexts, overrides)
        probes += {d.participation for d in batch} == {Participation(1)}
    assert probes >= 1


def test_a_round_that_waited_for_a_failed_drafter_prices_nothing():
    """A round with a drafter's failed or late call (`DraftRound.faulted`) waited for that call's deadline: its
    time is the fault's, and the drafter sits out its next rounds. Priced, one 5 s round among rounds of 2 ms a
    depth fits the participation's round time so high that no request drafts again (the served fault test's routed
    request, held at k = 0 after a stopped drafter's round); unpriced, the plans go on as before it."""
    contexts = {r: [1, 2, 3] for r in ("a", "b")}
    overrides = {r: SpeculationOverrides() for r in contexts}

    def plans_after_a_stall(faulted: bool) -> list[int]:
        planner = DraftPlanner(_cfg(adaptive=True))
        planner.controller.verify.a, planner.controller.verify.b = 0.030, 0.001
        for i in range(24):
            batch = planner.plan(contexts, overrides)
            assert batch, f"round {i}: no request drafts"
            stall = i == 20
            seconds = 5.0 if stall else 0.002 * max(d.k for d in batch) * batch[0].participation.drafters_per_request
            planner.observe_round(batch, {d.participation for d in batch}, seconds, faulted=stall and faulted)
            for d in batch:  # half of every draft accepted
                planner.observe_acceptance(d.request_id, d.k, d.k // 2, d.participation)
        return [d.k for d in planner.plan(contexts, overrides)]

    assert plans_after_a_stall(faulted=False) == []  # priced: every request held at k = 0
    ks = plans_after_a_stall(faulted=True)
    assert len(ks) == 2 and min(ks) > 0


def test_a_routed_round_that_scored_prompts_prices_scoring_for_the_next_unscored_ones():
    """The planner hands a round's scored context tokens to the controller with the round's one participation
    (`DraftPlanner.observe_round`); the plans after it price scoring the contexts of the requests still unscored,
    so a batch of new prompts drafts on the generalist while the scored batch stays routed."""
    cfg = _cfg(adaptive=True)
    cfg.drafters[2].generalist = True
    cfg.routing.drafters_per_request = 1
    planner = DraftPlanner(cfg)
    c, shared, one = planner.controller, Participation(1, generalist=True), Participation(1)
    c.participation_probe = c.participation_probe_max = 1000
    c.verify.a, c.verify.b = 0.030, 0.001
    for p, accepted in ((one, 3), (shared, 2)):  # routed drafts are accepted more, for the same round time
        for depth in (2, 4, 6, 8):
            c.observe_round(4, depth, {p}, 0.002 * depth)
        for _ in range(20):
            c.observe_acceptance(f"pool-{p}", drafted=4, accepted=accepted, participation=p)
    contexts = {r: list(range(100)) for r in ("a", "b", "c", "d")}
    overrides = {r: SpeculationOverrides() for r in contexts}
    assert {d.participation for d in planner.plan(contexts, overrides, unscored=set(contexts))} == {one}
    batch = [DraftRequest(r, contexts[r], k=4, budget=4, participation=one) for r in contexts]
    planner.observe_round(batch, {None}, 0.008 + 0.5, scored_tokens=400)  # scoring added 0.5 s to 8 ms
    assert c.scoring_s_per_token == pytest.approx(0.5 / 400)
    assert {d.participation for d in planner.plan(contexts, overrides, unscored=set(contexts))} == {shared}
    assert {d.participation for d in planner.plan(contexts, overrides)} == {one}
