"""The model-free drafters (engines/ngram_drafter.py, engines/suffix_drafter.py): their indexes and matching, their
confidence, rollback, the tenant scoping of the suffix drafter's cross-request tree, their configuration, and
greedy output identical to the target's with them in the roster."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from pydantic import ValidationError

from assembly.drafter_server import DrafterServer
from assembly.loop import build_loop, generate_all
from config import AppConfig, DrafterSpec, RoutingSpec
from engines.ngram_drafter import NgramDrafterEngine
from engines.sampling import SamplingParams
from engines.suffix_drafter import SuffixDrafterEngine, SuffixTree
from model_family import DOMAINS
from model_family.distill import greedy_continue
from model_family.text_stats import repeated_ngram_share
from serve_app.app import tenant_of
from serve_app.cli import refusal
from speculation.messages import DrafterCall, SpeculationOverrides
from speculation.routing import Router
from tests.helpers.distribution import assert_first_two_tokens_follow_the_target
from tests.helpers.openai_server import openai_server


def _substrings(seqs: list[list[int]], depth: int) -> dict[tuple[int, ...], int]:
    """Occurrences of every substring of at most `depth` tokens: what the trie's counts must be."""
    out: dict[tuple[int, ...], int] = {}
    for s in seqs:
        for i in range(len(s)):
            for n in range(1, min(depth, len(s) - i) + 1):
                out[tuple(s[i:i + n])] = out.get(tuple(s[i:i + n]), 0) + 1
    return out


def _paths(tree: SuffixTree) -> dict[tuple[int, ...], int]:
    out, stack = {}, [((), tree.root)]
    while stack:
        path, node = stack.pop()
        for t, child in node.children.items():
            out[path + (t,)] = child.count
            stack.append((path + (t,), child))
    return out


def test_suffix_tree_counts_every_substring_up_to_its_depth_and_takes_them_back():
    rng = random.Random(0)
    seqs = [[rng.randrange(4) for _ in range(rng.randrange(1, 30))] for _ in range(5)]
    tree = SuffixTree(depth=5)
    for s in seqs:
        tree.add(s)
    assert _paths(tree) == _substrings(seqs, 5)
    tree.remove(seqs[1])
    assert _paths(tree) == _substrings(seqs[:1] + seqs[2:], 5)
    for s in seqs[:1] + seqs[2:]:
        tree.remove(s)
    assert _paths(tree) == {}
    # the last token of a growing sequence taken back, one at a time: as if never added
    s, active = seqs[0], []
    for t in s:
        active = tree.extend(active, t)
    for n in range(len(s), 0, -1):
        tree.retract(s[:n][-5:])
        assert _paths(tree) == _substrings([s[:n - 1]], 5)


def test_suffix_tree_matches_the_longest_suffix_that_occurred_with_a_continuation():
    tree = SuffixTree(depth=8)
    tree.add([1, 2, 3, 4, 9, 2, 3, 5, 7, 2, 3, 5])
    m = tree.match([8, 7, 2, 3])  # [7, 2, 3] occurred once, followed by 5; [2, 3] three times
    assert m.length == 3 and {t: c for t, (c, _) in m.counts.items()} == {5: 1}
    m = tree.match([6, 2, 3])  # only [2, 3]: followed by 4 once and 5 twice
    assert m.length == 2 and {t: c for t, (c, _) in m.counts.items()} == {4: 1, 5: 2}
    assert m.proposal().token == 5 and m.proposal().top_tokens == [5, 4]
    assert tree.match([6, 6]) is None


