"""Startup work runs on a thread that ends with it (engines/build.py `in_passing_thread`), so that the OpenMP workers
its torch ops start do not outlive it: a pool left behind makes libgomp's workers sleep almost at once after every
parallel region of the target's step (see the function's docstring)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engines.build import in_passing_thread, set_thread_torch_threads


def test_the_value_comes_back_errors_are_raised_here_and_the_callers_torch_threads_apply():
    seen = []
    before = torch.get_num_threads()
    # not what a new thread starts with (tests/conftest.py: one); torch's C setter, as an in-process vLLM engine makes
    # `torch.set_num_threads` a no-op in this process
    set_thread_torch_threads(before + 1)
    try:
        assert in_passing_thread(lambda x: (seen.append(torch.get_num_threads()), x + 1)[1], 41) == 42
    finally:
        set_thread_torch_threads(before)
    assert seen == [before + 1]
    with pytest.raises(ValueError, match="bad config"):
        in_passing_thread(lambda: (_ for _ in ()).throw(ValueError("bad config")))


# in a process of its own: the suite's process starts and ends threads of other tests' (Ray's, vLLM's) meanwhile
_CHECK = """
import os, threading, time
import torch
from engines.build import in_passing_thread

def threads():
    return len(os.listdir("/proc/self/task"))

def work():
    a = torch.randn(512, 512)
    return float(torch.mm(a, a).sum())  # far above torch's grain size: a parallel region on every core

def settles(want, bound_s=30.0):
    deadline = time.time() + bound_s  # a thread that returned from join() may still be exiting
    while threads() > want and time.time() < deadline:
        time.sleep(0.05)
    return threads()

# torch starts a thread of its own once per process (with the first thread count set): before counting
warm = threading.Thread(target=lambda: (torch._C.set_num_threads(torch.get_num_threads()), work()))
warm.start()
warm.join()
before = settles(0, 2.0)
in_passing_thread(work)
print("passing", before, settles(before))
done, stop = threading.Event(), threading.Event()

def stays():
    work()
    done.set()
    stop.wait()

t = threading.Thread(target=stays)
t.start()
done.wait(60)
print("staying", before, threads())
stop.set()
t.join()
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux") or (os.cpu_count() or 1) < 2,
                    reason="needs Linux's /proc and two cores")
def test_the_openmp_workers_a_build_starts_end_with_it():
    out = subprocess.run([sys.executable, "-c", _CHECK], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[1], env=dict(os.environ, OMP_NUM_THREADS="2"))
    assert out.returncode == 0, out.stderr[-2000:]
    lines = {line.split()[0]: [int(x) for x in line.split()[1:]] for line in out.stdout.splitlines()}
    before, after = lines["passing"]
    assert after == before  # the startup thread and its pool's workers are gone
    # the same work on a thread that lives on leaves its pool behind (what the build used to do)
    before, living = lines["staying"]
    assert living >= before + 2  # the thread itself and at least one OpenMP worker of its pool
