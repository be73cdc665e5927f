"""The drafter pool (engines/drafter_pool.py): a pooled step gives every request what its drafter's own step gives,
and the verify loop with the pool on stays lossless."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

from config import AppConfig
from engines.drafter import DrafterEngine
from engines.drafter_pool import DrafterPool, pool_shape
from engines.sampling import SamplingParams
from engines.verifier import TorchVerifierEngine
from model_family.distill import greedy_continue
from assembly.loop import build_loop, generate_all
from speculation.messages import SpeculationOverrides

NAMES = ("code", "legal", "literature", "generic")


@pytest.fixture(scope="module")
def drafter_models(models):
    return {d: AutoModelForCausalLM.from_pretrained(models / f"drafter-{d}", dtype=torch.float32).eval()
            for d in NAMES}


@pytest.fixture(scope="module")
def texts(tokenizer, heldout) -> list[list[int]]:
    return [tokenizer(heldout[d][i], add_special_tokens=False).input_ids for d in heldout for i in range(2)]


def _engines(drafter_models) -> dict[str, DrafterEngine]:
    return {n: DrafterEngine(m, name=n, max_requests=6, max_len=256) for n, m in drafter_models.items()}


def _same(a, b) -> None:
    assert a.token == b.token
    assert a.top_tokens == b.top_tokens
    assert a.prob == pytest.approx(b.prob, abs=1e-4)
    assert a.top_probs == pytest.approx(b.top_probs, abs=1e-4)
    if a.context_loglik is None:
        assert b.context_loglik is None
    else:
        assert a.context_loglik == pytest.approx(b.context_loglik, abs=1e-4)


@pytest.mark.parametrize("padded", [False, True])
def test_pooled_steps_equal_each_drafters_own(drafter_models, texts, padded):
    """Several drafters x requests (1 to 4 per drafter), mixed contexts (prompts prefilled, short pending runs of
    several tokens), chains of several depths, rollbacks to a diverged context, releases (slots moving) and new
    requests: every proposal equal to the drafter's own, up to float rounding. `padded`: the chain steps at the
    bucketed fixed shapes a GPU replays as CUDA graphs, run directly."""
    alone, pooled = _engines(drafter_models), _engines(drafter_models)
    pool = DrafterPool(list(pooled.values()), padded=padded)
    rids = {n: [f"{n}-{i}" for i in range(1 + j)] for j, n in enumerate(NAMES)}
    ctx = {r: texts[(j * 3 + i) % len(texts)][:10 + 13 * i] for j, n in enumerate(NAMES)
           for i, r in enumerate(rids[n])}  # 10 tokens (pooled prefill) to 49 (alone)

    def check(want_loglik=(), alternatives=False):
        want = {n: alone[n].step(rids[n], want_loglik=n in want_loglik, alternatives=alternatives) for n in rids}
        got = pool.step(rids, want_loglik=want_loglik, alternatives=alternatives)
        for n, group in rids.items():
            assert set(got[n]) == set(group)
            for r in group:
                _same(want[n][r], got[n][r])
                assert len(got[n][r].top_tokens) == (4 if alternatives else 1)
        return want

    def sync(contexts):
        for n, group in rids.items():
            for r in group:
                alone[n].sync(r, contexts[r])
                pooled[n].sync(r, contexts[r])

    sync(ctx)
    first = check(want_loglik=set(NAMES), alternatives=True)
    assert any(p.context_loglik is not None for g in first.values() for p in g.values())
    ks = {n: {r: 3 + i for i, r in enumerate(rids[n])} for n in rids}
    for n, group in rids.items():
        for r in group:
            alone[n].feed(r, [first[n][r].token])
            pooled[n].feed(r, [first[n][r].token])
    want = {n: alone[n].draft(rids[n], ks[n], alternatives=True) for n in rids}
    got = pool.draft(rids, ks, alternatives=True)
    for n, group in rids.items():
        for r in group:
            assert len(got[n][r]) == ks[n][r]
            for a, b in zip(want[n][r], got[n][r], strict=True):
                _same(a, b)
    # a context that diverged a few tokens back (the target rejected part of the chain): rollback, 3 tokens pending
    sync({r: ctx[r] + [want[n][r][0].token, 7, 11] for n, group in rids.items() for r in group})
    check(want_loglik=set(NAMES))
    # releases move the highest slot into the hole; new requests take the free slots
    for n in ("code", "literature", "generic"):
        gone = rids[n].pop(0)
        alone[n].release(gone)
        pooled[n].release(gone)
    rids["code"] = [f"code-new-{i}" for i in range(3)]
    new = {r: texts[i][:5 + i] for i, r in enumerate(rids["code"])}
    sync({**{r: ctx[r] + [9] for n in rids for r in rids[n] if r in ctx}, **new})
    check()
    # a step of a subset of the drafters, then of one drafter
    for subset in (("code", "legal"), ("legal",)):
        for n in subset:
            for r in rids[n]:
                alone[n].sync(r, new.get(r, ctx.get(r, [])) + [5, 6])
                pooled[n].sync(r, new.get(r, ctx.get(r, [])) + [5, 6])
        want = {n: alone[n].step(rids[n]) for n in subset}
        got = pool.step({n: rids[n] for n in subset})
        assert set(got) == set(subset)
        for n in want:
            for r in want[n]:
                _same(want[n][r], got[n][r])
    assert pool.forward_passes >= 5


def test_only_same_shape_drafters_pool(drafter_models, target):
    a = DrafterEngine(drafter_models["code"], name="a", max_len=256)
    b = DrafterEngine(drafter_models["legal"], name="b", max_len=256)
    assert pool_shape(a) == pool_shape(b) is not None
    other = DrafterEngine(target, name="target", max_len=256)  # another shape
    assert pool_shape(other) != pool_shape(a)
    with pytest.raises(ValueError, match="one shape"):
        DrafterPool([a, other])
    c = DrafterEngine(drafter_models["code"], name="c", max_len=128)  # another context length
    with pytest.raises(ValueError, match="one shape"):
        DrafterPool([a, c])
    assert pool_shape(DrafterEngine(drafter_models["code"], runner="transformers", max_len=256)) is None


@pytest.mark.parametrize("pool", ["on", "off"])
def test_loop_with_pooled_drafters_is_lossless(target, drafter_models, tokenizer, heldout, pool):
    """The in-process loop, every request drafting with 3 drafters (one-shot fusion), then routed CoSine (cold
    start scoring by every drafter, lockstep fusion): greedy output equal to target-only, the pool doing the
    drafting where on."""
    prompts = [tokenizer(heldout[d][5], add_special_tokens=False).input_ids[:n]
               for d, n in zip(heldout, (8, 40, 12, 60, 20, 30))]
    new = 20
    reference = [greedy_continue(target, torch.tensor([p]), new)[0, len(p):].tolist() for p in prompts]
    names = list(drafter_models)
    for routed in (False, True):
        cfg = AppConfig(verifier={"model": "target", "max_batch": 4, "max_len": 256},
                        drafters=[{"name": n, "model": n, "max_len": 256} for n in names],
                        speculation={"mode": "cosine", "k": 4, "adaptive": False, "guard": {"enabled": False}, "tree_budget": 8,
                                     "lockstep": routed, "draft_timeout_ms": 600_000, "pool_drafters": pool},
                        routing={"drafters_per_request": 2 if routed else 3})
        loop = build_loop(cfg, TorchVerifierEngine(target, max_batch=4, max_len=256), drafter_models)
        tier = loop.drafting
        overrides = [None if routed else SpeculationOverrides(drafters=names[:3], lockstep=False)] * len(prompts)
        out = asyncio.run(generate_all(loop, prompts, [SamplingParams(max_tokens=new, ignore_eos=True)] * len(prompts),
                                       overrides))
        assert [o.token_ids for o in out] == reference
        assert sum(o.stats["num_accepted_tokens"] for o in out) > 0.2 * len(prompts) * new
        for s in tier.servers.values():
            s.executor.submit(lambda: None).result()
        assert not any(s.engine.states for s in tier.servers.values())  # every drafter cache released
        pools = {id(p): p.pool for p in tier.pools.values()}
        if pool == "off":
            assert not pools
        else:
            assert set(tier.pools) == set(names)
            assert sum(p.forward_passes for p in pools.values()) > 10


@pytest.mark.parametrize("padded", [False, True])
def test_a_round_costs_one_forward_per_drafter_shape_and_depth(drafter_models, target, texts, padded):
    """Through the in-process drafting tier: however many same-shape drafters and requests a round uses (4
    drafters x 6 requests, each request drafting with 3 of them), each depth is one pooled forward and one host
    read; a drafter of another shape (the target's own model as a drafter) adds its own forward per depth. The
    first round's first depth prefills every prompt in every drafter in that one forward too."""
    from engines.device_work import WORK
    from assembly.drafter_server import DrafterServer
    from assembly.drafting_tier import InProcessDraftingTier
    from speculation.coordinator import SpeculationCoordinator
    from speculation.messages import DraftRequest

    k = 4
    names = list(NAMES)
    for other in (False, True):
        drafters = names + (["big"] if other else [])
        servers = {n: DrafterServer(n, DrafterEngine(drafter_models[n] if n != "big" else target, name=n,
                                                     max_requests=8, max_len=256)) for n in drafters}
        tier = InProcessDraftingTier(SpeculationCoordinator(drafters), servers, "on", pool_padded=padded)
        contexts = {f"r{i}": texts[i][:30 + 5 * i] for i in range(6)}

        def round_():
            batch = [DraftRequest(r, c, k, budget=3 * k, drafters=[names[i % 4], names[(i + 1) % 4]]
                                  + (["big"] if other else [names[(i + 2) % 4]])) for i, (r, c) in
                     enumerate(contexts.items())]
            before = WORK.snapshot()
            drafts = asyncio.run(tier.draft(batch)).drafts
            return WORK.since(before), drafts

        first, _ = round_()
        shapes = 2 if other else 1
        assert first.drafter_forwards == shapes * k  # the prompts prefilled by all drafters together at depth 0
        for step in range(3):
            contexts = {r: c + [c[-1], 5 + step] for r, c in contexts.items()}  # two tokens committed since
            work, drafts = round_()
            assert len(drafts) == len(contexts)
            assert work.drafter_forwards == shapes * k
            assert work.host_reads == shapes * k
        # two rounds at once over the same drafters (the pipeline's halves, each with its own requests): still one
        # forward per depth (the pool's drafters only), each round given its own requests' drafts
        halves = [list(contexts)[:3], list(contexts)[3:]]
        contexts = {r: c + [c[-1]] for r, c in contexts.items()}

        async def both():
            return await asyncio.gather(*(tier.draft([DraftRequest(r, contexts[r], k, budget=3 * k,
                                                                   drafters=[names[i % 4], names[(i + 1) % 4]])
                                                      for i, r in enumerate(half, start=3 * h)])
                                          for h, half in enumerate(halves)))

        before = WORK.snapshot()
        drafts = asyncio.run(both())
        assert WORK.since(before).drafter_forwards == k
        assert [sorted(d.drafts) for d in drafts] == [sorted(h) for h in halves]
        for s in servers.values():
            s.executor.shutdown(wait=True)


def test_a_tier_stepped_on_the_verifiers_thread_drafts_as_on_its_own(drafter_models, texts):
    """`InProcessDraftingTier.step_on` (colocated drafters on a CPU step on the verifier's thread): every drafter
    and the pool then step on that thread alone, their own threads shut down, and every draft is the one the
    drafters give on threads of their own."""
    from concurrent.futures import ThreadPoolExecutor

    from assembly.drafter_server import DrafterServer
    from assembly.drafting_tier import InProcessDraftingTier
    from speculation.coordinator import SpeculationCoordinator
    from speculation.messages import DraftRequest

    names, k = list(NAMES), 4
    contexts = {f"r{i}": texts[i][:20 + 7 * i] for i in range(4)}
    verifier_thread = ThreadPoolExecutor(1, thread_name_prefix="verifier")
    drafts = {}
    for setting in ("off", "on"):
        servers = {n: DrafterServer(n, DrafterEngine(drafter_models[n], name=n, max_requests=4, max_len=128))
                   for n in names}
        tier = InProcessDraftingTier(SpeculationCoordinator(names), servers, setting)
        own = {s.executor for s in servers.values()}
        if setting == "on":
            tier.step_on(verifier_thread)
            assert {s.executor for s in servers.values()} == {verifier_thread} == {p.executor for p in
                                                                                   tier.pools.values()}
            for e in own:  # shut down: nothing more runs there
                with pytest.raises(RuntimeError):
                    e.submit(int)
        batch = [DraftRequest(r, c, k, budget=2 * k, drafters=[names[i % 4], names[(i + 1) % 4]])
                 for i, (r, c) in enumerate(contexts.items())]
        drafts[setting] = {r: d.tokens for r, d in asyncio.run(tier.draft(batch)).drafts.items()}
        for e in own:
            e.shutdown(wait=True)
    verifier_thread.shutdown(wait=True)
    assert drafts["on"] == drafts["off"] and len(drafts["on"]) == len(contexts)


def test_the_pool_by_default_only_where_the_drafters_run_on_a_gpu(drafter_models):
    """`pool_drafters: auto` (the default) pools same-shape drafters on a GPU only: on a CPU each steps alone (the
    pooled step measured no faster there); `on` pools them wherever they run."""
    from assembly.drafter_server import DrafterServer
    from assembly.drafting_tier import InProcessDraftingTier
    from config import SpeculationSpec
    from speculation.coordinator import SpeculationCoordinator

    assert SpeculationSpec().pool_drafters == "auto"
    pooled = {}
    for setting in ("auto", "on", "off"):
        servers = {n: DrafterServer(n, DrafterEngine(drafter_models[n], name=n, max_requests=4, max_len=128))
                   for n in NAMES}
        tier = InProcessDraftingTier(SpeculationCoordinator(list(NAMES)), servers, setting)
        pooled[setting] = sorted(tier.pools)
        for s in servers.values():
            s.executor.shutdown(wait=True)
    assert pooled == {"auto": [], "on": sorted(NAMES), "off": []}


def test_prompts_prefilled_together_beside_a_long_context_equal_each_alone(drafter_models, texts):
    """Runs longer than LONG_PENDING of requests with different cached lengths go in one forward (one drafter's
    step, and pooled): the short run's padding reaches past the end of the cache (a request near max_len beside a
    new prompt); every proposal equals the request's stepped alone."""
    max_len = 64
    names = ("code", "legal")

    def engines():
        return {n: DrafterEngine(drafter_models[n], name=n, max_requests=4, max_len=max_len) for n in names}

    ctx = {"old": texts[0][:40], "new": texts[1][:44]}
    for pooled in (False, True):
        together, alone = engines(), engines()
        for e in (*together.values(), *alone.values()):
            e.sync("old", ctx["old"])
            e.step(["old"])
            e.sync("old", texts[0][:40 + 20])  # 20 pending: a long run at cached length 40 (padding past 64)
            e.sync("new", ctx["new"])  # 44 pending from nothing
        got = DrafterPool(list(together.values())).step({n: ["old", "new"] for n in names}) if pooled else \
            {n: together[n].step(["old", "new"]) for n in names}
        for n in names:
            for r in ("old", "new"):
                _same(alone[n].step([r])[r], got[n][r])


@pytest.mark.parametrize("cap", [1, 6, 8, 16])
def test_startup_captures_cover_every_bucket_a_step_can_meet(cap):
    """`capture` (the pool's and the runners') walks `buckets`: every shape a step of 1..cap rows rounds up to, and
    no other, so no step captures while serving."""
    from engines.graphs import bucket, buckets

    assert set(buckets(cap)) == {bucket(n, cap) for n in range(1, cap + 1)}
