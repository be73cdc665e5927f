"""SpecRouter's multi-level chain: a drafter whose chains a smaller assistant drafts (engines/cascade.py)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from config import AppConfig
from engines.cascade import CascadeDrafterEngine
from engines.drafter import DrafterEngine
from engines.sampling import SamplingParams
from engines.verifier import TorchVerifierEngine
from model_family import DOMAINS
from model_family.distill import greedy_continue
from assembly.loop import build_loop, generate_all


@pytest.fixture(scope="module")
def prompts(tokenizer, heldout):
    return [tokenizer(heldout[d][4], add_special_tokens=False).input_ids[:30] for d in DOMAINS]


def _start(engine, rids, prompts):
    """What a drafter replica does before drafting a chain: the context, then its first proposal fed back."""
    for r, p in zip(rids, prompts):
        engine.sync(r, p)
    first = engine.step(rids)
    for r in rids:
        engine.feed(r, [first[r].token])
    return first


def test_a_cascade_drafts_the_drafters_own_chains_in_fewer_passes(models, prompts):
    plain = DrafterEngine(str(models / "target"), max_len=256)
    cascade = CascadeDrafterEngine(str(models / "target"), str(models / "drafter-code"), assistant_k=4, max_len=256)
    rids = [f"r{i}" for i in range(len(prompts))]
    ks = {r: 3 + i for i, r in enumerate(rids)}  # 3 to 8: one or several passes, a last partial one
    for round_ in range(2):
        _start(plain, rids, prompts)
        _start(cascade, rids, prompts)
        plain.forward_passes = cascade.forward_passes = 0
        want, got = plain.draft(rids, ks), cascade.draft(rids, ks)
        assert {r: [p.token for p in c] for r, c in got.items()} == {r: [p.token for p in c] for r, c in want.items()}
        for r in rids:
            assert [p.prob for p in got[r]] == pytest.approx([p.prob for p in want[r]], abs=1e-4)
        assert cascade.forward_passes < plain.forward_passes
        # the second round starts from the prompts again: the caches roll back to them
        prompts = [p[:-3] for p in prompts]
    assert 0 < cascade.assistant_accepted <= cascade.assistant_drafted
    for r in rids:
        cascade.release(r)
    assert not cascade.states and not cascade.assistant.states


def test_greedy_through_the_loop_with_a_cascade_drafter_equals_the_target(target, prompts):
    cfg = AppConfig(verifier={"model": "target", "max_batch": 4, "max_len": 256},
                    drafters=[{"name": "mid", "model": "target", "assistant": "drafter-code", "max_len": 256},
                              {"name": "code", "model": "drafter-code", "max_len": 256}],
                    speculation={"k": 6, "adaptive": False, "draft_timeout_ms": 600_000, "guard": {"enabled": False}})
    loop = build_loop(cfg, TorchVerifierEngine(target, max_batch=4, max_len=256))
    out = asyncio.run(generate_all(loop, prompts, [SamplingParams(max_tokens=24, ignore_eos=True)] * len(prompts)))
    want = [greedy_continue(target, torch.tensor([p]), 24)[0, len(p):].tolist() for p in prompts]
    assert [o.token_ids for o in out] == want
    assert sum(o.stats["num_accepted_tokens"] for o in out) > 0
