"""Starting Ray on a busy machine: a start that fails with Ray's node startup timeout is retried after the
processes it left are stopped; any other failure is not retried."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest

from serve_app.ray_start import STARTUP_TIMEOUT, start_with_retry


def test_rays_node_still_raises_the_timeout_this_retries_on():
    from ray._private.node import Node

    assert STARTUP_TIMEOUT in inspect.getsource(Node.__init__), \
        "Ray's node no longer raises this message when its raylet is slow: update serve_app/ray_start.py"


def test_a_timed_out_start_is_retried_after_its_processes_are_stopped():
    left: list[subprocess.Popen] = []

    def start() -> str:
        # what a timed-out Ray node leaves: processes of its own that outlive the exception
        left.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]))
        if len(left) < 3:
            raise Exception(f"The current node {STARTUP_TIMEOUT}. This could happen because ...")
        return "started"

    logged: list[str] = []
    try:
        assert start_with_retry(start, attempts=3, log=logged.append) == "started"
        assert len(logged) == 2 and "1 processes" in logged[0]
        for proc in left[:2]:
            assert proc.poll() is not None, "a failed attempt's process was left running"
        assert left[2].poll() is None, "the successful attempt's process was stopped"
    finally:
        for proc in left:
            proc.kill()
            proc.wait()


def test_the_last_attempt_and_other_errors_propagate():
    calls = []

    def timing_out() -> None:
        calls.append(1)
        raise Exception(f"The current node {STARTUP_TIMEOUT}.")

    with pytest.raises(Exception, match=STARTUP_TIMEOUT):
        start_with_retry(timing_out, attempts=2, log=lambda _: None)
    assert len(calls) == 2

    def broken() -> None:
        calls.append(1)
        raise ValueError("System config parameters can only be set on the head node.")

    calls.clear()
    with pytest.raises(ValueError):
        start_with_retry(broken, attempts=3, log=lambda _: None)
    assert len(calls) == 1


def test_rays_dashboard_start_still_raises_from_the_function_this_retries_on():
    from ray._private import services

    from serve_app.ray_start import DASHBOARD_START

    assert "Failed to start the dashboard" in inspect.getsource(getattr(services, DASHBOARD_START)), \
        "Ray no longer starts its dashboard in this function: update serve_app/ray_start.py"


def test_a_dashboard_that_died_at_start_is_retried_and_one_that_never_starts_fails():
    from serve_app.ray_start import DASHBOARD_START

    calls = []

    def dies_at_start(times: int):
        def dashboard() -> None:
            raise Exception("Failed to read dashboard.err file: [Errno 2] No such file or directory")

        dashboard.__code__ = dashboard.__code__.replace(co_name=DASHBOARD_START)  # as Ray's frame is named

        def start() -> str:
            calls.append(1)
            if len(calls) <= times:
                dashboard()
            return "started"
        return start

    logged: list[str] = []
    assert start_with_retry(dies_at_start(1), attempts=3, log=logged.append) == "started"
    assert len(calls) == 2 and "dashboard died as it started (Failed to read dashboard.err" in logged[0]
    calls.clear()
    with pytest.raises(Exception, match="dashboard.err"):
        start_with_retry(dies_at_start(5), attempts=3, log=lambda _: None)
    assert len(calls) == 3
