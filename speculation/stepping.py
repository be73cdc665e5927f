"""Which requests a verify step takes, and which drafting rounds run beside it: the loop's schedule, free of clocks
and I/O, so that the service's loop (speculation/loop.py, asyncio) and the cluster simulator (simulate/cluster.py,
simpy) run the same one.

CoSine's pipeline: requests join one of two halves of the pool in turn; where the engine may verify part of its pool
in a step (the torch engine) and drafting has hardware of its own, the halves take turns, and one half's next round
is drafted while the other half is verified. An engine that steps its whole pool (vLLM) verifies every request each
step, and the next round is drafted ahead meanwhile, from each context plus the chain being verified; such a draft
is kept only where the chain was accepted whole (`carried`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable

from speculation.messages import Draft


class StepGrouping:
    def __init__(self, partial_steps: bool):
        self.partial_steps = partial_steps  # the engine may verify part of its pool in a step
        self.halves: dict[str, int] = {}
        self.turn = 0  # the half the next pipelined step verifies
        self.pipelined = False  # decided at each step's start (`members`)
        self.verify_s = [0.0, 0.0]  # each half's last verify step
        self._arrivals = itertools.count()

    def join(self, rid: str) -> None:
        """A new request: the halves take arrivals in turn."""
        self.halves[rid] = next(self._arrivals) % 2

    def leave(self, rid: str) -> None:
        self.halves.pop(rid, None)

    def half(self, rid: str) -> int:
        return self.halves.get(rid, 0)

    def members(self, running: Iterable[str], drafting: bool, overlaps: bool,
                speculating: Callable[[str], bool]) -> list[str]:
        """This step's requests. Two halves only pay where there is drafting to hide behind the other half's
        verification, on hardware of its own (`overlaps`): where drafters share the verifier's cores, verifying each
        half apart only loses batching (measured: 8 requests on two cores, target-only 78 tok/s in halves vs 151 in
        one step). A half with nobody in it passes its turn."""
        running = list(running)
        self.pipelined = self.partial_steps and drafting and overlaps and any(speculating(r) for r in running)
        if not self.pipelined:
            return running
        members = [r for r in running if self.half(r) == self.turn]
        if not members:
            self.turn = 1 - self.turn
            members = [r for r in running if self.half(r) == self.turn]
        return members

    def verified(self, seconds: float, running: Iterable[str]) -> list[str]:
        """After a step of `seconds`: the requests of its half whose next round is drafted now, while the other half
        is verified (none unless pipelined); the turn passes to the other half."""
        self.verify_s[self.turn] = seconds
        nxt = [r for r in running if self.half(r) == self.turn] if self.pipelined else []
        self.turn = 1 - self.turn
        return nxt

    def overlap(self, rids: list[str], running: Iterable[str]) -> float:
        """How long verification runs beside the drafting of `rids`: the other half's last step, when pipelined and
        the other half has requests (a round drafted before a whole-pool step runs beside nothing)."""
        if not self.pipelined or not rids:
            return 0.0
        half = self.half(rids[0])
        # a snapshot: the loop asks while a step in a worker thread may admit or finish requests
        if not any(self.half(r) != half for r in list(running)):
            return 0.0
        return self.verify_s[1 - half]

    def drafts_ahead(self, enabled: bool, drafting: bool, overlaps: bool, drafts: dict) -> bool:
        """Whether to draft the next round during this whole-pool step. Only where drafting has hardware of its
        own: drafters sharing the verifier's cores would slow its step by as much (measured, two cores: vLLM steps
        34 -> 44 ms with drafting beside them)."""
        return enabled and drafting and bool(drafts) and not self.partial_steps and overlaps


def carried(bases: dict[str, list[int]], made: dict[str, Draft],
            context: Callable[[str], list[int] | None]) -> dict[str, Draft]:
    """The drafts made ahead that still extend their request's context (`context`: None once it is gone): its
    chain was accepted whole, and the draft begins with the token the target added after it."""
    out = {}
    for r, d in made.items():
        now = context(r)
        if now is None:
            continue
        base = bases[r]
        if now[:len(base)] == base and (rest := d.following(now[len(base):])) is not None:
            out[r] = rest
    return out
