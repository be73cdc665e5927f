"""Draft planning without Ray or models: each request's bounds, Gamma_max, participation."""

from config import AppConfig
from speculation.messages import Participation, SpeculationOverrides
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
    assert set(planner.controller.modes) == {Participation(1), Participation(2, True), Participation(2, False)}
    assert DraftPlanner(_cfg(adaptive=True, adaptive_drafters=False)).controller.modes == ()
    assert DraftPlanner(_cfg(mode="off", adaptive=True)).controller is None
    # with a generalist drafter, one more: every request on it (also with one drafter per request)
    cfg = _cfg(adaptive=True)
    cfg.drafters[2].generalist = True
    assert Participation(1, generalist=True) in DraftPlanner(cfg).controller.modes
    cfg.routing.drafters_per_request = 1
    planner = DraftPlanner(cfg)
    assert set(planner.controller.modes) == {Participation(1), Participation(1, generalist=True)}
    planner.controller.mode = Participation(1, generalist=True)
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

    from speculation.loop import VerifyLoop

    cfg = AppConfig.model_validate({"verifier": {"model": "target"}, "speculation": {"mode": "off"}})
    loop = VerifyLoop(None, cfg, None)

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
