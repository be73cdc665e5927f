"""Startup work runs on a thread that ends with it (engines/build.py `in_passing_thread`), so that the OpenMP workers
its torch ops start do not outlive it: a pool left behind makes libgomp's workers sleep almost at once after every
parallel region of the target's step (see the function's docstring)."""

from __future__ import annotations

import os
import sys
import threading

import pytest
import torch

from engines.build import in_passing_thread


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _parallel_work() -> float:
    a = torch.randn(512, 512)
    return float(torch.mm(a, a).sum())  # far above torch's grain size: a parallel region on every core


def test_the_value_comes_back_errors_are_raised_here_and_the_callers_torch_threads_apply():
    seen = []
    assert in_passing_thread(lambda x: (seen.append(torch.get_num_threads()), x + 1)[1], 41) == 42
    assert seen == [torch.get_num_threads()]
    with pytest.raises(ValueError, match="bad config"):
        in_passing_thread(lambda: (_ for _ in ()).throw(ValueError("bad config")))


@pytest.mark.skipif(not sys.platform.startswith("linux") or (os.cpu_count() or 1) < 2 or torch.get_num_threads() < 2,
                    reason="needs Linux's /proc and two torch threads")
def test_the_openmp_workers_a_build_starts_end_with_it():
    before = _threads()
    in_passing_thread(_parallel_work)
    assert _threads() == before  # the startup thread and its pool's workers are gone
    # the same work on a thread that lives on leaves its pool's workers behind (what the build used to do)
    done, stop = threading.Event(), threading.Event()

    def stays():
        torch.set_num_threads(torch.get_num_threads())
        _parallel_work()
        done.set()
        stop.wait()

    t = threading.Thread(target=stays)
    t.start()
    try:
        done.wait(60)
        assert _threads() >= before + 2  # the thread itself and at least one OpenMP worker of its pool
    finally:
        stop.set()
        t.join()
