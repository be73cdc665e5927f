"""End to end over HTTP against the real Ray Serve application (tests/served/conftest.py's graph): greedy output
through the whole graph must equal target-only greedy decoding token for token (which tests/test_vllm_verifier.py
checks is also vLLM's own target-only output)."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from model_family import DOMAINS
from model_family.distill import greedy_continue
from tests.conftest import wait_until
from tests.served.conftest import METRICS, MODEL, SERVED_DOMAINS

pytestmark = pytest.mark.slow


def _chat(server, content, **kw):
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 24,
            "temperature": 0, **kw}
    return httpx.post(f"{server}/v1/chat/completions", json=body, timeout=120)


def test_health_and_models(server):
    assert httpx.get(f"{server}/health", timeout=30).json()["status"] == "ok"
    models = httpx.get(f"{server}/v1/models", timeout=30).json()
    assert models["data"][0]["id"] == MODEL


def test_greedy_through_the_graph_equals_target_only(server, tokenizer, target, heldout):
    from openai import OpenAI

    client = OpenAI(base_url=f"{server}/v1", api_key="unused", timeout=120)
    accepted = []
    for d in SERVED_DOMAINS:
        prompt = heldout[d][7][:300]
        ids = tokenizer(prompt, add_special_tokens=False).input_ids
        out = client.completions.create(model=MODEL, prompt=ids, max_tokens=24, temperature=0)
        want = greedy_continue(target, torch.tensor([ids]), 24)[0, len(ids):].tolist()
        # the completion stops early at EOS; compare the text the target would produce up to there
        eos = {0, 2}
        cut = next((i for i, t in enumerate(want) if t in eos), len(want))
        assert out.choices[0].text == tokenizer.decode(want[:cut], skip_special_tokens=True), d
        assert out.usage.completion_tokens == cut
        accepted.append(out.usage.model_extra["mean_acceptance_length"])
    # the domain drafters' is ~3-5 here; speculation silently off gives 1.0 everywhere. The median, not every
    # request: the first requests after a fresh start meet cold drafters, whose late rounds are decoded plainly
    assert sorted(accepted)[len(accepted) // 2] > 1.5, accepted


@pytest.mark.parametrize("override", [{"drafters_per_request": 3}, {"lockstep": False}, {"drafters": ["legal"]},
                                      {"drafters_per_request": 2, "lockstep": True},
                                      {"drafters_per_request": 2, "lockstep": False},
                                      {"mode": "vote"}, {"mode": "vote", "drafters": ["legal", "generic", "code"]}])
def test_speculation_overrides_stay_lossless(server, tokenizer, target, heldout, override):
    ids = tokenizer(heldout["legal"][11][:300], add_special_tokens=False).input_ids
    r = httpx.post(f"{server}/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 20, "temperature": 0,
                                                      "ignore_eos": True, "speculation": override}, timeout=120)
    assert r.status_code == 200, r.text
    want = greedy_continue(target, torch.tensor([ids]), 20)[0, len(ids):].tolist()
    body = r.json()
    assert body["choices"][0]["text"] == tokenizer.decode(want, skip_special_tokens=True)
    assert body["usage"]["num_drafts"] > 0


def test_the_controller_reports_its_modes_and_that_drafters_share_this_cpu(server, tokenizer, heldout):
    c = httpx.get(f"{server}/v1/internal/speculation_stats", timeout=30).json()["controller"]
    # one machine, every drafter on the verifier's CPU: drafting takes its cycles from verification
    assert c["drafting_overlaps_verification"] is False
    voters = f"{len(SERVED_DOMAINS) + 1} vote"  # every drafter
    assert {"2 lockstep", "2 one-shot", voters, "3 vote"} <= set(c["acceptance_by_participation"])  # the overrides
    assert c["participation"] in {"1", "2 lockstep", "2 one-shot"}  # a request's vote is never the controller's pick
    # weights move where voters' chains fare differently against what the target commits: where every voter agrees
    # (the override tests' one legal prompt, all of them answering in time) they stay equal, so vote on prompts of
    # every domain, whose drafters disagree, until they move (bounded)
    for d in DOMAINS:
        weights = httpx.get(f"{server}/v1/internal/speculation_stats", timeout=30).json()["vote_weights"]
        if max(weights.values()) > 1.05 * min(weights.values()):
            break
        ids = tokenizer(heldout[d][11][:300], add_special_tokens=False).input_ids
        r = httpx.post(f"{server}/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": ids, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
            "speculation": {"mode": "vote"}})
        assert r.status_code == 200, r.text
    assert set(weights) == {*SERVED_DOMAINS, "generic"}
    assert all(0.02 <= w <= 0.6 for w in weights.values())  # vote.min_weight, vote.max_weight
    assert max(weights.values()) > 1.05 * min(weights.values())  # the vote requests moved them off equal


def test_chat_non_streamed_and_streamed_agree(server):
    plain = _chat(server, "Tell me about the law.").json()
    text = plain["choices"][0]["message"]["content"]
    assert plain["object"] == "chat.completion" and plain["usage"]["completion_tokens"] > 0
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me about the law."}],
            "max_tokens": 24, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    pieces, usage, done = [], None, False
    with httpx.stream("POST", f"{server}/v1/chat/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk["choices"]:
                pieces.append(c["delta"].get("content", ""))
    assert done and "".join(pieces) == text
    assert usage["completion_tokens"] == plain["usage"]["completion_tokens"]
    assert "draft_acceptance_rate" in usage


def test_the_benchmarks_streaming_client_reads_the_targets_tokens_their_arrivals_and_the_drafts(server, tokenizer,
                                                                                                 target, heldout):
    """`cosine bench anchors`' served rows: every request streamed, its token ids and chunk arrivals read."""
    from benchmarks.common import served_speculation, stream_completions

    prompts = [tokenizer(heldout[d][9][:300], add_special_tokens=False).input_ids
               for d in ("code", "legal", "dialogue")]
    before = httpx.get(f"{server}/v1/internal/speculation_stats", timeout=30).json()
    run = stream_completions(server, MODEL, prompts, 2, 24)
    after = httpx.get(f"{server}/v1/internal/speculation_stats", timeout=30).json()
    for ids, text, p, lat in zip(run["outputs"], run["texts"], prompts, run["latency"]):
        assert ids == greedy_continue(target, torch.tensor([p]), 24)[0, len(p):].tolist()  # ignore_eos: all 24
        assert text == tokenizer.decode(ids, skip_special_tokens=True)
        assert 0 < lat["ttft_s"] and all(x >= 0 for x in lat["itl_s"])
    # a chunk per verify step: accepted drafts put several tokens in one
    assert run["drafts"] > 0 and run["accepted"] > 0
    assert min(len(lat["itl_s"]) for lat in run["latency"]) < 23
    assert run["wall"] >= max(run["seconds"])
    # the run's verify steps, and those with drafts, as the server counted them: each request's usage counts the
    # steps it took part in, two requests at a time (a prompt's prefill step counted there at most)
    steps = after["steps_since_start"] - before["steps_since_start"]
    drafted = after["drafted_steps_since_start"] - before["drafted_steps_since_start"]
    assert 0 < drafted <= steps and run["steps"] / 2 <= steps <= run["steps"] + len(prompts)
    # no guard in this graph (conftest.py), and its drafting tier is deployments of their own
    assert served_speculation(before, after) == {}