def test_ngram_drafter_copies_the_longest_earlier_ngram_with_frequency_confidence():
    e = NgramDrafterEngine("ngram", min_n=2, max_n=4)
    e.sync("r", [5, 1, 2, 3, 4, 8, 1, 2, 3, 4, 8, 0, 2, 3, 7, 1, 2, 3])
    [p] = e.draft(["r"], 1)["r"]
    # [1, 2, 3] was followed by 4 twice; the 4-gram [_, 1, 2, 3] ending the context never occurred before
    assert p.token == 4 and p.prob == pytest.approx(2 / (2 + 4 / 3))
    chain = e.draft(["r"], 4)["r"]
    # each proposal fed back and matched again; after [2, 3, 4, 8] came 1 and 0 once each: the first seen wins
    assert [q.token for q in chain] == [4, 8, 1, 2]
    e.sync("r", [9, 9, 9, 1])  # nothing before ends like this: no proposal
    assert e.step(["r"]) == {}


@pytest.mark.parametrize("make", [lambda: NgramDrafterEngine("ngram", 1, 4),
                                  lambda: SuffixDrafterEngine("suffix", max_depth=6)])
def test_a_model_free_drafter_synced_back_and_forth_drafts_as_a_fresh_one(make):
    rng = random.Random(1)
    text = [rng.randrange(6) for _ in range(120)]
    moved = make()
    for _ in range(30):  # contexts that grow, diverge and shrink, as rounds and lockstep re-calls give them
        n = rng.randrange(2, len(text))
        ctx = text[:n] + ([rng.randrange(6) for _ in range(rng.randrange(3))] if rng.random() < 0.5 else [])
        moved.sync("r", ctx)
        fresh = make()
        fresh.sync("r", ctx)
        assert moved.draft(["r"], 6) == fresh.draft(["r"], 6)


def test_suffix_drafter_drafts_a_tenants_earlier_output_for_that_tenant_only():
    e = SuffixDrafterEngine("suffix", max_depth=16)
    secret = list(range(100, 140))
    e.sync("a1", [1, 2, 3], tenant="A")
    e.sync("a1", [1, 2, 3] + secret)  # its output, as later rounds sync it
    e.release("a1")
    asked = [7, 8] + secret[:6]  # a prompt that starts the same text
    e.sync("b1", asked, tenant="B")
    e.sync("anon", asked)
    assert e.draft(["b1", "anon"], 8) == {"b1": [], "anon": []}  # never drafted for another tenant, or none
    e.sync("a2", asked, tenant="A")
    assert [p.token for p in e.draft(["a2"], 8)["a2"]] == secret[6:14]
    for rid in ("b1", "anon"):
        e.sync(rid, asked + [50, 51, 52])
        e.release(rid)  # B's output is B's; one without a tenant leaves nothing behind
    assert set(e.tenants) == {"A", "B"}
    e.sync("b2", asked, tenant="B")
    assert e.draft(["b2"], 8) == {"b2": []}


def test_suffix_drafter_keeps_the_last_outputs_of_the_most_recent_tenants():
    e = SuffixDrafterEngine("suffix", max_depth=8, cached_outputs=2, max_tenants=2)
    for i, tenant in enumerate(["A", "A", "A", "B", "C"]):
        e.sync(f"r{i}", [1], tenant=tenant)
        e.sync(f"r{i}", [1] + [10 * i + j for j in range(1, 6)])
        e.release(f"r{i}")
    assert list(e.tenants) == ["B", "C"]  # A served least recently: forgotten
    e2 = SuffixDrafterEngine("suffix", max_depth=8, cached_outputs=2)
    for i in range(3):
        e2.sync(f"r{i}", [1], tenant="A")
        e2.sync(f"r{i}", [1] + [10 * i + j for j in range(1, 6)])
        e2.release(f"r{i}")
    tree, outputs = e2.tenants["A"]
    assert len(outputs) == 2 and tree.match([1, 2]) is None and tree.match([11, 12]).length == 2


def _spec(**kw) -> DrafterSpec:
    return DrafterSpec.model_validate({"name": "x", **kw})


