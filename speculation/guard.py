"""Never slower than plain decoding: a model-free guard over the loop's realised goodput.

The goodput controller chooses draft lengths from models (fitted verify and drafting times, acceptance); a model
can be wrong where the hardware does what it was not fitted on (a GPU round that waits for locks or graph captures,
drafters far slower than their fit). The guard does not model anything: it compares what speculation really gave,
tokens committed per second of wall time over a window of `window` speculating steps (drafting waits, verify and
the loop's own work included), with what plain decoding gives at the same batch sizes, measured on steps without
drafts. Where speculation was more than `margin` slower in `patience` windows in a row (one noisy window on a busy
machine is not a verdict; a loss below `severe` of plain decoding's speed is one, after a quarter window once plain
steps are measured), it is switched off (k = 0 for every request) for `off_steps` steps, then tried again: a trial
that loses is a verdict after a quarter window and switches it off again, for twice as long (up to `off_steps_max`);
a window that pays resets the wait. Each wait is also long enough that a trial losing what the last verdict's steps
lost costs at most half the margin of the plain steps before it: a trial's price, not a fixed count, sets how often
speculation that keeps losing is tried.

Plain steps are measured where they happen anyway (speculation off, requests held at k = 0), and otherwise by a
probe when a window is full: `probe_steps` steps without drafts, where no measured size stands for the window's
typical batch (a measured size m stands for sizes n with m / 2 <= n <= 2 m) or its measurement is older than
`refresh_steps` steps; the verdict follows the probe. Until a first window is full, nothing changes: a short run
never sees the guard. A plain step of n requests is estimated from the nearest measured size m as t(m) for n <= m
and t(m) n / m above it: both over-estimate plain decoding's time on a GPU (nearly flat in the batch), so the guard
errs towards leaving speculation on. Steps that prefill a prompt are left out on both sides (their cost is the
prompt's, not the method's). Probes and the guard's choice never change the output: drafts or not, every token is
the target's.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field


@dataclass
class SpeculationGuard:
    window: int = 16
    margin: float = 0.03
    patience: int = 2
    severe: float = 0.5
    probe_steps: int = 2
    off_steps: int = 32
    off_steps_max: int = 512
    refresh_steps: int = 256
    plain: dict[int, deque] = field(default_factory=dict)  # batch size -> recent plain step wall seconds
    plain_age: dict[int, int] = field(default_factory=dict)  # steps since each size's last plain measurement
    spec: list[tuple[int, int, float]] = field(default_factory=list)  # the window: (requests, committed, seconds)
    off_left: int = 0  # plain steps left before speculation is tried again
    wait: int = 0  # the next loss's off_steps
    probing: int = 0  # plain probe steps still to take
    probed: bool = False  # the full window has had its probe
    last_ratio: float | None = None  # realised speculative goodput over plain's, in the last window
    switched_off: int = 0  # times speculation was switched off
    losses: int = 0  # losing windows in a row
    trial: bool = False  # speculating again after being switched off: one losing window suffices

    def __post_init__(self):
        self.wait = self.off_steps

    @classmethod
    def from_spec(cls, spec) -> SpeculationGuard:
        """From `speculation.guard` (config.GuardSpec)."""
        return cls(window=spec.window, margin=spec.margin, patience=spec.patience, severe=spec.severe,
                   probe_steps=spec.probe_steps,
                   off_steps=spec.off_steps,
                   off_steps_max=spec.off_steps_max, refresh_steps=spec.refresh_steps)

    @property
    def speculating(self) -> bool:
        return self.off_left == 0

    def allow(self, requests: int) -> bool:
        """May the next step draft? No while switched off or taking plain probe steps."""
        return self.off_left == 0 and self.probing == 0

    def _measured_near(self, n: int) -> bool:
        return any(m / 2 <= n <= 2 * m and self.plain_age[m] < self.refresh_steps for m in self.plain)

    def plain_seconds(self, n: int) -> float | None:
        """A plain step of n requests: measured at n, or estimated from the nearest measured size (see above)."""
        if not self.plain:
            return None
        m = min(self.plain, key=lambda s: (abs(s - n), -s))
        t = statistics.median(self.plain[m])
        return t if n <= m else t * n / m

    def observe(self, requests: int, committed: int, seconds: float, speculated: bool, prefill: bool) -> None:
        """A step of `requests` requests committed `committed` tokens in `seconds` of wall time (since the previous
        step ended: drafting waits included); `speculated`: some request had a draft; `prefill`: it fed a prompt."""
        for m in self.plain_age:
            self.plain_age[m] += 1
        if not speculated:
            if self.off_left > 0:
                self.off_left -= 1
                self.trial = self.off_left == 0
            if not prefill and requests > 0:
                self.plain.setdefault(requests, deque(maxlen=8)).append(seconds)
                self.plain_age[requests] = 0
                self.probing = max(0, self.probing - 1)
            return
        if prefill or requests == 0:
            return
        self.spec.append((requests, committed, seconds))
        if len(self.spec) < self.window:
            # a loss far beyond noise (below `severe` of plain) is a verdict after a quarter window
            # (on trial, any loss beyond the margin: it lost a full verdict before)
            early = len(self.spec) >= max(2, self.window // 4) and self._measured_near(requests)
            if early and (ratio := self._ratio()) is not None and (
                    ratio < self.severe or (self.trial and ratio < 1 - self.margin)):
                self._verdict()
            return
        typical = int(statistics.median(n for n, _, _ in self.spec))
        if not self._measured_near(typical) and not self.probed:
            self.probing, self.probed = self.probe_steps, True  # then the verdict, at the next speculating step
            return
        self.probed = False
        self._verdict()

    def _ratio(self) -> float | None:
        """The window's realised tokens per second over plain decoding's at its batch sizes (None: no plain)."""
        plain_time = sum(self.plain_seconds(n) or 0.0 for n, _, _ in self.spec)
        spec_time = sum(s for _, _, s in self.spec)
        if plain_time <= 0 or spec_time <= 0:
            return None
        return (sum(c for _, c, _ in self.spec) / spec_time) / (sum(n for n, _, _ in self.spec) / plain_time)

    def _lost_steps(self, window: list[tuple[int, int, float]]) -> float:
        """A window's loss in plain steps of its typical size: its wall time less what plain decoding would have
        taken to commit the same tokens."""
        plain_time = sum((self.plain_seconds(n) or 0.0) * c / n for n, c, _ in window)
        typical = self.plain_seconds(int(statistics.median(n for n, _, _ in window))) or 0.0
        lost = sum(s for _, _, s in window) - plain_time
        return lost / typical if typical > 0 else 0.0

    def _verdict(self) -> None:
        ratio, window, self.spec = self._ratio(), self.spec, []
        if ratio is None:
            return
        self.last_ratio = ratio
        if ratio >= 1 - self.margin:
            self.wait, self.losses, self.trial = self.off_steps, 0, False
            return
        self.losses += 1
        if ratio < self.severe or self.trial or self.losses >= self.patience:
            priced = math.ceil(self._lost_steps(window) / (self.margin / 2)) if self.margin > 0 else self.off_steps_max
            self.off_left = min(max(self.wait, priced), self.off_steps_max)
            self.wait = min(2 * self.off_left, self.off_steps_max)
            self.switched_off += 1
            self.losses, self.trial = 0, False

    def state(self) -> dict:
        return {"speculating": self.speculating, "off_steps_left": self.off_left,
                "realised_over_plain": None if self.last_ratio is None else round(self.last_ratio, 3),
                "switched_off": self.switched_off,
                "plain_step_ms": {n: round(1000 * statistics.median(q), 2) for n, q in sorted(self.plain.items())}}