@pytest.mark.parametrize("body,status,needle", [
    ("{not json", 400, "JSON"),
    ({"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}, 404, "does not exist"),
    ({"model": MODEL, "messages": []}, 400, "messages"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100000}, 400, "context"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 2, "temperature": 0}, 400, "n"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "word " * 2000}]}, 400, "context"),
    # what a hostile or careless client sent before (each was a 500, or silently ignored)
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "seed": 2**70}, 400, "seed"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": 123}]}]}, 400, "content"),
    ('{"model": "x", "messages": ' + "[" * 100000 + "]" * 100000 + "}", 400, "nested"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}, 400,
     "max_completion_tokens"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": True}, 400, "max_tokens"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": [False]}, 400, "max_tokens"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logit_bias": {"5": 1}}, 400,
     "not supported"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
      "temperature": "hot"}, 400, "temperature"),
])
def test_bad_requests_get_openai_errors(server, body, status, needle):
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(f"{server}/v1/chat/completions", content=content,
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == status
    err = r.json()["error"]
    assert needle in err["message"] and err["type"]
    assert _chat(server, "still serving?").status_code == 200


def test_unknown_paths_health_and_vllm_metrics(server):
    r = httpx.get(f"{server}/v1/nothing", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    assert httpx.get(f"{server}/health", timeout=30).json() == {"status": "ok"}
    assert _chat(server, "count the drafts").status_code == 200
    text = httpx.get(f"{server}/metrics", timeout=30).text
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if not line.startswith("#")}
    drafts = values[f'vllm:spec_decode_num_drafts_total{{model_name="{MODEL}"}}']
    accepted = values[f'vllm:spec_decode_num_accepted_tokens_total{{model_name="{MODEL}"}}']
    per_pos = [v for k, v in values.items() if "per_pos" in k]
    assert drafts > 0 and sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)


