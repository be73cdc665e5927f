"""Starting a local Ray node on a busy machine.

Ray gives a new node's raylet a fixed 30 s to register with the GCS (`ray._private.node.Node.__init__`, not
configurable) and then raises, leaving every process it started (GCS, raylet, dashboard, agents) running until the
driver exits. On a loaded 2-core machine that registration can take longer. `start_with_retry` runs a start
(`ray.init` or a `ray.cluster_utils.Cluster`) again after that failure, having first stopped, by PID, the processes
the failed attempt started. It does the same where the dashboard process died as it started: once in a fresh-clone
test run (2026-12-01) it aborted (return code -6) before writing a line of its log, and the next start of the same
test module had worked in every other run; a dashboard that cannot start at all still fails, on the last attempt.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import psutil

T = TypeVar("T")

# What Ray's Node raises when the raylet does not register in time; tests/test_ray_start.py fails if Ray's source
# stops saying it.
STARTUP_TIMEOUT = "timed out during startup"
# The function of `ray._private.services` that starts the dashboard and raises when its process dies; a failure
# raised inside it is the dashboard's (tests/test_ray_start.py fails if Ray renames it).
DASHBOARD_START = "start_api_server"


def _why_retry(e: BaseException) -> str | None:
    """What went wrong, where `e` is a start failure worth another attempt; None otherwise."""
    if STARTUP_TIMEOUT in str(e):
        return "Ray's node did not register within Ray's 30 s"
    tb = e.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_name == DASHBOARD_START:
            last = str(e).strip().splitlines() or [type(e).__name__]
            return f"Ray's dashboard died as it started ({last[-1][:200]})"
        tb = tb.tb_next
    return None


def _descendants() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _stop(pids: set[int], timeout_s: float = 30.0) -> None:
    procs = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            proc.kill()
            procs.append(proc)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=timeout_s)


def start_with_retry(start: Callable[[], T], attempts: int = 3, log: Callable[[str], None] = print) -> T:
    """`start()`, tried up to `attempts` times while it fails with Ray's node startup timeout or its dashboard's
    death at start; every process a failed attempt left (the descendants of this process that were not there before
    it) is killed first. Any other error, or the last attempt's, propagates."""
    for attempt in range(1, attempts):
        before = _descendants()
        t0 = time.monotonic()
        try:
            return start()
        except Exception as e:
            why = _why_retry(e)
            if why is None:
                raise
            left = _descendants() - before
            log(f"{why} (attempt {attempt} of {attempts}, {time.monotonic() - t0:.0f} s); stopping its "
                f"{len(left)} processes and starting again")
            _stop(left)
    return start()
