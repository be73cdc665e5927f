"""Goodput-driven speculation length (SmartSpec): choose each request's draft length, 0..k_max, to maximise

    goodput = sum_i E_i(k_i) / (T_draft(k) + T_verify(sum_i (1 + k_i)))

where E_i(k) = (1 - a_i^(k+1)) / (1 - a_i) is the expected number of tokens a verification commits for request i
with per-token acceptance a_i (bonus token included), T_verify is a fitted linear model of the verifier's step time
in the number of tokens it processes, and T_draft the lockstep drafting time (one drafter step per depth, over the
requests still drafting at that depth). k = 0 for everyone is plain decoding, so the choice is never worse than
no speculation under the model: speculation is only switched on where it pays, e.g. not at large batches on a
CPU where verifying k tokens costs almost k times one.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np


@dataclass
class LinearLatency:
    """t(n) = a + b * n, fitted by least squares on a sliding window of observations (seconds)."""

    a: float = 0.0
    b: float = 0.0
    window: int = 256
    samples: deque = field(default_factory=lambda: deque(maxlen=256))

    def observe(self, n: float, seconds: float) -> None:
        self.samples.append((float(n), float(seconds)))
        if len(self.samples) >= 4 and len(self.samples) % 4 == 0:
            self.refit()

    def refit(self) -> None:
        x = np.array([s[0] for s in self.samples])
        y = np.array([s[1] for s in self.samples])
        if np.ptp(x) == 0:
            self.a, self.b = float(np.median(y)), max(self.b, 0.0)
            return
        b, a = np.polyfit(x, y, 1)
        self.a, self.b = max(float(a), 0.0), max(float(b), 0.0)

    def __call__(self, n: float) -> float:
        return self.a + self.b * n


def expected_tokens(acceptance: float, k: int) -> float:
    a = min(max(acceptance, 0.0), 0.999)
    return (1 - a ** (k + 1)) / (1 - a)


@dataclass
class SpeculationController:
    """Per-request draft lengths from acceptance estimates and fitted step-latency models."""

    k_max: int = 8
    prior_acceptance: float = 0.6
    ema: float = 0.3
    verify: LinearLatency = field(default_factory=LinearLatency)
    draft: LinearLatency = field(default_factory=LinearLatency)  # one lockstep drafter step, in batch size
    drafters_per_request: int = 1  # draft work scales with the number of drafters in lockstep
    acceptance: dict[str, float] = field(default_factory=dict)

    def observe_acceptance(self, rid: str, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        rate = accepted / drafted
        prev = self.acceptance.get(rid, self.prior_acceptance)
        self.acceptance[rid] = (1 - self.ema) * prev + self.ema * rate

    def release(self, rid: str) -> None:
        self.acceptance.pop(rid, None)

    def _time(self, ks: list[int]) -> float:
        verify = self.verify(sum(1 + k * self.drafters_per_request for k in ks))
        draft = sum(self.draft(sum(1 for k in ks if k >= depth)) for depth in range(1, max(ks, default=0) + 1))
        return verify + draft * self.drafters_per_request

    def choose(self, rids: list[str], k_caps: dict[str, int] | None = None) -> dict[str, int]:
        """Greedy allocation: repeatedly set the one draft length (to any longer value) that raises goodput
        most, while any does. Jumps, not unit steps, because a drafter's fixed per-step cost can make k = 1
        worse than k = 0 while k = 4 is better."""
        caps = {r: min(self.k_max, (k_caps or {}).get(r, self.k_max)) for r in rids}
        ks = {r: 0 for r in rids}
        if not rids:
            return ks
        acc = {r: self.acceptance.get(r, self.prior_acceptance) for r in rids}

        def goodput(kv: dict[str, int]) -> float:
            t = self._time(list(kv.values()))
            return sum(expected_tokens(acc[r], k) for r, k in kv.items()) / max(t, 1e-9)

        best = goodput(ks)
        while True:
            cand = None
            for r in rids:
                old = ks[r]
                for j in range(old + 1, caps[r] + 1):
                    ks[r] = j
                    g = goodput(ks)
                    if g > best * (1 + 1e-3) and (cand is None or g > cand[2]):
                        cand = (r, j, g)
                ks[r] = old
            if cand is None:
                return ks
            ks[cand[0]] = cand[1]
            best = cand[2]
