"""benchmarks/turns.py: while one system is measured, every process of every other system's tree is paused, and
a paused process gets no CPU; its turn resumes it, and `resume_all` leaves nothing paused."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import psutil
import pytest

from benchmarks.turns import Turns

# a system's process with a child of its own that spins, as a served graph's replicas run below it
SPINNING_TREE = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'while True: pass']); time.sleep(600)"


def _system() -> SimpleNamespace:
    """A system as a benchmark pauses it: started, its root asleep and its child spinning. A process still starting
    (reading the interpreter and its modules) can sit in uninterruptible disk sleep, where no signal reaches it, for
    as long as the disk is busy: in a fresh-clone suite run one did for over 60 s while a served graph started."""
    proc = subprocess.Popen([sys.executable, "-c", SPINNING_TREE])
    root, deadline = psutil.Process(proc.pid), time.time() + 180
    while time.time() < deadline:
        kids = root.children()
        if kids and root.status() == psutil.STATUS_SLEEPING and sum(kids[0].cpu_times()[:2]) > 0.2:
            break
        time.sleep(0.1)
    return SimpleNamespace(proc=proc)


def _tree(system) -> list[psutil.Process]:
    root = psutil.Process(system.proc.pid)
    return [root, *root.children(recursive=True)]


def _stopped(system) -> list[bool]:
    return [p.status() == psutil.STATUS_STOPPED for p in _tree(system)]


def _cpu(system) -> float:
    return sum(sum(p.cpu_times()[:2]) for p in _tree(system))


def _advances(system, within_s: float = 30) -> bool:
    start, deadline = _cpu(system), time.time() + within_s
    while time.time() < deadline:
        time.sleep(0.2)
        if _cpu(system) > start:
            return True
    return False


def test_only_the_measured_system_runs_and_a_paused_one_gets_no_cpu():
    systems = {"a": _system(), "b": _system()}
    turns = Turns(systems, settle_s=0)
    try:
        assert len(_tree(systems["a"])) == 2
        turns.only("a")
        assert _stopped(systems["b"]) == [True, True] and _stopped(systems["a"]) == [False, False]
        held = _cpu(systems["b"])
        assert _advances(systems["a"])  # the measured system's spinning child runs meanwhile
        assert _cpu(systems["b"]) == held
        turns.only("b")
        assert _stopped(systems["a"]) == [True, True] and _stopped(systems["b"]) == [False, False]
        assert _advances(systems["b"])
        turns.resume_all()
        assert not any(_stopped(systems["a"]) + _stopped(systems["b"]))
        assert _advances(systems["a"])
    finally:
        turns.resume_all()
        for s in systems.values():
            for p in reversed(_tree(s)):
                p.kill()
            s.proc.wait()


def test_a_process_that_does_not_act_on_its_signal_in_time_is_an_error_not_a_measurement(monkeypatch):
    from benchmarks import turns

    monkeypatch.setattr(turns, "_pending", lambda p, stopping: True)  # as a process stuck where no signal reaches it
    me = psutil.Process()
    with pytest.raises(RuntimeError, match=f"SIGCONT: not acted on in 0 s by {me.pid} "):
        turns._signal([me], signal.SIGCONT, timeout_s=0.05)