def test_model_free_drafters_are_configured_in_the_drafter_schema_and_bad_settings_refused_in_one_line():
    assert _spec(kind="ngram").ngram.max_n == 5 and _spec(kind="suffix", suffix={"max_depth": 8}).suffix.max_depth == 8
    assert _spec(kind="suffix").model_free and not _spec(model="drafter-code").model_free
    bad = [dict(kind="ngram", model="drafter-code"), dict(kind="suffix", dtype="float32"), dict(kind="model"),
           dict(kind="ngram", ngram={"min_n": 4, "max_n": 2}), dict(kind="ngram", suffix={}),
           dict(model="drafter-code", ngram={}), dict(kind="suffix", suffix={"max_depth": 1})]
    for kw in bad:
        with pytest.raises(ValidationError) as e:
            _spec(**kw)
        line = refusal(e.value)
        assert "\n" not in line and line.startswith("invalid configuration")


def _cfg(drafters: list[dict], k: int = 8) -> AppConfig:
    return AppConfig.model_validate({
        "tokenizer": "tokenizer", "drafters": drafters,
        "verifier": {"engine": "torch", "model": "target", "max_batch": 8, "max_len": 1024},
        "speculation": {"mode": "cosine", "k": k, "tree_budget": 16, "adaptive": False, "draft_timeout_ms": 10000,
                        "guard": {"enabled": False}}})


FREE = [{"name": "ngram", "kind": "ngram"}, {"name": "suffix", "kind": "suffix"}]


@pytest.mark.parametrize("lockstep", [True, False])
def test_greedy_output_is_the_targets_with_model_free_drafters_in_the_roster(target, tokenizer, heldout, lockstep):
    cfg = _cfg([{"name": "code", "model": "drafter-code"}, {"name": "legal", "model": "drafter-legal"}] + FREE)
    cfg.speculation.lockstep = lockstep
    prompts = [tokenizer(heldout[d][5], add_special_tokens=False).input_ids[:48] for d in DOMAINS]
    loop = build_loop(cfg)
    got = asyncio.run(generate_all(loop, prompts, [SamplingParams(max_tokens=40, ignore_eos=True)] * len(prompts)))
    want = [greedy_continue(target, torch.tensor([p]), 40)[0, len(p):].tolist() for p in prompts]
    assert [g.token_ids for g in got] == want
    assert any({"ngram", "suffix"} & set(g.stats["drafters_used"]) for g in got)
    assert any({"code", "legal"} & set(g.stats["drafters_used"]) for g in got)


def test_the_tenant_reaches_the_suffix_drafter_through_the_loop_and_only_its_outputs_draft_for_it(tokenizer, heldout):
    """A served request carries its API key's tenant (serve_app/app.py `tenant_of`) in its overrides; the planner,
    the coordinator and the drafter server hand it to the suffix drafter, whose tree of that tenant's outputs then
    drafts a later request of the same tenant, not one of another."""
    assert tenant_of("k1") == tenant_of("k1") != tenant_of("k2") and "k1" not in tenant_of("k1")
    assert tenant_of(None) is None
    cfg = _cfg([{"name": "suffix", "kind": "suffix"}], k=4)
    loop = build_loop(cfg)
    server = loop.drafting.servers["suffix"]
    suffix = server.engine
    prompt = tokenizer(heldout["legal"][2], add_special_tokens=False).input_ids[:40]
    params = [SamplingParams(max_tokens=48, ignore_eos=True)]
    [first] = asyncio.run(generate_all(loop, [prompt], params, [SpeculationOverrides(tenant="A")]))
    server.executor.submit(lambda: None).result()  # the release runs on the drafter's thread, after its steps
    assert set(suffix.tenants) == {"A"}
    # the same prompt again: tenant A drafts from its first output from the start, tenant B only from its own context
    [again] = asyncio.run(generate_all(loop, [prompt], params, [SpeculationOverrides(tenant="A")]))
    [other] = asyncio.run(generate_all(loop, [prompt], params, [SpeculationOverrides(tenant="B")]))
    assert again.token_ids == other.token_ids == first.token_ids
    assert again.stats["num_accepted_tokens"] > other.stats["num_accepted_tokens"]
    server.executor.submit(lambda: None).result()
    assert set(suffix.tenants) == {"A", "B"}


