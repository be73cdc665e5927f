"""speculation.mode: single (speculation/strategies/single.py): one named drafter drafts every request, no routing."""

from __future__ import annotations

import asyncio

import pytest
import torch

from config import AppConfig, SpeculationSpec
from engines.sampling import SamplingParams
from engines.verifier import TorchVerifierEngine
from model_family.distill import greedy_continue
from speculation.coordinator import SpeculationCoordinator
from assembly.drafter_server import DrafterServer
from speculation.messages import DraftRequest, SpeculationOverrides
from speculation.planner import DraftPlanner

NAMES = ["code", "legal", "generic"]


def test_the_single_drafter_drafts_every_round_in_one_call_and_the_output_is_the_targets(target, models,
                                                                                           domain_prompt_ids):
    servers = {n: DrafterServer(n, str(models / f"drafter-{n}"), max_len=512) for n in NAMES}
    coord = SpeculationCoordinator(NAMES, speculation=SpeculationSpec(mode="single", drafter="legal"))
    calls = []

    async def step_fn(name, batch):
        calls.append((name, [c.score_context for c in batch]))
        return servers[name].step(batch).chains

    prompts = [domain_prompt_ids[d][0][:32] for d in ("code", "legal", "dialogue")]
    verifier = TorchVerifierEngine(target, max_batch=4, max_len=512)
    rids = [verifier.add_request(p, SamplingParams(max_tokens=16, ignore_eos=True)) for p in prompts]
    out, rounds, accepted = {r: [] for r in rids}, 0, 0
    while verifier.has_unfinished():
        verifier.admit()
        drafts = asyncio.run(coord.draft([DraftRequest(r, verifier.context(r), 4, budget=8)
                                          for r in verifier.running], step_fn)).drafts
        rounds += 1
        for o in verifier.step(drafts):
            out[o.request_id] += o.new_token_ids
            accepted += o.num_accepted_tokens
            if o.finished:
                for n in coord.release(o.request_id):
                    servers[n].release([o.request_id])
    want = [greedy_continue(target, torch.tensor([p]), 16)[0, len(p):].tolist() for p in prompts]
    assert [out[r] for r in rids] == want and accepted > 0
    # one call per round, to the named drafter, never to score a prompt
    assert [n for n, _ in calls] == ["legal"] * rounds and not any(any(s) for _, s in calls)
    assert coord.where == {}


def test_a_request_that_names_its_drafters_still_gets_them():
    coord = SpeculationCoordinator(NAMES, speculation=SpeculationSpec(mode="single", drafter="legal"))
    called = []

    async def step_fn(name, batch):
        called.append(name)
        return {}

    asyncio.run(coord.draft([DraftRequest("r", [1, 2, 3], 2, budget=4, drafters=["code"])], step_fn))
    assert called == ["code"]


def test_single_is_configured_with_a_known_drafter_and_drafts_one_chain():
    args = {"verifier": {"model": "target"}, "drafters": [{"name": n, "model": n} for n in NAMES]}
    cfg = AppConfig(**args, speculation={"mode": "single", "drafter": "legal", "adaptive": False,
                                                 "guard": {"enabled": False}})
    assert DraftPlanner(cfg).participation(SpeculationOverrides()).drafters_per_request == 1
    with pytest.raises(ValueError, match="speculation.drafter names unknown drafter 'nope'"):
        AppConfig(**args, speculation={"mode": "single", "drafter": "nope"})
