"""Fault and overload tests of the serving graph: a drafter replica killed mid-request, one that stops answering,
a verifier killed mid-stream, and overload (429)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import torch

from model_family.distill import greedy_continue
from tests.conftest import wait_until
from tests.served.conftest import MODEL

pytestmark = pytest.mark.slow


def _handle(name):
    from ray import serve

    return serve.get_deployment_handle(name, app_name="cosine")


def test_a_killed_drafter_does_not_break_the_request(server, tokenizer, target, heldout):
    import threading

    import ray

    ids = tokenizer(heldout["code"][40], add_special_tokens=False).input_ids[:48]
    body = {"model": MODEL, "prompt": ids, "max_tokens": 96, "temperature": 0, "ignore_eos": True,
            "speculation": {"drafters": ["code"], "lockstep": False}}
    result = {}
    t = threading.Thread(target=lambda: result.update(
        r=httpx.post(f"{server}/v1/completions", json=body, timeout=300)))
    t.start()
    # kill the replica once it holds the request's cache, i.e. mid-request (the state API needs the dashboard,
    # which the fixture does not start; named actors come from the GCS)
    assert wait_until(lambda: _handle("Drafter-code").num_requests.remote().result() > 0, 60, 0.05)
    replicas = [a for a in ray.util.list_named_actors(all_namespaces=True)
                if a["name"].startswith("SERVE_REPLICA::cosine#Drafter-code#")]
    assert len(replicas) == 1
    ray.kill(ray.get_actor(replicas[0]["name"], namespace=replicas[0]["namespace"]), no_restart=False)
    assert t.is_alive(), "the request finished before the drafter was killed"
    t.join(300)
    r = result["r"]
    assert r.status_code == 200, r.text
    want = greedy_continue(target, torch.tensor([ids]), 96)[0, len(ids):].tolist()
    assert r.json()["choices"][0]["text"] == tokenizer.decode(want, skip_special_tokens=True)
    # Serve brings the drafter back and speculation resumes
    def speculates():
        u = httpx.post(f"{server}/v1/completions", json=body, timeout=300).json()["usage"]
        return u["num_accepted_tokens"] > 0
    assert wait_until(speculates, timeout=120)


def test_a_stopped_drafter_sits_out_and_requests_finish_unchanged(server, tokenizer, target, heldout):
    """A drafter replica that stops answering (SIGSTOP: a wedged process, not a dead one, so Serve keeps routing to
    it): requests drafted by it alone and routed requests finish with the target's own output; after one late
    round it sits out (its calls are not made, the other drafters' drafts still count), and once it answers
    again it drafts again."""
    import concurrent.futures as cf
    import os
    import signal

    def stats() -> dict:
        return httpx.get(f"{server}/v1/internal/speculation_stats", timeout=60).json()

    prompts = [tokenizer(heldout["code"][i], add_special_tokens=False).input_ids[:48] for i in (41, 42)]
    wants = [greedy_continue(target, torch.tensor([p]), 64)[0, len(p):].tolist() for p in prompts]
    only_code = {"drafters": ["code"], "lockstep": False}
    bodies = [{"model": MODEL, "prompt": p, "max_tokens": 64, "temperature": 0, "ignore_eos": True, **extra}
              for p, extra in zip(prompts, ({"speculation": only_code}, {}))]
    pid = _handle("Drafter-code").placement.remote().result()["pid"]
    before = stats()
    # sitting out is read while the requests run: between pauses a retry call may be in flight, and a read after
    # the requests (slow on a busy machine) can fall there
    sat_out = threading.Event()
    done = threading.Event()

    def watch() -> None:
        while not done.is_set() and not sat_out.is_set():
            if "code" in stats()["drafters_sitting_out"]:
                sat_out.set()
            time.sleep(0.2)

    os.kill(pid, signal.SIGSTOP)
    try:
        with cf.ThreadPoolExecutor(3) as pool:
            watcher = pool.submit(watch)
            rs = list(pool.map(lambda b: httpx.post(f"{server}/v1/completions", json=b, timeout=300), bodies))
            after = stats()
            done.set()
            watcher.result()
    finally:
        done.set()
        os.kill(pid, signal.SIGCONT)
    for r, p, want in zip(rs, prompts, wants):
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == tokenizer.decode(want, skip_special_tokens=True)
    assert sat_out.is_set(), "the stopped drafter was never reported sitting out while the requests ran"
    # calls made to it while stopped: one per pause (1, 2, 4 ... s), not one per step: the request drafted by it
    # alone took 13 verify steps or more (64 tokens, at most k + 1 = 5 a step), almost none of which called it.
    # (Its own steps, not the coordinator's rounds: a round drafted ahead serves both requests, and the controller
    # may plan no draft for a request whose drafter sits out, so rounds can be fewer.)
    calls, steps = after["drafter_failures"] - before["drafter_failures"], rs[0].json()["usage"]["verify_steps"]
    assert 1 <= calls <= 4 and steps >= 13, (calls, steps)
    # the routed request was drafted for by the others while the stopped drafter sat out. How often is the
    # controller's call, not this test's: on a quiet machine the tiny target's 9 ms step leaves speculation to the
    # controller's probes (k = 2 every 8 rounds; seen: 7 drafts, 16 tokens, none accepted), on a busy one it pays.
    # (A round that waited for the stopped drafter prices nothing: priced, it held every request at k = 0.)
    assert rs[1].json()["usage"]["num_drafts"] > 0, rs[1].json()["usage"]

    def code_drafts() -> bool:
        u = httpx.post(f"{server}/v1/completions", json=bodies[0], timeout=300).json()["usage"]
        return u["num_accepted_tokens"] > 0
    assert wait_until(code_drafts, timeout=120)


def test_overload_gets_429_with_retry_after(server):
    import concurrent.futures as cf

    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 48, "temperature": 0, "ignore_eos": True}
    with cf.ThreadPoolExecutor(12) as pool:
        rs = list(pool.map(lambda _: httpx.post(f"{server}/v1/completions", json=body, timeout=300), range(12)))
    codes = sorted(r.status_code for r in rs)
    assert set(codes) <= {200, 429} and 429 in codes and 200 in codes
    limited = next(r for r in rs if r.status_code == 429)
    assert limited.headers["retry-after"] and limited.json()["error"]["type"] == "rate_limit_error"


def test_a_verifier_killed_mid_stream_ends_the_stream_cleanly_and_serving_resumes(server):
    """The client's 200 stream ends with an error event, a chunk with a finish_reason and [DONE], never a hang
    or a cut connection; once Serve has replaced the replica, new requests succeed."""
    import json
    import threading

    import ray

    body = {"model": MODEL, "prompt": "The history of the", "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": True}
    events: list = []
    started = threading.Event()

    def stream():
        with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=300) as r:
            events.append(r.status_code)
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    started.set()

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(120)
    verifiers = [a for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["name"].startswith("SERVE_REPLICA::cosine#Verifier#")]
    assert len(verifiers) == 1
    ray.kill(ray.get_actor(verifiers[0]["name"], namespace=verifiers[0]["namespace"]), no_restart=False)
    t.join(300)
    assert not t.is_alive()
    assert events[0] == 200 and events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[1:-1]]
    error = next(c for c in chunks if "error" in c)
    assert error["error"]["type"] == "server_error" and "Traceback" not in error["error"]["message"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "error"

    def serves() -> bool:
        try:
            r = httpx.post(f"{server}/v1/completions", timeout=60,
                           json={"model": MODEL, "prompt": "Hello", "max_tokens": 4, "temperature": 0})
            return r.status_code == 200
        except httpx.HTTPError:
            return False

    assert wait_until(serves, timeout=240, interval=2)
    assert httpx.get(f"{server}/health", timeout=30).status_code == 200