def _continued(target, tokenizer, heldout, domain: str, pick) -> tuple[list[int], list[int]]:
    """Of a domain's first two held-out texts, the one whose greedy continuation repeats itself most (`pick` max)
    or least (min): its first 32 tokens and 48 of the target's as the prompt, and the target's next 48."""
    outs = []
    for text in heldout[domain][:2]:
        p = tokenizer(text, add_special_tokens=False).input_ids[:32]
        out = greedy_continue(target, torch.tensor([p]), 96)[0, len(p):].tolist()
        outs.append((repeated_ngram_share(out[48:]), p + out[:48], out[48:]))
    _, prompt, want = pick(outs, key=lambda o: o[0])
    return prompt, want


def test_a_request_whose_output_repeats_its_context_is_drafted_by_the_model_free_drafters(target, tokenizer, heldout):
    """The target's own looping text as the prompt (the shipped target loops on code): its continuation repeats the
    context, and the model-free drafters alone draft it at full depth, output unchanged; beside a drafter model of
    another domain their tokens are accepted too. On free text (the least repetitive literature continuation) the
    domain drafter model stays ranked first."""
    prompt, want = _continued(target, tokenizer, heldout, "code", max)
    assert repeated_ngram_share(want) > 0.5
    for drafters in (FREE, [{"name": "biomedical", "model": "drafter-biomedical"}] + FREE):
        loop = build_loop(_cfg(drafters))
        [g] = asyncio.run(generate_all(loop, [prompt], [SamplingParams(max_tokens=48, ignore_eos=True)]))
        assert g.token_ids == want
        assert g.stats["mean_acceptance_length"] >= 6 and {"ngram", "suffix"} & set(g.stats["drafters_used"])
    prompt, want = _continued(target, tokenizer, heldout, "literature", min)
    loop = build_loop(_cfg([{"name": "literature", "model": "drafter-literature"}] + FREE))
    [g] = asyncio.run(generate_all(loop, [prompt], [SamplingParams(max_tokens=48, ignore_eos=True)]))
    assert g.token_ids == want
    [(_, ranking)] = loop.drafting.coordinator.routing_history
    assert ranking[0] == "literature"


# ~28 s on the 2-core CPU (1200 prefills of a long prompt): slow; make test-fast keeps the cosine mode's check
@pytest.mark.slow
def test_sampling_with_model_free_drafters_follows_the_targets_distribution(target, tokenizer, heldout):
    """Their drafts are deterministic proposals like every drafter's, verified by the same rejection rule: the first
    two sampled tokens of a prompt whose continuation repeats it (the target's own loop, so that both draft and are
    accepted) follow the target's joint distribution."""
    prompt, _ = _continued(target, tokenizer, heldout, "code", max)
    prompt = prompt[32:]  # the target's looping 48 tokens alone: the 1,200 prefills were most of the test's time
    params = dict(max_tokens=2, temperature=1.0, top_k=4, ignore_eos=True)
    n = 1200
    cfg = _cfg(FREE, k=2)
    cfg.verifier.max_batch = 64
    out = asyncio.run(generate_all(build_loop(cfg), [prompt] * n, [SamplingParams(seed=i, **params) for i in range(n)]))
    assert_first_two_tokens_follow_the_target(target, prompt, params, out)
    assert sum(o.stats["num_accepted_tokens"] for o in out) > 0.05 * n
    assert all(set(o.stats["drafters_used"]) <= {"ngram", "suffix"} for o in out)


