"""`cosine serve` (what `make run` runs): the endpoint comes up, answers what the banner says, and Ctrl-C leaves
no process behind."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest
import yaml
from openai import OpenAI

from tests.conftest import free_port

pytestmark = pytest.mark.slow



def _small_config(path: Path) -> Path:
    """examples/local.yaml with two drafters, to keep the suite quick."""
    from model_family.paths import REPO_ROOT

    cfg = yaml.safe_load((REPO_ROOT / "examples" / "local.yaml").read_text())
    args = cfg["applications"][0]["args"]
    args["drafters"] = [d for d in args["drafters"] if d["name"] in ("code", "generic")]
    args["verifier"]["max_len"] = 256
    path.write_text(yaml.safe_dump(cfg))
    return path


class _Output:
    """The process's output, read by a thread (select() on a buffered pipe misses lines already buffered)."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.lines = proc, []
        threading.Thread(target=lambda: self.lines.extend(iter(proc.stdout.readline, "")), daemon=True).start()

    def text(self) -> str:
        return "".join(self.lines)

    def wait_for(self, marker: str, timeout_s: float) -> str:
        deadline = time.time() + timeout_s
        while marker not in self.text():
            assert self.proc.poll() is None or marker in self.text(), f"exited early:\n{self.text()[-3000:]}"
            assert time.time() < deadline, f"no {marker!r} after {timeout_s} s:\n{self.text()[-3000:]}"
            time.sleep(0.5)
        return self.text()


def test_cosine_serve_comes_up_answers_and_stops_clean(tmp_path):
    port = free_port()
    ray_tmp = tempfile.mkdtemp(prefix="cs-")  # short: Ray's socket paths live under it
    env = dict(os.environ, RAY_TMPDIR=ray_tmp, PYTHONUNBUFFERED="1")
    cosine = str(Path(sys.executable).with_name("cosine"))
    proc = subprocess.Popen([cosine, "serve", str(_small_config(tmp_path / "local.yaml")), "--port", str(port),
                             "--dashboard-port", str(free_port())], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    descendants: list[psutil.Process] = []
    try:
        output = _Output(proc)
        out = output.wait_for("Ctrl-C stops it.", 420)
        base = f"http://127.0.0.1:{port}"
        assert f"{base}/v1" in out and "curl " in out and "OpenAI(base_url=" in out
        assert "Ray dashboard:      http://127.0.0.1:" in out
        descendants = psutil.Process(proc.pid).children(recursive=True)
        assert descendants, "Ray's processes should be running under cosine serve"
        # the replicas at the priority of Ray's own processes (Ray's default, nice 15, lost the verifier's cores to
        # them whenever they woke)
        replicas = {p.pid: p.nice() for p in descendants if "ServeReplica" in " ".join(p.cmdline())}
        assert replicas and set(replicas.values()) == {os.nice(0)}, replicas

        reply = OpenAI(base_url=f"{base}/v1", api_key="none").chat.completions.create(
            model="cosine-target", max_tokens=8, temperature=0, messages=[{"role": "user", "content": "Hello"}])
        assert reply.usage.completion_tokens > 0

        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
        assert proc.returncode == 0, output.text()[-3000:]
        assert "stopped" in output.wait_for("stopped", 10)
        _, alive = psutil.wait_procs(descendants, timeout=30)
        assert not alive, f"left behind: {[p.pid for p in alive]}"
        leftover = [p.pid for p in psutil.process_iter(["cmdline"]) if ray_tmp in " ".join(p.info["cmdline"] or [])]
        assert not leftover, f"processes still using {ray_tmp}: {leftover}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for p in descendants:  # a failed run must not leave Ray behind either
            if p.is_running():
                p.kill()
        shutil.rmtree(ray_tmp, ignore_errors=True)
