"""The speculation coordinator with real drafter engines and the verifier engine, in one process (no Ray)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from deployments.coordinator import SpeculationCoordinator
from deployments.drafter import DrafterServer
from deployments.engines.sampling import SamplingParams
from deployments.engines.verifier import TorchVerifierEngine
from deployments.routing import RoutingConfig
from model_family import DOMAINS
from model_family.distill import greedy_continue

NAMES = list(DOMAINS) + ["generic"]


@pytest.fixture(scope="module")
def servers(models):
    return {n: DrafterServer(n, str(models / f"drafter-{n}"), max_len=512) for n in NAMES}


async def _run(target, servers, prompts, fusion, fixed=None, fail=(), new_tokens=24, seed=0):
    emb = target.get_input_embeddings().weight.detach()
    coord = SpeculationCoordinator(NAMES, RoutingConfig(seed=seed), emb, fusion=fusion, fixed_drafters=fixed)

    async def step_fn(name, items):
        if name in fail:
            raise RuntimeError(f"drafter {name} is down")
        return servers[name].step(items)

    verifier = TorchVerifierEngine(target, max_batch=8, max_len=512)
    rids = [verifier.add_request(p, SamplingParams(max_tokens=new_tokens, ignore_eos=True)) for p in prompts]
    out = {r: [] for r in rids}
    while verifier.has_unfinished():
        verifier.admit()
        batch = [{"rid": r, "context": verifier.context(r), "k": 4} for r in verifier.running]
        drafts = await coord.draft(batch, step_fn, budget=8)
        for o in verifier.step(drafts):
            out[o.request_id] += o.new_token_ids
            if o.finished:
                for n in coord.release(o.request_id):
                    servers[n].release([o.request_id])
    return [out[r] for r in rids], coord, verifier


@pytest.fixture(scope="module")
def prompts(tokenizer, heldout):
    return [tokenizer(heldout[d][9], add_special_tokens=False).input_ids[:40] for d in DOMAINS]


@pytest.mark.parametrize("fusion", [True, False])
def test_routed_fused_speculation_is_lossless(target, servers, prompts, fusion):
    got, coord, _ = asyncio.run(_run(target, servers, prompts, fusion))
    want = [greedy_continue(target, torch.tensor([p]), 24)[0, len(p):].tolist() for p in prompts]
    assert got == want
    assert coord.stats["rounds"] > 0


def test_a_failing_drafter_loses_nothing(target, servers, prompts):
    got, coord, _ = asyncio.run(_run(target, servers, prompts[:3], True, fail=("code", "generic", "legal")))
    want = [greedy_continue(target, torch.tensor([p]), 24)[0, len(p):].tolist() for p in prompts[:3]]
    assert got == want and coord.stats["drafter_failures"] > 0


@pytest.mark.xfail(reason="cold-start routing by prompt likelihood misses the domain for drafters fine-tuned from "
                          "the generic one (fewer than 5 of 6 domains ranked first, measured); open work of the serving issue",
                   strict=False)
def test_cold_start_ranks_the_prompts_own_domain_first(target, servers, tokenizer, heldout):
    hits = 0
    for d in DOMAINS:
        coord = SpeculationCoordinator(NAMES, RoutingConfig(), None)
        ids = tokenizer(heldout[d][11], add_special_tokens=False).input_ids[:80]

        async def step_fn(name, items):
            return servers[name].step(items)

        asyncio.run(coord.draft([{"rid": f"cold-{d}", "context": ids, "k": 1}], step_fn))
        hits += coord.router.ranking(f"cold-{d}")[0] == d
        for n in coord.release(f"cold-{d}"):
            servers[n].release([f"cold-{d}"])
    assert hits >= 5
