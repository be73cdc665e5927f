"""The OpenAI server inside the verifier's replica (`ingress.in_verifier`): one deployment answers HTTP and verifies,
streamed and whole answers are the target's, a client hanging up aborts its request there, and the graph has no
Ingress deployment. The small target on the torch engine, one colocated drafter (the layout is what is tested)."""

from __future__ import annotations

import httpx
import pytest
import torch

from model_family.distill import greedy_continue
from tests.conftest import wait_until

pytestmark = pytest.mark.slow

MODEL = "cosine-in-verifier"


def app_args() -> dict:
    return {"ingress": {"model_name": MODEL, "in_verifier": True},
            "verifier": {"model": "target", "max_batch": 4, "max_len": 512},
            # drafts every step (fixed k, no guard, no wait relative to the verify step): the tiny target is cheap
            # enough that the goodput controller would rightly leave speculation to its probes, and on a busy machine
            # a round may outlast twice its few-ms verify step (its drafts then dropped)
            "speculation": {"mode": "cosine", "k": 4, "adaptive": False, "drafting_tier": "colocated",
                            "draft_timeout_ms": 10000, "guard": {"enabled": False}},
            "drafters": [{"name": "generic", "model": "drafter-generic", "generalist": True}]}


@pytest.fixture(scope="module")
def server():
    from tests.conftest import local_serve

    with local_serve(app_args()) as url:
        yield url


def _verifier():
    from ray import serve

    return serve.get_deployment_handle("Verifier", app_name="cosine")


def test_one_deployment_answers_and_its_answers_are_the_targets(server, target, tokenizer, heldout):
    from openai import OpenAI
    from ray import serve

    assert set(serve.status().applications["cosine"].deployments) == {"Verifier"}
    client = OpenAI(base_url=f"{server}/v1", api_key="unused", timeout=120)
    for d in ("code", "legal"):
        ids = tokenizer(heldout[d][3], add_special_tokens=False).input_ids[:40]
        want = greedy_continue(target, torch.tensor([ids]), 32)[0, len(ids):].tolist()
        whole = client.completions.create(model=MODEL, prompt=ids, max_tokens=32, temperature=0,
                                          extra_body={"ignore_eos": True, "return_token_ids": True})
        assert whole.choices[0].model_extra["token_ids"] == want, d
        assert whole.usage.model_extra["num_drafts"] > 0, whole.usage  # the colocated drafter drafted for it
        streamed = client.completions.create(model=MODEL, prompt=ids, max_tokens=32, temperature=0, stream=True,
                                             extra_body={"ignore_eos": True, "return_token_ids": True})
        assert [t for c in streamed for ch in c.choices for t in (ch.model_extra.get("token_ids") or [])] \
            == want, d
    assert httpx.get(f"{server}/health", timeout=30).json() == {"status": "ok"}
    metrics = httpx.get(f"{server}/metrics", timeout=30)
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")


def test_a_client_hanging_up_aborts_its_request_in_the_verifier(server):
    before = _verifier().speculation_stats.remote().result()["requests_aborted"]
    body = {"model": MODEL, "prompt": "The court held that", "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=120) as r:
        chunks = 0
        for line in r.iter_lines():
            chunks += line.startswith("data: ")
            if chunks >= 3:
                break  # hang up mid-generation
    assert wait_until(lambda: _verifier().speculation_stats.remote().result()["requests_aborted"] == before + 1)
    assert _verifier().running.remote().result() == 0
    ok = httpx.post(f"{server}/v1/completions", json=dict(body, max_tokens=4, stream=False), timeout=120)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4


def test_the_benchmarks_read_the_served_drafting_rounds_as_the_in_process_rows_do(server, tokenizer, heldout):
    """`cosine bench anchors`' served rows: the drafting tier's rounds in the verifier's replica (colocated), their
    seconds, the drafter forwards and the requests' participations, differenced around the run."""
    from benchmarks.common import served_speculation, stream_completions

    prompts = [tokenizer(heldout[d][5], add_special_tokens=False).input_ids[:40] for d in ("code", "dialogue")]
    before = _verifier().speculation_stats.remote().result()
    run = stream_completions(server, MODEL, prompts, 2, 24)
    got = served_speculation(before, _verifier().speculation_stats.remote().result())
    assert run["draft_tokens"] > 0 and got["draft_rounds"] > 0 and 0 < got["draft_forward_s"] <= got["draft_s"]
    # one drafter: a forward per depth of a round (k = 4, batched over the requests), with the prompts' prefills
    # and the catch-ups of committed tokens
    assert got["draft_rounds"] <= got["drafter_forwards"] <= 5 * got["draft_rounds"] + len(prompts)
    assert sum(got["by_participation"].values()) >= got["draft_rounds"]  # each round drafts for 1-2 requests
    assert "drafted_step_share" not in got  # no guard in this graph
