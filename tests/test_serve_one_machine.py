"""`speculation.drafting_tier: auto` served for real: the graph builds both tiers (the Speculation and drafter
deployments, and the coordinator and drafters inside the verifier's replica), the verifier's chooser
(speculation/tiers.py) measures each tier's rounds and drafts on the one that predicts more goodput. On one machine
the remote tier is the same drafters on the same cores plus a hop through Ray each round, so colocated must win,
as the simulator and the in-process test find; greedy output over HTTP is target-only greedy decoding throughout,
while rounds move between the tiers."""

from __future__ import annotations

import httpx
import pytest
import torch

from model_family.distill import greedy_continue
from speculation.tiers import COLOCATED, REMOTE, WARMUP

pytestmark = pytest.mark.slow

MODEL = "cosine-target"
DOMAINS_SERVED = ("code", "legal", "biomedical")


@pytest.fixture(scope="module")
def server():
    from tests.conftest import local_serve, one_machine_app

    cfg = one_machine_app("auto", DOMAINS_SERVED, draft_timeout_ms=5000, model_name=MODEL)
    with local_serve(cfg) as url:
        yield url


def test_auto_builds_both_tiers_chooses_colocated_here_and_stays_lossless(server, tokenizer, target, heldout):
    from ray import serve

    deployments = set(serve.status().applications["cosine"].deployments)
    assert {"Ingress", "Verifier", "Speculation"} <= deployments, deployments
    assert {f"Drafter-{d}" for d in DOMAINS_SERVED} <= deployments, deployments
    for d in DOMAINS_SERVED:
        for i in (3, 9):
            ids = tokenizer(heldout[d][i][:200], add_special_tokens=False).input_ids
            want = greedy_continue(target, torch.tensor([ids]), 24)[0, len(ids):].tolist()
            body = {"model": MODEL, "prompt": ids, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
            r = httpx.post(f"{server}/v1/completions", json=body, timeout=180)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == tokenizer.decode(want, skip_special_tokens=True), (d, i)
    stats = httpx.get(f"{server}/v1/internal/speculation_stats", timeout=30).json()
    chooser = stats["drafting_tier"]
    # both tiers measured (the warm-up drafts on each in turn), then the colocated one chosen and drafting most
    assert chooser["measured"].get(REMOTE, 0) >= WARMUP and chooser["measured"].get(COLOCATED, 0) >= WARMUP, chooser
    assert chooser["chosen"] == COLOCATED, chooser
    assert chooser["rounds"][COLOCATED] > chooser["rounds"][REMOTE], chooser
    # chosen for what it predicts from the rounds measured on each tier at this load, not by default
    goodput = chooser["predicted"]["goodput"]
    assert goodput[COLOCATED] > goodput[REMOTE], chooser
    for tier in (COLOCATED, REMOTE):
        assert stats[tier]["rounds"] > 0 and stats[tier]["drafter_failures"] == 0, (tier, stats[tier])