def test_a_huge_body_is_refused_without_stalling_others(server):
    """A 20 MB body gets 413 before it is read whole, and short requests sent meanwhile are answered as usual."""
    import threading
    import time

    t = time.time()
    assert _chat(server, "baseline", max_tokens=4).status_code == 200
    baseline = time.time() - t
    big = {}

    def send_big():
        big["r"] = httpx.post(f"{server}/v1/chat/completions", content=b'{"model": "' + b"x" * (20 << 20) + b'"}',
                              headers={"content-type": "application/json"}, timeout=120)

    sender = threading.Thread(target=send_big)
    sender.start()
    times = []
    for _ in range(3):
        t = time.time()
        assert _chat(server, "meanwhile", max_tokens=4).status_code == 200
        times.append(time.time() - t)
    sender.join()
    assert big["r"].status_code == 413 and big["r"].json()["error"]["code"] == "request_too_large"
    assert max(times) < 10 * baseline + 2.0, (baseline, times)


def _handle(name):
    from ray import serve

    return serve.get_deployment_handle(name, app_name="cosine")


def _aborted() -> int:
    return _handle("Verifier").speculation_stats.remote().result()["requests_aborted"]


def test_client_disconnect_cancels_and_releases_caches(server):
    before = _aborted()
    body = {"model": MODEL, "prompt": "The court held that", "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=120) as r:
        chunks = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                chunks += 1
            if chunks >= 3:
                break  # hang up mid-generation
    assert wait_until(lambda: _aborted() == before + 1)  # counted once the loop has aborted it in the engine
    assert _handle("Verifier").running.remote().result() == 0
    names = list(SERVED_DOMAINS) + ["generic"]
    assert wait_until(lambda: all(_handle(f"Drafter-{n}").num_requests.remote().result() == 0 for n in names))


def test_client_hanging_up_on_a_non_streamed_request_frees_it_everywhere(server):
    """A non-streamed request is one `complete` call to the verifier; a client that gives up waiting cancels it
    there too (the loop aborts it in the engine and the drafters drop its caches), and the server goes on. The
    client is a raw socket, closed once the verifier is generating: a client-side timeout would race the
    generation (480 tokens take a few seconds here, less on a faster machine)."""
    import json
    import socket
    from urllib.parse import urlsplit

    url = urlsplit(server)
    body = json.dumps({"model": MODEL, "prompt": "The patient presented with", "max_tokens": 480,
                       "temperature": 0, "ignore_eos": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    before = _aborted()
    with socket.create_connection((url.hostname, url.port), timeout=30) as sock:
        sock.sendall(head + body)
        assert wait_until(lambda: _handle("Verifier").running.remote().result() == 1, timeout=30)  # generating
    # hung up before the 480 tokens are done: the loop aborts the request rather than finishing it
    assert wait_until(lambda: _aborted() == before + 1)  # counted once the loop has aborted it in the engine
    assert _handle("Verifier").running.remote().result() == 0
    names = list(SERVED_DOMAINS) + ["generic"]
    assert wait_until(lambda: all(_handle(f"Drafter-{n}").num_requests.remote().result() == 0 for n in names))
    assert _chat(server, "still serving?").status_code == 200


def test_routing_ranks_the_prompts_own_domain_first(server, tokenizer, heldout):
    """After 12 new tokens (cold start from prompt likelihoods, then verification feedback), eight prompts a domain."""
    hits = total = 0
    for d in SERVED_DOMAINS:
        for text in heldout[d][30:38]:
            ids = tokenizer(text, add_special_tokens=False).input_ids[:64]
            r = httpx.post(f"{server}/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 12,
                                                              "temperature": 0}, timeout=120)
            assert r.status_code == 200
            rid = r.json()["id"]
            history: dict = {}

            def released():  # the ranking is recorded when the coordinator releases the request, just after
                history.update(_handle("Speculation").routing_history.remote().result())
                return rid in history
            assert wait_until(released, timeout=30)
            total += 1
            hits += history[rid][0] == d
    assert hits >= 0.8 * total, f"{hits}/{total}"


def _exported(port: int) -> dict[str, float]:
    """Ray's metrics agent's samples, summed over labels (drafters, replicas), by sample name without Ray's
    prefix."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            name = s.name.removeprefix("ray_")
            totals[name] = totals.get(name, 0.0) + s.value
    return totals


def test_our_metrics_and_vllms_reach_prometheus(server):
    """Ray's metrics agent exports ours and vLLM's own (its speculative-decoding counters for our drafts), and their
    values move as a request is served: verify steps by at least the request's own (16 tokens at most k + 1 = 5 a
    step: 4 steps or more), our drafts and vLLM's by at least one, vLLM's accepted draft tokens by at least the
    request's `usage.num_accepted_tokens`."""
    import time

    names = ("cosine_verify_steps_total", "cosine_drafts_total", "vllm_spec_decode_num_drafts_total",
             "vllm_spec_decode_num_accepted_tokens_total")
    before = _exported(METRICS["port"])
    r = httpx.post(f"{server}/v1/completions", timeout=120, json={"model": MODEL, "prompt": "def main():",
                                                                   "max_tokens": 16, "temperature": 0,
                                                                   "ignore_eos": True})
    usage = r.json()["usage"]
    assert usage["completion_tokens"] == 16
    least = {"cosine_verify_steps_total": 4, "cosine_drafts_total": 1, "vllm_spec_decode_num_drafts_total": 1,
             "vllm_spec_decode_num_accepted_tokens_total": usage["num_accepted_tokens"]}
    moved, deadline = {}, time.time() + 90
    while time.time() < deadline:  # the agent exports what replicas reported in its last interval
        now = _exported(METRICS["port"])
        moved = {n: now.get(n, 0.0) - before.get(n, 0.0) for n in names}
        if all(moved[n] >= least[n] for n in names):
            break
        time.sleep(3)
    assert all(moved[n] >= least[n] for n in names), (moved, least)


def test_schemathesis_finds_no_server_error_and_every_response_matches_the_schema(server, tmp_path):
    """The OpenAPI document is precise enough for a fuzzer: schemathesis generates valid and invalid requests from
    it for every operation (bounded in examples and time); no 5xx, every status and body as documented, invalid
    data rejected, the server still serving after."""
    import subprocess
    import sys
    from pathlib import Path

    st = str(Path(sys.executable).with_name("st"))
    run = subprocess.run(
        [st, "run", f"{server}/openapi.json", "--checks", "not_a_server_error,status_code_conformance,"
         "content_type_conformance,response_schema_conformance,negative_data_rejection", "--max-examples", "8",
         "--max-time", "25", "--workers", "1", "--request-timeout", "60", "--seed", "0",
         "--report", "junit", "--report-dir", str(tmp_path), "--generation-database", "none"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-4000:]
    assert "operations" in run.stdout.lower() or "tested" in run.stdout.lower()
    assert _chat(server, "still serving?").status_code == 200


def test_a_real_prometheus_scrapes_the_graph_evaluates_the_alerts_and_answers_the_dashboard(server, tmp_path):
    """Debian's prometheus on a free loopback port scrapes Ray's metrics agent and the ingress's /metrics, loads
    ops/prometheus/alerts.yml and answers every query of the Grafana dashboard."""
    import shutil
    import subprocess
    import time

    import yaml

    from tests.conftest import free_port
    from tests.test_ops_rules import RULES, dashboard_queries

    port = free_port()
    host = server.removeprefix("http://")
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump({
        # a scrape's timeout is its interval at most: Ray's agent can take over a second to answer on a busy 2-core
        # machine, and a failed scrape marks every series of it stale, so an instant query of a gauge finds nothing
        "global": {"scrape_interval": "4s", "scrape_timeout": "4s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [
            {"job_name": "ray", "static_configs": [{"targets": [f"127.0.0.1:{METRICS['port']}"]}]},
            {"job_name": "cosine-ingress", "metrics_path": "/metrics", "static_configs": [{"targets": [host]}]}]}))
    proc = subprocess.Popen([shutil.which("prometheus"), f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    api = f"http://127.0.0.1:{port}/api/v1"

    def query(q: str) -> dict:
        return httpx.get(f"{api}/query", params={"query": q}, timeout=30).json()

    try:
        for _ in range(3):
            assert _chat(server, "Tell me about the law.").status_code == 200
        wanted = ["ray_cosine_drafts_total", "ray_cosine_verify_steps_total", "ray_cosine_draft_length_count",
                  "ray_vllm_spec_decode_num_accepted_tokens_total", "ray_serve_deployment_replica_healthy",
                  'vllm:spec_decode_num_drafts_total{job="cosine-ingress"}']
        missing, deadline = wanted, time.time() + 120
        while missing and time.time() < deadline:
            time.sleep(2)
            try:
                missing = [w for w in wanted if not query(w).get("data", {}).get("result")]
            except httpx.HTTPError:  # not listening yet
                pass
        assert not missing, missing
        drafted = query('sum(vllm:spec_decode_num_draft_tokens_total{job="cosine-ingress"})')["data"]["result"]
        assert float(drafted[0]["value"][1]) > 0
        rules = httpx.get(f"{api}/rules", timeout=30).json()["data"]["groups"][0]["rules"]
        assert len(rules) == 5 and all(r["health"] == "ok" for r in rules), rules  # evaluated without error
        # every panel has data, but those of events this run has none of (failures, fallbacks, alerts) or of parts it
        # does not deploy (the drafter autoscaler and its retirement of domain drafters)
        quiet = ("drafter_failures", "draft_fallbacks", "ALERTS", "autoscaler_target_replicas", "drafters_retired")
        panels = [q for q in dashboard_queries() if not any(w in q for w in quiet)]
        assert len(panels) >= 14
        empty, deadline = panels, time.time() + 120
        while empty and time.time() < deadline:
            results = {q: query(q) for q in empty}
            assert all(r["status"] == "success" for r in results.values()), results
            empty = [q for q, r in results.items() if not r["data"]["result"]]
            time.sleep(2 if empty else 0)
        targets = httpx.get(f"{api}/targets", timeout=30).json()["data"]["activeTargets"]
        assert not empty, (empty, [(t["labels"]["job"], t["health"], t["lastError"], t["lastScrapeDuration"])
                                   for t in targets])
        for q in dashboard_queries():
            assert query(q)["status"] == "success", q
    finally:
        proc.terminate()
        proc.wait(timeout=30)
