"""The benchmark's handle on one system's worker process (benchmarks/workers.py is the worker side): it starts the
process, sends it one JSON request per line and reads each result, and stops it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import reap


class Worker:
    """One system in a process of its own (its log in `log_path`)."""

    def __init__(self, spec: dict, log_path: Path):
        self.log_path = log_path
        # its own temp dir, removed when it stops: vLLM's engine core leaves its rendezvous file (vllm_dist_*) there
        self.tmp = tempfile.mkdtemp(prefix="cosine-worker-")
        with open(log_path, "w") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "benchmarks.workers", "--worker", json.dumps(spec)],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
                                         cwd=Path(__file__).resolve().parent.parent,
                                         env=dict(os.environ, TMPDIR=self.tmp))
        try:
            self._wait("READY")
        except RuntimeError:  # it exited
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise

    def _wait(self, prefix: str) -> str:
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line[len(prefix):].strip()
        tail = "".join(self.log_path.read_text(errors="replace").splitlines(keepends=True)[-30:])
        raise RuntimeError(f"benchmark worker exited ({self.proc.wait()}); the end of its log ({self.log_path}):\n{tail}")

    def run(self, prompts, concurrency, max_tokens, domains, sampling: dict) -> dict:
        return self._ask({"prompts": prompts, "concurrency": concurrency, "max_tokens": max_tokens,
                          "domains": domains, "sampling": sampling})

    def forget_outputs(self) -> int:
        """The system forgets earlier requests' outputs (where it remembers them); how many it held."""
        return self._ask({"forget_outputs": True})["forgotten"]

    def _ask(self, request: dict) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return json.loads(self._wait("RESULT "))

    def stop(self) -> None:
        self.proc.stdin.close()
        reap(self.proc, 60, self.tmp)
