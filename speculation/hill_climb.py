"""Minions' adaptive draft length: one k for the whole batch, hill-climbed on measured goodput.

The model-free alternative to the goodput controller (speculation/goodput.py), which predicts each request's best
k from acceptance estimates and fitted step-latency models. This one predicts nothing: it measures what the
current k delivers (committed tokens per second of wall time per running request, over `window` verify steps),
then tries k + 1 or k - 1. A neighbour that measures better becomes k and the climb goes on the same way; one that
does not sends k back, and the other side is tried; with neither better, k holds for `hold` windows before its
neighbours are probed again, so it follows a moving optimum. k = 0 (no speculation) probes k = 1 like any k does.

Noise guard: a probe wins only by `Z` standard errors of the two windows' per-step goodputs (and `MIN_GAIN`), and
the `SETTLE` steps after a move are not measured. Per running request, so that a change of load is not taken for
an effect of k (below saturation tokens per second follow the arrival rate, whatever k is). Unlike the goodput
controller it has one k for all requests (each capped by its own bound), leaves participation to the
configuration, and, a hill climber, stops at local optima (a drafter's fixed per-round cost can make k = 1 worse
than k = 0 while k = 4 is better: it stays at 0).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from types import MappingProxyType

from speculation.controller import DraftLengthController
from speculation.messages import Participation


class HillClimbController(DraftLengthController):
    SETTLE = 2  # steps after a move whose drafts may be the previous k's (the other pipeline half, drafted ahead)
    Z = 1.5  # standard errors by which a probe must beat the current k
    MIN_GAIN = 0.01  # and relative gain

    # participation is not chosen (the configuration's), nothing is predicted (no cosine_goodput{source="predicted"})

    def __init__(self, k_max: int, window: int = 32, hold: int = 4):
        self.k_max, self.window, self.hold = k_max, window, hold
        self.k = self.home = k_max  # the current and the best k; they differ while a neighbour is probed
        self.best: tuple[float, float] | None = None  # the home's last window: mean goodput, its standard error
        self.direction = -1  # the side a round probes first: the last probe's (down, from the configured k)
        self.untried: set[int] = set()  # sides of the home still to probe in this round
        self.hold_left = 0  # windows before the next round of probes
        self.skip = self.SETTLE
        self.samples: list[float] = []  # this window's per-step goodputs (tokens / s / request)
        self.step_wall: float | None = None  # the step being observed: its wall seconds, tokens, requests
        self.step_tokens = self.step_requests = 0

    def choose(self, rids: list[str], k_caps: dict[str, int] | None = None, overlap_s: float = 0.0,
               ahead: bool = False, unscored: Mapping[str, int] = MappingProxyType({})) -> dict[str, int]:
        """The current k for every request, within its cap (`overlap_s`, `ahead`, `unscored` are for the goodput
        model: unused)."""
        return {r: min(self.k, (k_caps or {}).get(r, self.k_max)) for r in rids}

    def observe_step(self, wall_s: float) -> None:
        """A verify step ended, `wall_s` after the previous one (or after its own start, when the loop was idle);
        its requests follow through `observe_acceptance`."""
        self._close_step()
        self.step_wall, self.step_tokens, self.step_requests = wall_s, 0, 0

    def observe_verify(self, tokens: int, seconds: float, wall_s: float) -> None:
        self.observe_step(wall_s)  # whole steps are measured, not the verifier's share

    def observe_acceptance(self, rid: str, drafted: int, accepted: int, participation: Participation | None = None) -> None:
        """A request of the current step committed `accepted` draft tokens and the target's own."""
        self.step_tokens += accepted + 1
        self.step_requests += 1

    def observe_verified(self, rid: str, drafted: int, accepted: int, participation: Participation | None) -> None:
        self.observe_acceptance(rid, drafted, accepted, participation)

    def release(self, rid: str) -> None:
        """Nothing is kept per request."""

    def state(self) -> dict:
        return {"k": self.k, "best_k": self.home,
                "goodput_per_request_tok_s": self.best[0] if self.best else None}

    def _close_step(self) -> None:
        if not self.step_wall or not self.step_requests:
            return
        if self.skip:
            self.skip -= 1
            return
        self.samples.append(self.step_tokens / self.step_requests / self.step_wall)
        if len(self.samples) >= self.window:
            g = statistics.fmean(self.samples)
            self._decide(g, statistics.stdev(self.samples) / math.sqrt(len(self.samples)))
            self.samples.clear()

    def _decide(self, g: float, se: float) -> None:
        if self.k != self.home:  # a probe's window
            assert self.best is not None  # a probe starts from a measured home
            d, (home_g, home_se) = self.k - self.home, self.best
            if g - home_g > max(self.Z * math.hypot(se, home_se), self.MIN_GAIN * home_g):
                self.home, self.best, self.untried = self.k, (g, se), {d}  # climb on; behind is worse
                self._probe()
            else:  # back home, measured afresh before the other side is tried
                self.untried.discard(d)
                self._move(self.home)
                if self._next() is None:
                    self._hold()
            return
        self.best = (g, se)
        if not self.untried:
            if self.hold_left:
                self.hold_left -= 1
                return
            self.untried = {1, -1}
        self._probe()

    def _next(self) -> int | None:
        return next((d for d in (self.direction, -self.direction)
                     if d in self.untried and 0 <= self.home + d <= self.k_max), None)

    def _probe(self) -> None:
        d = self._next()
        if d is None:
            self._hold()
        else:
            self.direction = d
            self._move(self.home + d)

    def _hold(self) -> None:
        self.untried.clear()
        self.hold_left = self.hold

    def _move(self, k: int) -> None:
        self.k, self.skip = k, self.SETTLE
