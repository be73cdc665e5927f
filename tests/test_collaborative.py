"""CoS collaborative decoding (engines/collaborative.py): outputs follow the combination of the partner's and the
target's distributions, exactly, whether computed token by token or with speculation (naive CoS or APF)."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from transformers import AutoModelForCausalLM

from config import AppConfig
from engines.collaborative import CollaborativeEngine, Combination
from engines.interface import VerifierEngine
from engines.sampling import SamplingParams, target_probs
from assembly.loop import build_loop, generate_all
from speculation.messages import SpeculationOverrides

ENSEMBLE = Combination("ensemble", weight=0.4)
CONTRASTIVE = Combination("contrastive", mu=0.1)


@pytest.fixture(scope="module")
def partner(models):
    return AutoModelForCausalLM.from_pretrained(models / "drafter-literature", dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(tokenizer, heldout) -> list[list[int]]:
    return [tokenizer(heldout[d][2], add_special_tokens=False).input_ids[:n]
            for d, n in zip(("literature", "code", "legal", "dialogue"), (6, 40, 17, 64))]


def _generate(target, partner, comb, prompts, params, k, alternate=True, batch=4):
    engine = CollaborativeEngine(target, partner, comb, k=k, alternate=alternate, max_batch=batch, max_len=256)
    params = params if isinstance(params, list) else [params] * len(prompts)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    out = {i: [] for i in ids}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    engine.stats = [engine.finished_stats(i) for i in ids]
    return [out[i] for i in ids], engine


@torch.no_grad()
def _combined(target, partner, comb, context, params) -> torch.Tensor:
    """r after `context`, from full forward passes of both models (no cache, no engine)."""
    ids = torch.tensor([context])
    return comb.probs(partner(input_ids=ids).logits[0, -1], target(input_ids=ids).logits[0, -1], params)


@pytest.mark.parametrize("comb", [ENSEMBLE, CONTRASTIVE], ids=["ensemble", "contrastive"])
def test_greedy_speculation_gives_token_by_token_output(target, partner, prompts, comb):
    """Greedy: every speculative variant (APF and naive, k = 1 and 4, batched) gives exactly the output of
    token-by-token collaborative decoding, which is the argmax of the combination computed from scratch."""
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    ref, base = _generate(target, partner, comb, prompts, params, k=0)
    for p, out in zip(prompts[:2], ref):
        ctx = list(p)
        for tok in out[:8]:
            assert tok == int(_combined(target, partner, comb, ctx, params).argmax())
            ctx.append(tok)
    # one padded prefill of the four prompts in each model, then one pass of each per token
    assert base.forward_passes == base.partner_passes == 1 + 20
    for k, alternate, batch in [(4, True, 4), (4, False, 4), (1, True, 1), (1, False, 2), (3, True, 2)]:
        out, engine = _generate(target, partner, comb, prompts, params, k, alternate, batch)
        assert out == ref, (k, alternate, batch)
        if k > 1:  # the speculation worked: fewer target passes than tokens
            assert sum(s["verify_steps"] for s in engine.stats) < 20 * len(prompts)


# each case over ~10 s on the 2-core CPU: make test-fast keeps the first, the others are slow
@pytest.mark.parametrize("comb,k,alternate", [
    pytest.param(ENSEMBLE, 1, True, id="ensemble-apf-k1"),
    pytest.param(CONTRASTIVE, 2, True, id="contrastive-apf-k2", marks=pytest.mark.slow),
    pytest.param(ENSEMBLE, 2, False, id="ensemble-naive-k2", marks=pytest.mark.slow)])
def test_sampling_follows_the_combined_distribution(target, partner, prompts, comb, k, alternate):
    """The first two tokens' joint distribution is the combination's (a chi-square test over every pair in its
    support); with k = 1 and APF the second token is often the target's bonus, checked by the partner."""
    prompt = prompts[1][:30]
    sp = dict(max_tokens=2, temperature=1.0, top_k=3, ignore_eos=True)
    n = 1200
    outs, engine = _generate(target, partner, comb, [prompt] * n, [SamplingParams(seed=i, **sp) for i in range(n)],
                             k, alternate, batch=16)
    params = SamplingParams(**sp)
    r1 = _combined(target, partner, comb, prompt, params)
    firsts = r1.nonzero().flatten().tolist()
    r2 = {a: _combined(target, partner, comb, prompt + [a], params) for a in firsts}
    cells = [(a, b) for a in firsts for b in r2[a].nonzero().flatten().tolist()]
    expected = np.array([float(r1[a] * r2[a][b]) for a, b in cells])
    observed = np.array([[tuple(o) for o in outs].count(c) for c in cells], dtype=float)
    assert observed.sum() == n  # nothing outside the combination's support
    assert chisquare(observed, expected / expected.sum() * n).pvalue > 1e-3
    # some cycles gave two tokens for one target pass: fewer decoding passes than token by token (2 a batch of 16)
    assert engine.forward_passes - engine.prefill_passes < 2 * math.ceil(n / 16)


