"""Never slower than plain decoding: a model-free guard over the loop's realised goodput.

The goodput controller chooses draft lengths from models (fitted verify and drafting times, acceptance); a model
can be wrong where the hardware does what it was not fitted on (a GPU round that waits for locks or graph captures,
drafters far slower than their fit, a CPU whose verify step grows with the drafted tokens faster than the fit says).
The guard does not model anything: it compares what speculation really gave, tokens committed per second of wall
time over a window of `window` speculating steps (drafting waits, verify and the loop's own work included), with
what plain decoding gives at the same batch sizes, measured on steps without drafts. Where speculation was more than
`margin` slower in `patience` windows in a row (one noisy window on a busy machine is not a verdict; a loss below
`clear` of plain decoding's speed is one after half a window (a full one where the load's last window paid), below
`severe` after a quarter, once plain steps are measured, each such early verdict only where its loss is beyond
`noise` standard errors of the steps' own ratios: a batch-16 run of a few dozen steps gets its verdict within
the run), it is switched off (k = 0 for every request) for `off_steps` steps, then tried again: a trial that loses
clearly is a verdict after a quarter window (any loss beyond the margin after half) and switches it off again, for
twice as long (up to `off_steps_max`); a window that pays resets the wait. A verdict also waits long enough that a
trial losing what its steps lost costs at most half the margin of the plain steps before it: a trial's price, not a
fixed count, sets how often speculation that keeps losing is tried. A load's first verdict waits `off_steps`,
unpriced: its window holds the load's first rounds (the goodput controller not yet fitted to it, drafters new to its
requests), and one such half window at 0.78x of plain, priced, kept speculation off for longer than a greedy batch-8
benchmark ran (bench_results/anchors-k8-turns.json). A load switched off before has shown it can lose: its verdicts
are priced, after a trial or after a window that paid alike (one paying window on sampled text, where speculation
hovers near plain's speed, is no proof).

Verdicts are kept per load: batch sizes 1, 2, 3-4, 5-8, 9-16, ... (`regime`) each have their own windows, verdicts
and waits, and a step counts only towards its own. Whether speculation pays depends on the batch (on a CPU it pays
for one request and loses for eight, where verifying k tokens per request costs nearly k plain steps); one verdict
for every load switched speculation off at batch 1 for hundreds of steps after a burst of eight requests lost, and
let every return to a loaded batch lose two windows again before the verdict. A load never judged, above one whose
last verdict lost, starts on trial.

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


def regime(requests: int) -> int:
    """The load a step of `requests` requests is judged at: 0 for 1, 1 for 2, 2 for 3-4, 3 for 5-8, 4 for 9-16..."""
    return max(0, requests - 1).bit_length()


def regime_name(r: int) -> str:
    low, high = (1 << (r - 1)) + 1 if r > 0 else 1, 1 << r
    return str(high) if low == high else f"{low}-{high}"


@dataclass
class Regime:
    """One load's verdict state (see the module's docstring)."""

    wait: int  # the next loss's off_steps
    spec: list[tuple[int, int, float]] = field(default_factory=list)  # the window: (requests, committed, seconds)
    off_left: int = 0  # plain steps at this load left before speculation is tried again
    probed: bool = False  # the full window has had its probe
    last_ratio: float | None = None  # realised speculative goodput over plain's, in its last window
    losses: int = 0  # losing windows in a row
    trial: bool = False  # speculating again after being switched off: one losing window suffices
    switched_off: int = 0


@dataclass
class SpeculationGuard:
    window: int = 16
    margin: float = 0.03
    patience: int = 2
    severe: float = 0.5
    clear: float = 0.85
    probe_steps: int = 2
    off_steps: int = 32
    off_steps_max: int = 512
    refresh_steps: int = 256
    noise: float = 1.0
    plain: dict[int, deque] = field(default_factory=dict)  # batch size -> recent plain step wall seconds
    plain_age: dict[int, int] = field(default_factory=dict)  # steps since each size's last plain measurement
    regimes: dict[int, Regime] = field(default_factory=dict)  # by `regime`
    current: int = 0  # the regime of the last step observed or asked about
    probing: int = 0  # plain probe steps still to take
    held: int = 0  # plain steps left of a hold at every load (`hold_off`)
    last_ratio: float | None = None  # the last verdict's ratio, whatever its load

    @classmethod
    def from_spec(cls, spec) -> SpeculationGuard:
        """From `speculation.guard` (config.GuardSpec)."""
        return cls(window=spec.window, margin=spec.margin, patience=spec.patience, severe=spec.severe,
                   clear=spec.clear, probe_steps=spec.probe_steps,
                   off_steps=spec.off_steps,
                   off_steps_max=spec.off_steps_max, refresh_steps=spec.refresh_steps, noise=spec.noise)

    def at(self, requests: int) -> Regime:
        """The verdict state of the load of `requests` requests."""
        r = regime(requests)
        if r not in self.regimes:
            # a load never judged, above one where speculation lost, starts on trial: a larger batch leaves
            # speculation less to gain (on a GPU as on a CPU), so a clearly losing quarter window is its verdict
            lost_below = any(g.last_ratio is not None and g.last_ratio < 1 - self.margin
                             for q, g in self.regimes.items() if q < r)
            self.regimes[r] = Regime(wait=self.off_steps, trial=lost_below)
        return self.regimes[r]

    @property
    def now(self) -> Regime:
        """The verdict state of the load last seen."""
        return self.regimes.get(self.current) or Regime(wait=self.off_steps)

    @property
    def switched_off(self) -> int:
        """Times speculation was switched off, at any load."""
        return sum(g.switched_off for g in self.regimes.values())

    @property
    def speculating(self) -> bool:
        return self.held == 0 and self.now.off_left == 0

    def allow(self, requests: int) -> bool:
        """May the next step, of `requests` requests, draft? No while its load is switched off, during a hold, or
        while taking plain probe steps."""
        if requests > 0:
            self.current = regime(requests)
        return self.held == 0 and self.probing == 0 and self.now.off_left == 0

    def hold_off(self, steps: int) -> None:
        """No drafts at any load for the next `steps` steps (a benchmark's speculation-off path; a test's)."""
        self.held = steps

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
        if requests > 0:
            self.current = regime(requests)
        g = self.at(requests) if requests > 0 else self.now
        if not speculated:
            self.held = max(0, self.held - 1)
            if g.off_left > 0:
                g.off_left -= 1
                g.trial = g.off_left == 0
            if not prefill and requests > 0:
                self.plain.setdefault(requests, deque(maxlen=8)).append(seconds)
                self.plain_age[requests] = 0
                self.probing = max(0, self.probing - 1)
            return
        if prefill or requests == 0:
            return
        g.spec.append((requests, committed, seconds))
        if len(g.spec) < self.window:
            # a loss far beyond noise (below `severe` of plain) is a verdict after a quarter window, a clear one
            # (below `clear`) after half; not a clear one where the load's last full window paid: half a window of
            # text no drafter predicts (every step committing one token) is a phase there, and greedy runs at 1.8x
            # plain were switched off by it. On trial (it lost before) a clear loss is one after a quarter window,
            # any loss beyond the margin after half: sampled text at batch 1 lost trials of 4 steps at 0.90-0.96x
            # plain, between full windows that paid 1.0-1.8x (the 2-core CPU, examples/bench.yaml, k = 4)
            # Each early verdict needs its loss beyond the window's own noise (`noise` standard errors of the steps'
            # ratios): at batch 1 on sampled text a step commits 1-3 tokens, and 4-8 such steps of speculation that
            # paid read as a loss often enough that the served graph, where speculation pays less, ran with it off
            # more than on (a full window's verdict still counts any loss: `patience` is its noise allowance)
            n = len(g.spec)
            early = n >= max(2, self.window // 4) and self._measured_near(requests)
            half = n >= max(2, self.window // 2)
            paid = g.last_ratio is not None and g.last_ratio >= 1 - self.margin
            # the share of plain's speed below which the window so far is a verdict (the highest rule that applies)
            below = max(self.severe, (1 - self.margin if half else self.clear) if g.trial else 0.0,
                        self.clear if half and not paid else 0.0)
            if early and (ratio := self._ratio(g.spec)) is not None and ratio < below \
                    and ratio + self.noise * self._standard_error(g.spec) < below:
                self._verdict(g)
            return
        typical = int(statistics.median(n for n, _, _ in g.spec))
        if not self._measured_near(typical) and not g.probed:
            self.probing, g.probed = self.probe_steps, True  # then the verdict, at the next speculating step
            return
        g.probed = False
        self._verdict(g)

    def _ratio(self, window: list[tuple[int, int, float]]) -> float | None:
        """A window's realised tokens per second over plain decoding's at its batch sizes (None: no plain)."""
        plain_time = sum(self.plain_seconds(n) or 0.0 for n, _, _ in window)
        spec_time = sum(s for _, _, s in window)
        if plain_time <= 0 or spec_time <= 0:
            return None
        return (sum(c for _, c, _ in window) / spec_time) / (sum(n for n, _, _ in window) / plain_time)

    def _standard_error(self, window: list[tuple[int, int, float]]) -> float:
        """The standard error of a window's ratio, from its steps' own ratios (0 for fewer than two steps)."""
        steps = [(c / s) / (n / p) for n, c, s in window if s > 0 and (p := self.plain_seconds(n))]
        return statistics.stdev(steps) / math.sqrt(len(steps)) if len(steps) > 1 else 0.0

    def _lost_steps(self, window: list[tuple[int, int, float]]) -> float:
        """A window's loss in plain steps of its typical size: its wall time less what plain decoding would have
        taken to commit the same tokens."""
        plain_time = sum((self.plain_seconds(n) or 0.0) * c / n for n, c, _ in window)
        typical = self.plain_seconds(int(statistics.median(n for n, _, _ in window))) or 0.0
        lost = sum(s for _, _, s in window) - plain_time
        return lost / typical if typical > 0 else 0.0

    def _price(self, window: list[tuple[int, int, float]]) -> int:
        """The wait after which a trial losing what `window` lost costs half the margin of the plain steps before it."""
        return math.ceil(self._lost_steps(window) / (self.margin / 2)) if self.margin > 0 else self.off_steps_max

    def _verdict(self, g: Regime) -> None:
        ratio, window, g.spec = self._ratio(g.spec), g.spec, []
        if ratio is None:
            return
        g.last_ratio = self.last_ratio = ratio
        if ratio >= 1 - self.margin:
            g.wait, g.losses, g.trial = self.off_steps, 0, False
            return
        g.losses += 1
        if ratio < self.clear or g.trial or g.losses >= self.patience:
            priced = self._price(window) if g.switched_off else 0  # a load's first verdict is not priced
            g.off_left = min(max(g.wait, priced), self.off_steps_max)
            g.wait = min(2 * g.off_left, self.off_steps_max)
            g.switched_off += 1
            g.losses, g.trial = 0, False

    def state(self) -> dict:
        return {"speculating": self.speculating, "off_steps_left": self.now.off_left,
                "realised_over_plain": None if self.last_ratio is None else round(self.last_ratio, 3),
                "switched_off": self.switched_off,
                "by_batch": {regime_name(r): {"speculating": g.off_left == 0, "off_steps_left": g.off_left,
                                              "realised_over_plain": None if g.last_ratio is None
                                              else round(g.last_ratio, 3), "switched_off": g.switched_off}
                             for r, g in sorted(self.regimes.items())},
                "plain_step_ms": {n: round(1000 * statistics.median(q), 2) for n, q in sorted(self.plain.items())}}
