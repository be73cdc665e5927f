"""Which drafters the coordinator calls: a drafter whose call failed or came too late sits out for a while.

Without it a hung or overloaded drafter makes every round it is chosen for wait until the round's deadline, and a
request routed to it alone gets no drafts at all, round after round. After n failures in a row a drafter is not
called for base * 2^(n-1) seconds (at most the configured maximum); then it is called again, and one answer in time
clears it (a circuit breaker with exponential backoff)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)


class DrafterHealth:
    def __init__(self, base_s: float = 1.0, max_s: float = 30.0, clock: Callable[[], float] = time.monotonic):
        self.base_s, self.max_s, self.clock = base_s, max_s, clock
        self.failures: dict[str, int] = {}  # failures in a row
        self.until: dict[str, float] = {}  # sits out until this clock time

    def available(self, name: str) -> bool:
        return self.clock() >= self.until.get(name, 0.0)

    def failed(self, name: str, why: str) -> float:
        """Count a failure; returns how long the drafter now sits out."""
        n = self.failures[name] = self.failures.get(name, 0) + 1
        pause = min(self.max_s, self.base_s * 2 ** (n - 1))
        self.until[name] = self.clock() + pause
        logger.warning("drafter %s: %s (%d in a row); not called for %.1f s", name, why, n, pause)
        return pause

    def succeeded(self, name: str) -> None:
        if self.failures.pop(name, None) is not None:
            self.until.pop(name, None)
            logger.info("drafter %s answers again", name)

    def sitting_out(self) -> list[str]:
        return sorted(n for n in self.until if not self.available(n))