def test_model_free_drafters_take_no_routed_place_and_join_every_routed_round():
    r = Router(["code", "legal", "ngram", "suffix"], RoutingSpec(drafters_per_request=1, alpha=0.0, beta=0.0),
               model_free=frozenset({"ngram", "suffix"}))
    r.add_request("x", {"code": -2.0, "legal": -5.0})  # the cold start: the models' prompt likelihoods only
    assert r.requests["x"].scores["ngram"] == 0.0 and r.route("x") == ["code", "ngram", "suffix"]
    for _ in range(30):
        r.update("x", 8.0, {"ngram": 1.0, "suffix": 1.0, "code": 0.1})
    assert r.ranking("x")[:2] == ["ngram", "suffix"]  # ranked by the same scores...
    assert r.route("x") == ["code", "ngram", "suffix"]  # ... but the places are the models'
    assert r.route("x", exclude={"suffix", "code"}) == ["legal", "ngram"]  # sitting out: left out


@pytest.mark.parametrize("kind", ["ngram", "suffix"])
def test_a_model_free_drafter_serves_drafter_calls_from_its_spec_and_times_its_own_steps(kind):
    server = DrafterServer.from_spec(DrafterSpec(name=kind, kind=kind, max_len=256))
    ctx = [5, 6, 7, 8, 9, 1, 2, 5, 6, 7]
    reply = server.step([DrafterCall("r", ctx, steps=3, tenant="A"), DrafterCall("s", [1, 2, 3], steps=3)])
    assert [p.token for p in reply.chains["r"]] == [8, 9, 1] and "s" not in reply.chains  # no match: no chain
    cost = server.batch_cost(4)
    assert 0 <= cost(4) < 0.01 and set(server.engine.states) == {"r", "s"}  # seconds; its own requests released
    server.release(["r", "s"])
    assert server.engine.states == {} and server.capture() == 0


def test_the_ingress_names_its_requests_tenant_by_the_api_key_it_checks(monkeypatch):
    """Every request past the key check carried the configured key (COSINE_API_KEY first): its digest is the tenant
    of the requests' overrides; without a key there is none (no cross-request drafting)."""
    monkeypatch.delenv("COSINE_API_KEY", raising=False)
    assert openai_server(api_key="s3cret").responder.tenant == tenant_of("s3cret")
    assert openai_server().responder.tenant is None
    monkeypatch.setenv("COSINE_API_KEY", "other")
    assert openai_server(api_key="s3cret").responder.tenant == tenant_of("other")


def _hybrid(models, tokenizer, heldout, alone, generalists=frozenset()):
    """A code drafter model and an n-gram drafter behind a coordinator with `routing.model_free_alone: alone`; the
    step function records every (drafter, request) call; two contexts: "loop" (a code passage seen three times
    before, a strong n-gram match) and "free" (legal text, none)."""
    from speculation.coordinator import SpeculationCoordinator

    servers = {"code": DrafterServer("code", str(models / "drafter-code"), max_len=512),
               "ngram": DrafterServer.from_spec(DrafterSpec(name="ngram", kind="ngram", max_len=512))}
    coord = SpeculationCoordinator(["code", "ngram"], RoutingSpec(model_free_alone=alone), model_free={"ngram"},
                                   generalists=generalists)
    called: list[tuple[str, str]] = []

    async def step_fn(name, calls):
        called.extend((name, c.request_id) for c in calls)
        return servers[name].step(calls).chains

    text = tokenizer(heldout["code"][0], add_special_tokens=False).input_ids[:40]
    contexts = {"loop": text * 3 + text[:20], "free": tokenizer(heldout["legal"][0], add_special_tokens=False).input_ids[:80]}
    return servers, coord, called, step_fn, text, contexts


