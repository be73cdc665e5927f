"""What the engines ask of the device, counted process-wide: drafter forward passes, host reads of device results
(on a GPU each one waits for the device: a sync), CUDA graph captures, and captures after warm-up (which must be 0:
a capture costs tens of milliseconds and, on a GPU, holds every other stream).

The counts are the same on a CPU, where the reads cost nothing (and steps at padded shapes record the shapes a GPU
would capture, engines/graphs.py), so that tests here bound what a GPU will pay: a drafting round costs one forward
per drafter shape and depth, and one host read per forward. The verify loop takes the counts around each drafting
round and verify step (`LoopStats`), `cosine bench engine` reports them per round and depth, and the verifier and
drafter deployments export them on /metrics.
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass, fields


@dataclass
class DeviceWork:
    drafter_forwards: int = 0  # forward passes of drafter models (a pooled forward counts once)
    host_reads: int = 0  # device results read on the host (syncs on a GPU)
    graph_captures: int = 0
    captures_after_warmup: int = 0

    # taken around every drafting round and verify step: a shallow copy, not dataclasses.asdict (which recurses and
    # deep-copies: a snapshot and its difference took 41 us that way, 11 us this way)
    def snapshot(self) -> DeviceWork:
        with _LOCK:
            return copy.copy(self)

    def since(self, before: DeviceWork) -> DeviceWork:
        now = self.snapshot()
        return DeviceWork(*(getattr(now, f) - getattr(before, f) for f in _FIELDS))


_FIELDS = tuple(f.name for f in fields(DeviceWork))
WORK = DeviceWork()
_LOCK = threading.Lock()
_warm = threading.Event()  # set once the process's engines captured what their shapes need


def count(drafter_forwards: int = 0, host_reads: int = 0, graph_captures: int = 0) -> None:
    with _LOCK:
        WORK.drafter_forwards += drafter_forwards
        WORK.host_reads += host_reads
        WORK.graph_captures += graph_captures
        if graph_captures and _warm.is_set():
            WORK.captures_after_warmup += graph_captures


def warmed_up(done: bool = True) -> None:
    """From now on, a capture counts as one after warm-up (the service's startup, a benchmark's warm-up runs)."""
    if done:
        _warm.set()
    else:
        _warm.clear()
