"""A real `cosine serve CONFIG` in a process of its own, as a user runs it, for the modules that test the command:
loopback ports of its own, Ray's files in a short temp dir of its own (Ray's socket paths live under it), its output
read by a thread, and on exit the process group and every Ray process it started killed and the dir removed, so a
failed test leaves nothing behind either."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil

from tests.conftest import _ROOT, free_port


class Output:
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


@dataclass
class Served:
    url: str
    port: int
    dashboard: str
    proc: subprocess.Popen
    output: Output
    ray_tmp: str
    descendants: list[psutil.Process]  # Ray's processes once it was ready


@contextmanager
def cosine_serve(config: Path, *args: str, ready_s: float = 420) -> Iterator[Served]:
    """`cosine serve config *args` until it prints that it is ready (its API key from the config, not from this
    process's environment)."""
    port, dash = free_port(), free_port()
    ray_tmp = tempfile.mkdtemp(prefix="cs-", dir=_ROOT)
    env = dict(os.environ, RAY_TMPDIR=ray_tmp, PYTHONUNBUFFERED="1")
    env.pop("COSINE_API_KEY", None)
    cosine = str(Path(sys.executable).with_name("cosine"))
    proc = subprocess.Popen([cosine, "serve", str(config), *args, "--port", str(port), "--dashboard-port", str(dash)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    descendants: list[psutil.Process] = []
    try:
        output = Output(proc)
        output.wait_for("Ctrl-C stops it.", ready_s)
        descendants = psutil.Process(proc.pid).children(recursive=True)
        yield Served(f"http://127.0.0.1:{port}", port, f"http://127.0.0.1:{dash}", proc, output, ray_tmp,
                     descendants)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for p in descendants:
            if p.is_running():
                p.kill()
        shutil.rmtree(ray_tmp, ignore_errors=True)
