"""The graph on one machine, served for real: `speculation.drafting_tier: auto`, whose graph builds both tiers (the
Speculation and drafter deployments, and the coordinator and drafters inside the verifier's replica), with an API
key. One server for the three concerns below, because each graph's start costs the suite half a minute.

- The tier: the verifier's chooser (speculation/tiers.py) measures each tier's rounds and drafts on the one that
  predicts more goodput. On one machine the remote tier is the same drafters on the same cores plus a hop through
  Ray each round, so colocated must win, as the simulator and the in-process test find.
- Colocated drafting (the one-machine layout): greedy output over HTTP, streamed or not, alone or concurrent, is
  target-only greedy decoding token for token, with drafts verified, while rounds move between the tiers. That
  `drafting_tier: colocated` builds no Speculation or drafter deployment: tests/test_tiers.py.
- The API key: the ingress's app is built in its replica (Serve's late-bound ingress), so the key and the model name
  a config gives reach the app that answers. (They once reached only a copy: the module-level app Serve pickled
  answered without a key; tests/test_ingress_auth.py, without Serve, could not see it.)
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from openai import AuthenticationError, OpenAI

from model_family import DOMAINS
from model_family.distill import greedy_continue
from speculation.tiers import COLOCATED, REMOTE, WARMUP

pytestmark = pytest.mark.slow

MODEL, KEY = "cosine-keyed", "s3cret"
AUTH = {"authorization": f"Bearer {KEY}"}
DOMAINS_SERVED = ("code", "legal", "biomedical")


@pytest.fixture(scope="module")
def server():
    from tests.conftest import local_serve, one_machine_app

    cfg = one_machine_app("auto", DOMAINS_SERVED, draft_timeout_ms=5000, model_name=MODEL)
    cfg["ingress"]["api_key"] = KEY
    with local_serve(cfg) as url:
        yield url


def _complete(server: str, ids: list[int], n: int, **extra) -> httpx.Response:
    body = {"model": MODEL, "prompt": ids, "max_tokens": n, "temperature": 0, "ignore_eos": True, **extra}
    return httpx.post(f"{server}/v1/completions", json=body, headers=AUTH, timeout=180)


def _want(target, tokenizer, ids: list[int], n: int) -> str:
    return tokenizer.decode(greedy_continue(target, torch.tensor([ids]), n)[0, len(ids):].tolist(),
                            skip_special_tokens=True)


def test_auto_builds_both_tiers_chooses_colocated_here_and_stays_lossless(server, tokenizer, target, heldout):
    from ray import serve

    deployments = set(serve.status().applications["cosine"].deployments)
    assert {"Ingress", "Verifier", "Speculation"} <= deployments, deployments
    assert {f"Drafter-{d}" for d in DOMAINS_SERVED} <= deployments, deployments
    for d in DOMAINS_SERVED:
        for i in (3, 9):
            ids = tokenizer(heldout[d][i][:200], add_special_tokens=False).input_ids
            r = _complete(server, ids, 24)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == _want(target, tokenizer, ids, 24), (d, i)
    stats = httpx.get(f"{server}/v1/internal/speculation_stats", headers=AUTH, timeout=30).json()
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


def test_colocated_drafting_streamed_and_not_is_target_only_greedy(server, tokenizer, target, heldout):
    before = httpx.get(f"{server}/v1/internal/speculation_stats", headers=AUTH, timeout=30).json()
    for d in DOMAINS:
        ids = tokenizer(heldout[d][12][:300], add_special_tokens=False).input_ids
        want = _want(target, tokenizer, ids, 20)
        r = _complete(server, ids, 20)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want, d
        assert r.json()["usage"]["num_drafts"] > 0
        body = {"model": MODEL, "prompt": ids, "max_tokens": 20, "temperature": 0, "ignore_eos": True,
                "stream": True}
        pieces = []
        with httpx.stream("POST", f"{server}/v1/completions", json=body, headers=AUTH, timeout=180) as s:
            for line in s.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    pieces += [c["text"] for c in json.loads(line[6:])["choices"]]
        assert "".join(pieces) == want, d
    after = httpx.get(f"{server}/v1/internal/speculation_stats", headers=AUTH, timeout=30).json()
    # these requests drafted on the chosen tier: inside this replica, on its CPU
    assert after["drafting_tier"]["chosen"] == COLOCATED
    assert after[COLOCATED]["rounds"] > before[COLOCATED]["rounds"]
    assert after["controller"]["drafting_overlaps_verification"] is False


def test_concurrent_requests_stay_lossless(server, tokenizer, target, heldout):
    prompts = [tokenizer(heldout[d][15][:200], add_special_tokens=False).input_ids for d in DOMAINS]
    with ThreadPoolExecutor(len(prompts)) as pool:
        replies = list(pool.map(lambda ids: _complete(server, ids, 16), prompts))
    for ids, r in zip(prompts, replies):
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == _want(target, tokenizer, ids, 16)
    stats = httpx.get(f"{server}/v1/internal/speculation_stats", headers=AUTH, timeout=30).json()
    assert stats[COLOCATED]["drafter_failures"] == 0 and stats[REMOTE]["drafter_failures"] == 0


def test_the_configured_key_is_required_and_open_paths_stay_open(server):
    assert httpx.get(f"{server}/v1/models", timeout=30).status_code == 401
    with pytest.raises(AuthenticationError):
        OpenAI(base_url=f"{server}/v1", api_key="wrong", timeout=60).models.list()
    assert httpx.get(f"{server}/health", timeout=30).json() == {"status": "ok"}
    reply = OpenAI(base_url=f"{server}/v1", api_key=KEY, timeout=120).completions.create(
        model=MODEL, prompt="def parse(path):", max_tokens=4, temperature=0)
    assert reply.usage.completion_tokens == 4


def test_the_openapi_document_describes_this_server(server):
    spec = httpx.get(f"{server}/openapi.json", headers=AUTH, timeout=30).json()
    assert {"/v1/chat/completions", "/v1/completions", "/tokenize", "/health"} <= set(spec["paths"])
    assert spec["components"]["schemas"]["CompletionRequest"]["properties"]["model"]["enum"] == [MODEL]
