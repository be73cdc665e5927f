"""Traces of real runs for `cosine simulate`: JSON lines the verify loop appends when `speculation.record_trace`
is set. One line per finished request (its prompt and the target's output, which the simulator replays drafters
against), per verify step and per drafting round (the timings its latency models are fitted on), and per request
and verify step its draft's depth and accepted tokens (`cosine bench rounds` reads them). Times are the
verifier process's `time.perf_counter`, so only differences within one trace mean anything."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from pathlib import Path


class TraceRecorder:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", buffering=1)
        self._lock = threading.Lock()

    def _write(self, record: dict) -> None:
        with self._lock:
            self._file.write(json.dumps(record, separators=(",", ":")) + "\n")

    def request(self, rid: str, prompt: list[int], output: list[int], started: float, finished: float,
                drafted: int, accepted: int) -> None:
        self._write({"kind": "request", "id": rid, "t0": started, "t1": finished, "prompt": prompt,
                     "output": output, "drafted": drafted, "accepted": accepted})

    def step(self, end: float, batch: int, tokens: int, verify_s: float, wait_s: float, drafted: int) -> None:
        """One verify step: requests in it, tokens the engine processed, its time and how long it waited for drafts
        beforehand; `drafted`: requests with a draft."""
        self._write({"kind": "step", "t": end, "batch": batch, "tokens": tokens, "verify_s": verify_s,
                     "wait_s": wait_s, "drafted": drafted})

    def draft(self, requests: int, depth: int, scored: int, seconds: float) -> None:
        """A drafting round: requests, depth, and the context tokens of the requests in their first round
        (every drafter reads the prompt to score it for routing)."""
        self._write({"kind": "draft", "requests": requests, "depth": depth, "scored": scored, "seconds": seconds})

    def verified(self, rid: str, depth: int, accepted: int) -> None:
        """A request's draft verified in a step: its depth (0: decoded without one) and the tokens accepted."""
        self._write({"kind": "verified", "id": rid, "depth": depth, "accepted": accepted})

    def close(self) -> None:
        self._file.close()


@dataclass
class Trace:
    requests: list[dict] = field(default_factory=list)
    steps: list[dict] = field(default_factory=list)
    drafts: list[dict] = field(default_factory=list)
    verified: list[dict] = field(default_factory=list)

    @classmethod
    def load(cls, *paths: str | Path) -> Trace:
        t = cls()
        for path in paths:
            t.add(Path(path).read_text())
        return t

    def add(self, text: str) -> None:
        """The records of `text` (JSON lines as the recorder writes them)."""
        for line in text.splitlines():
            if line.strip():
                rec = json.loads(line)
                {"request": self.requests, "step": self.steps, "draft": self.drafts,
                 "verified": self.verified}[rec.pop("kind")].append(rec)