def test_ensemble_acceptance_is_at_least_the_partners_weight(target, partner, prompts):
    """CoS Thm 3.2: with r = w q + (1 - w) p and the partner proposing from q, acceptance sum min(q, r) >= w."""
    params = SamplingParams(temperature=1.0)
    for w in (0.2, 0.5, 0.8):
        comb = Combination("ensemble", weight=w)
        with torch.no_grad():
            ids = torch.tensor([prompts[3]])
            ql, pl = partner(input_ids=ids).logits[0], target(input_ids=ids).logits[0]
        q = target_probs(ql, params)
        r = comb.probs(ql, pl, params)
        assert torch.allclose(r.sum(-1), torch.ones(len(r)), atol=1e-5)
        assert bool((torch.minimum(q, r).sum(-1) >= w - 1e-5).all())


def test_the_served_loop_runs_collaborative_decoding(target, partner, prompts, models):
    """Through the loop the verifier deployment runs (`verifier.collaboration`, speculation off), with continuous
    batching of more requests than slots: the same greedy outputs, and usage counts the partner's drafts."""
    cfg = AppConfig(verifier={"model": "target", "max_batch": 2, "max_len": 256,
                              "collaboration": {"partner": "drafter-literature", "combine": "contrastive",
                                                "mu": 0.1, "k": 4}},
                    speculation={"mode": "off"})
    engine = CollaborativeEngine(target, partner, CONTRASTIVE, k=cfg.verifier.collaboration.k, max_batch=2,
                                 max_len=256)
    assert isinstance(engine, VerifierEngine)  # the loop's written contract (engines/interface.py)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    res = asyncio.run(generate_all(build_loop(cfg, engine), prompts, [params] * len(prompts)))
    ref, _ = _generate(target, partner, CONTRASTIVE, prompts, params, k=0)
    assert [r.token_ids for r in res] == ref
    assert all(r.stats["num_draft_tokens"] > 0 and r.stats["num_accepted_tokens"] > 0 for r in res)
    # a request's own bound on drafting (the API's `speculation` field), mixed in one batch: speculation off is
    # token-by-token collaborative decoding, max_draft_tokens caps k; the output is the combination's either way
    mixed = [SpeculationOverrides(enabled=False), SpeculationOverrides(max_draft_tokens=1), None,
             SpeculationOverrides(max_draft_tokens=0)]
    engine = CollaborativeEngine(target, partner, CONTRASTIVE, k=4, max_batch=4, max_len=256)
    res = asyncio.run(generate_all(build_loop(cfg, engine), prompts, [params] * len(prompts), mixed))
    assert [r.token_ids for r in res] == ref
    assert [r.stats["verify_steps"] for r in (res[0], res[3])] == [16, 16]  # one target pass per token
    assert res[0].stats["num_draft_tokens"] == res[3].stats["num_draft_tokens"] == 0
    # at most one partner draft a cycle, and APF's bonus token checked by the partner
    assert res[1].stats["num_draft_tokens"] <= 2 * res[1].stats["verify_steps"] < 2 * 16
    assert res[2].stats["num_draft_tokens"] > res[1].stats["num_draft_tokens"]


def test_configuration_and_vocabulary_are_checked(target, models):
    collab = {"partner": "drafter-generic"}
    with pytest.raises(ValueError, match="torch"):
        AppConfig(verifier={"engine": "vllm", "model": "target", "collaboration": collab},
                  speculation={"mode": "off"})
    with pytest.raises(ValueError, match="speculation.mode: off"):
        AppConfig(verifier={"model": "target", "collaboration": collab},
                  drafters=[{"name": "generic", "model": "drafter-generic"}])
    with pytest.raises(ValueError, match="weight"):
        Combination("ensemble", weight=1.5)
    other = AutoModelForCausalLM.from_config(target.config.__class__(**{**target.config.to_dict(), "vocab_size": 100}))
    with pytest.raises(ValueError, match="one vocabulary"):
        CollaborativeEngine(target, other, ENSEMBLE)