@pytest.mark.parametrize("alone", [2.0, None])
def test_a_strong_match_drafts_without_the_models_and_a_weak_one_with_them(models, tokenizer, heldout, alone):
    """routing.model_free_alone: after the cold start, a request whose n-gram chain is expected to have `alone`
    tokens accepted (a passage seen three times before) is drafted by the n-gram drafter alone; a request without
    such a match gets the drafter model's chain as before, in the same round. Off (None): the model drafts both."""
    from speculation.coordinator import expected_accepted
    from speculation.messages import DraftRequest

    servers, coord, called, step_fn, text, contexts = _hybrid(models, tokenizer, heldout, alone)
    for _ in range(2):  # the first round scores the prompts with every drafter
        called.clear()
        drafts = asyncio.run(coord.draft([DraftRequest(r, c, 4, budget=8) for r, c in contexts.items()],
                                         step_fn)).drafts
    strong = expected_accepted(servers["ngram"].step([DrafterCall("probe", contexts["loop"], steps=4)]).chains["probe"])
    assert strong >= 2.0
    assert ("code", "free") in called and ("ngram", "loop") in called
    assert (("code", "loop") in called) == (alone is None)
    assert drafts["loop"].tokens[:4] == text[20:24]  # the passage's continuation


def test_the_generalists_rounds_take_the_model_free_drafters_and_a_strong_match_goes_without_its_forwards(
        models, tokenizer, heldout):
    """In the generalist participation (a loaded verifier's rounds) the model-free drafters join the generalist as
    in a routed round: the strong match ("loop", a passage seen three times) is drafted by the n-gram drafter alone,
    the request without a match by the generalist."""
    from speculation.messages import DraftRequest, Participation

    _, coord, called, step_fn, text, contexts = _hybrid(models, tokenizer, heldout, 2.0, generalists={"code"})
    together = Participation(1, generalist=True)
    for _ in range(2):
        called.clear()
        drafts = asyncio.run(coord.draft([DraftRequest(r, c, 4, budget=8, participation=together)
                                          for r, c in contexts.items()], step_fn)).drafts
    assert ("ngram", "loop") in called and ("code", "free") in called and ("code", "loop") not in called
    assert drafts["loop"].tokens[:4] == text[20:24]


@pytest.mark.parametrize("phase_s, worth, models_called", [(0.5, 0.5, False), (0.001, 3.0, True), (None, 0.5, True)])
def test_a_round_goes_without_the_models_where_their_tokens_are_worth_less_than_their_wait(
        models, tokenizer, heldout, phase_s, worth, models_called):
    """The weak matches' rounds are drafted by the models only where what they added recently (drafted tokens
    accepted in rounds with models) pays for the measured wait for their forwards against the verify step: a 0.5 s
    model phase for half a token does not, against a 50 ms step; a 1 ms one for three tokens does; an unmeasured
    one is tried. The strong match goes without them either way."""
    from speculation.messages import DraftRequest

    _, coord, called, step_fn, text, contexts = _hybrid(models, tokenizer, heldout, 2.0)

    def round_():
        called.clear()
        return asyncio.run(coord.draft([DraftRequest(r, c, 4, budget=8, verify_s=0.05) for r, c in contexts.items()],
                                       step_fn)).drafts

    round_()  # the first round scores the prompts with every drafter
    coord.model_phase_s.clear()
    if phase_s is not None:
        coord.model_phase_s[1] = phase_s  # one request drafted by the models
    coord.router.requests["free"].model_accepted = worth
    drafts = round_()
    assert (("code", "free") in called) == models_called and ("code", "loop") not in called
    assert coord.model_phases_skipped == (0 if models_called else 1)
    assert drafts["loop"].tokens[:4] == text[20:24]
    assert (coord.model_phase_s.get(1) != phase_s) == models_called  # a round with the models measures their phase


