"""The one-machine layout (`speculation.drafting_tier: colocated`) served for real: the coordinator and every
drafter inside the verifier's replica, no Speculation or drafter deployments. Greedy output over HTTP must equal
target-only greedy decoding token for token, streamed or not, with drafts actually verified."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from model_family import DOMAINS
from model_family.distill import greedy_continue

pytestmark = pytest.mark.slow

MODEL = "cosine-target"


@pytest.fixture(scope="module")
def server():
    from tests.conftest import local_serve, one_machine_app

    cfg = one_machine_app("colocated", DOMAINS, draft_timeout_ms=2000, model_name=MODEL)
    with local_serve(cfg) as url:
        yield url


def test_the_graph_is_ingress_and_verifier_only(server):
    from ray import serve

    deployments = set(serve.status().applications["cosine"].deployments)
    assert deployments == {"Ingress", "Verifier"}, deployments


def test_greedy_equals_target_only_streamed_and_not_with_drafts(server, tokenizer, target, heldout):
    for d in DOMAINS:
        ids = tokenizer(heldout[d][9][:300], add_special_tokens=False).input_ids
        want = tokenizer.decode(greedy_continue(target, torch.tensor([ids]), 20)[0, len(ids):].tolist(),
                                skip_special_tokens=True)
        body = {"model": MODEL, "prompt": ids, "max_tokens": 20, "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"{server}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want, d
        assert r.json()["usage"]["num_drafts"] > 0
        pieces = []
        with httpx.stream("POST", f"{server}/v1/completions", json={**body, "stream": True}, timeout=120) as s:
            for line in s.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    pieces += [c["text"] for c in json.loads(line[6:])["choices"]]
        assert "".join(pieces) == want, d


def test_concurrent_requests_stay_lossless_and_stats_show_the_shared_cpu(server, tokenizer, target, heldout):
    from concurrent.futures import ThreadPoolExecutor

    prompts = [tokenizer(heldout[d][12][:200], add_special_tokens=False).input_ids for d in DOMAINS]

    def one(ids):
        r = httpx.post(f"{server}/v1/completions", timeout=120, json={"model": MODEL, "prompt": ids,
                                                                       "max_tokens": 16, "temperature": 0,
                                                                       "ignore_eos": True})
        return r.json()["choices"][0]["text"]

    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(one, prompts))
    for ids, text in zip(prompts, got):
        want = greedy_continue(target, torch.tensor([ids]), 16)[0, len(ids):].tolist()
        assert text == tokenizer.decode(want, skip_special_tokens=True)
    stats = httpx.get(f"{server}/v1/internal/speculation_stats", timeout=30).json()
    assert stats["controller"]["drafting_overlaps_verification"] is False  # the drafters share this replica's CPU
    assert stats["rounds"] > 0 and stats["drafter_failures"] == 0
