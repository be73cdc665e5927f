"""A benchmark's machine: the load it ran under is recorded, and it refuses to start while another benchmark or a
test run shares the cores (benchmarks/common.py). Fast (reads /proc, starts one sleeping process); no marks."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from benchmarks.common import ALLOW_BUSY, MachineBusy, is_other_run, machine_load, other_runs, refuse_if_busy


def test_the_load_is_recorded_at_start_and_end_even_when_the_run_fails():
    with pytest.raises(RuntimeError), machine_load() as load:
        assert set(load) == {"logical_cores", "start"}
        raise RuntimeError("the benchmark failed")
    assert load["logical_cores"] == os.cpu_count() and len(load["start"]) == len(load["end"]) == 3
    assert all(x >= 0 for x in load["start"] + load["end"])


@pytest.fixture
def stranger():
    """A process outside this test's tree whose command line reads as a test run: started by a shell that exits at
    once, so it is nobody's child here."""
    line = f"'{sys.executable}' -c 'import time; time.sleep(60)' -m pytest tests/x.py >/dev/null 2>&1 & echo $!"
    out = subprocess.run(["sh", "-c", line], capture_output=True, text=True, check=True)
    pid = int(out.stdout)
    deadline = time.time() + 10
    while time.time() < deadline and not any("tests/x.py" in c for c in other_runs()):
        time.sleep(0.1)
    yield pid
    os.kill(pid, signal.SIGTERM)


def test_another_test_run_is_seen_and_refused_unless_overridden(stranger, monkeypatch):
    assert any("tests/x.py" in c for c in other_runs())
    monkeypatch.delenv(ALLOW_BUSY, raising=False)
    with pytest.raises(MachineBusy, match="tests/x.py"):
        refuse_if_busy()
    monkeypatch.setenv(ALLOW_BUSY, "1")
    refuse_if_busy()


def test_its_own_tree_is_not_another_run():
    """This pytest (an ancestor) and a child it starts with a benchmark's command line are this run's own."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "cosine", "bench", "engine",
                              "--json", "own-tree.json"])
    try:
        time.sleep(0.2)
        runs = other_runs()
        assert not any("own-tree.json" in c for c in runs)
        assert not any(" ".join(sys.argv) == c for c in runs)
    finally:
        child.kill()
        child.wait()


def test_a_benchmark_command_line_counts_and_others_do_not():
    assert is_other_run(["/x/bin/cosine", "bench", "anchors", "--json", "a.json"])
    assert is_other_run(["python", "-m", "serve_app.cli", "bench", "engine"])
    assert is_other_run(["/x/bin/python", "/x/bin/pytest", "-q"]) and is_other_run(["python", "-m", "pytest"])
    assert not is_other_run(["/x/bin/cosine", "serve", "examples/local.yaml"])
    assert not is_other_run(["vim", "tests/test_bench_machine.py"])