def test_a_model_free_drafters_confidence_is_scaled_by_what_the_target_accepted_of_its_drafts():
    """Router.calibrated: a request whose n-gram drafts the target keeps rejecting (sampled text) has its n-gram
    confidences scaled down towards the measured acceptance; one whose drafts are all accepted, up (bounded); a new
    request starts from every request's ratio. Without fusion the positions after a drafter's first miss were never
    judged, so they do not count against it."""
    from engines.interface import Proposal
    from speculation.routing import MAX_CONFIDENCE

    r = Router(["code", "ngram"], RoutingSpec(), model_free=frozenset({"ngram"}))
    for rid in ("sampled", "copying"):
        r.add_request(rid)
    assert r.factor("sampled", "ngram") == 1.0  # nothing measured: the confidences as counted
    drafted = [(7, 0.8), (8, 0.8), (9, 0.8), (10, 0.8)]
    for _ in range(6):
        r.observe_matches("sampled", [7, 3], {"ngram": drafted}, fused=True)  # 1 of 2 judged, 1.6 claimed
    low = r.factor("sampled", "ngram")
    assert 0.6 < low < 0.7  # 1 / 1.6
    for _ in range(6):
        r.observe_matches("copying", [1, 2, 3, 4, 5], {"ngram": [(t, 0.5) for t in (1, 2, 3, 4)]}, fused=True)
    high = r.factor("copying", "ngram")
    assert 1.5 < high <= 2.0  # 4 / 2, its start (every request's ratio, the sampled one's so far) weighing less
    chain, f = r.calibrated("sampled", "ngram", [Proposal(7, 0.8, [7, 2], [0.8, 0.1])])
    assert f == r.factor("sampled", "ngram") < 1  # its own record outweighs every request's, now higher
    assert chain[0].prob == pytest.approx(0.8 * f) and chain[0].top_probs[1] == pytest.approx(0.1 * f)
    assert r.calibrated("copying", "ngram", [Proposal(1, 0.9, [1], [0.9])])[0][0].prob == MAX_CONFIDENCE
    r.add_request("new")
    assert low < r.factor("new", "ngram") < high and r.factor("new", "ngram") != 1.0  # every request's, so far
    # one-shot: the first miss ends what the target judged (the rest followed the drafter's own tokens)
    r.add_request("oneshot")
    r.observe_matches("oneshot", [5, 6, 7, 8], {"ngram": [(5, 1.0), (0, 1.0), (7, 1.0)], "code": [(5, 0.9)]},
                      fused=False)
    assert r.requests["oneshot"].matched == {"ngram": [1.0, 2.0]}  # two judged, 1.0 claimed each; models not kept


def test_a_strong_match_the_target_keeps_rejecting_loses_its_round_to_the_models(models, tokenizer, heldout):
    """The coordinator scales each model-free chain by the request's calibration before choosing a round's drafters:
    a passage seen three times is drafted by the n-gram drafter alone while nothing is measured, and with the drafter
    model beside it once the target is measured to reject most of its tokens (as at T = 0.7); the round's record
    keeps the factor, and the feedback of the next round reaches the calibration."""
    from speculation.messages import DraftRequest

    _, coord, called, step_fn, text, contexts = _hybrid(models, tokenizer, heldout, 2.0)

    def round_(ctx):
        called.clear()
        return asyncio.run(coord.draft([DraftRequest(r, c, 4, budget=8) for r, c in ctx.items()], step_fn)).drafts

    round_(contexts)  # the first round scores the prompts with every drafter
    drafts = round_(contexts)
    assert ("code", "loop") not in called and drafts["loop"].tokens[:4] == text[20:24]
    assert coord.rounds["loop"].factors == {"ngram": 1.0}
    # the target took the first drafted token and then another: the n-gram's record is measured
    ctx = dict(contexts, loop=contexts["loop"] + [text[20], text[20] + 1])
    round_(ctx)
    assert coord.router.requests["loop"].matched["ngram"][0] == 1.0  # one of the two judged positions
    coord.router.requests["loop"].matched["ngram"] = [1.0, 20.0]  # as after rounds of sampled text
    drafts = round_(contexts)
    assert ("code", "loop") in called and coord.rounds["loop"].factors["ngram"] < 0.2
    ngram = coord.rounds["loop"].proposals["ngram"]
    assert ngram[0][0] == text[20] and ngram[0][1] < 0.2  # its token, at the calibrated confidence
    raw = ngram[0][1] / coord.rounds["loop"].factors["ngram"]
    assert coord.rounds["loop"].claims["ngram"][0] == (text[20], pytest.approx(raw))  # the raw claim it learns from
