"""Systems take turns: while one system of a side-by-side benchmark is measured, every other one is paused.

An idle served graph is not idle: Ray's daemons, the Serve controller and proxy and every replica's timers took 17%
of one core on a 2-core machine (`cosine serve examples/bench.yaml` with nothing to do, 2026-11-29), and `cosine
bench anchors` keeps two served graphs up beside the in-process systems for the whole run. That CPU was taken from
whichever system was being measured, and not from each alike (a system with more threads to schedule loses more).
So every system but the one measured is paused: SIGSTOP to every process of its tree (the process the benchmark
started and everything it started in turn: Ray's GCS, raylet, agents and workers, vLLM's engine), SIGCONT when its
turn comes, then `settle_s` for the timers that came due meanwhile, so that their catching up is not timed either.
A paused system keeps its state (its models, caches, the guard's and controller's measurements): nothing restarts.
"""

from __future__ import annotations

import signal
import time

import psutil

SETTLE_S = 3.0


def _tree(pid: int) -> list[psutil.Process]:
    """`pid` and every process below it (none if it is gone)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _signal(procs: list[psutil.Process], sig: int, timeout_s: float = 60) -> None:
    """Send `sig` to every process of `procs`, and wait until each has acted on it (a signal is delivered when its
    process is next scheduled): stopped for SIGSTOP, running again for SIGCONT. RuntimeError if one has not within
    `timeout_s`, checked after the deadline too (on a loaded machine this thread may sleep past it): a system measured
    beside one still running would be measured wrong."""
    for p in procs:
        try:
            p.send_signal(sig)
        except psutil.NoSuchProcess:  # ended meanwhile (a Ray worker that finished its task)
            pass
    stopping = sig == signal.SIGSTOP
    deadline = time.monotonic() + timeout_s
    while procs := [p for p in procs if _pending(p, stopping)]:
        if time.monotonic() > deadline:
            states = ", ".join(f"{p.pid} {_status(p)}" for p in procs)
            raise RuntimeError(f"{signal.Signals(sig).name}: not acted on in {timeout_s:.0f} s by {states}")
        time.sleep(0.01)


def _status(p: psutil.Process) -> str:
    try:
        return p.status()
    except psutil.NoSuchProcess:
        return "gone"


def _pending(p: psutil.Process, stopping: bool) -> bool:
    """Has `p` yet to act on a SIGSTOP (`stopping`) or a SIGCONT? Not if it has ended."""
    try:
        status = p.status()
    except psutil.NoSuchProcess:
        return False
    return status not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD) and (status == psutil.STATUS_STOPPED) != stopping


class Turns:
    """Over `systems`, name -> a running system (anything with `proc`, the `subprocess.Popen` the benchmark started;
    read at each call, so systems may be added as they start): `only(name)` before measuring `name`; `resume_all()`
    before the systems are stopped (a paused process would not act on the signal that stops it)."""

    def __init__(self, systems: dict, settle_s: float | None = None):
        self.systems = systems
        self.settle_s = SETTLE_S if settle_s is None else settle_s
        self.paused: dict[str, list[psutil.Process]] = {}  # name -> the processes it had when paused

    def only(self, name: str) -> None:
        """Pause every system but `name`; resume `name` if it was paused, and let it settle."""
        for other, system in self.systems.items():
            if other != name and other not in self.paused:
                self.paused[other] = _tree(system.proc.pid)
                _signal(self.paused[other], signal.SIGSTOP)
        if name in self.paused:
            _signal(self.paused.pop(name), signal.SIGCONT)
            time.sleep(self.settle_s)

    def resume_all(self) -> None:
        for name in list(self.paused):
            _signal(self.paused.pop(name), signal.SIGCONT)
