"""The fitted models the goodput controller plans with (speculation/goodput.py): a step's time linear in its
tokens (`LinearLatency`: the verifier's step, a lockstep drafter step), a drafting round's time in its depth and
requests (`RoundLatency`), and the expected tokens a verification commits at a per-token acceptance."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np


@dataclass
class LinearLatency:
    """t(n) = a + b * n, fitted by least squares on a sliding window of observations (seconds)."""

    a: float = 0.0
    b: float = 0.0
    samples: deque = field(default_factory=lambda: deque(maxlen=256))
    seen: int = 0  # observations so far: every fourth refits (counting the window's length would refit every one
    # once the window is full; the loop observes a verify step and a drafting round each round)

    def observe(self, n: float, seconds: float) -> None:
        self.samples.append((float(n), float(seconds)))
        self.seen += 1
        if self.seen % 4 == 0:
            self.refit()

    def refit(self) -> None:
        x, y = (np.array(col) for col in zip(*self.samples))
        if np.ptp(x) == 0:
            self.a, self.b = float(np.median(y)), max(self.b, 0.0)
            return
        dx = x - x.mean()
        b = float(dx @ y) / float(dx @ dx)  # least squares, in closed form
        self.a, self.b = max(float(y.mean()) - b * float(x.mean()), 0.0), max(b, 0.0)

    def __call__(self, n: float) -> float:
        return self.a + self.b * n


@dataclass
class RoundLatency:
    """A drafting round's time, t = a + depth * (b + c * requests), fitted by non-negative least squares on a
    sliding window (seconds). A model in the depth alone priced a round for one request like the batch's rounds it
    was fitted on: the last request of a batch, drafting alone, was held at k = 0."""

    a: float = 0.0
    b: float = 0.0
    c: float = 0.0
    samples: deque = field(default_factory=lambda: deque(maxlen=256))
    seen: int = 0  # observations so far: every fourth refits (as LinearLatency)

    def observe(self, depth: int, requests: int, seconds: float) -> None:
        self.samples.append((float(depth), float(requests), float(seconds)))
        self.seen += 1
        if self.seen % 4 == 0:
            self.refit()

    def refit(self) -> None:
        d, r, y = (np.array(col) for col in zip(*self.samples))
        x = np.stack([np.ones_like(d), d, d * r], axis=1)
        keep = [0, 1, 2]
        while keep:  # a coefficient fitted below zero leaves the model, the others are refitted
            coef = np.linalg.lstsq(x[:, keep], y, rcond=None)[0]
            if (coef >= 0).all():
                break
            keep.pop(int(np.argmin(coef)))
        full = dict(zip(keep, coef)) if keep else {}
        self.a, self.b, self.c = (float(full.get(i, 0.0)) for i in range(3))

    def __call__(self, depth: int, requests: int) -> float:
        return self.a + depth * (self.b + self.c * requests)


def expected_tokens(acceptance: float, k: int) -> float:
    a = min(max(acceptance, 0.0), 0.999)
    return (1 - a ** (k + 1)) / (1 - a)


@lru_cache(maxsize=4096)
def expected_row(acceptance: float, k_max: int) -> tuple[float, ...]:
    """`expected_tokens` at k = 0..k_max (a request's estimate is the same over a plan's participations, and stays
    so over rounds where it drafted nothing)."""
    return tuple(expected_tokens(acceptance, k) for k in range(k_max + 1))
