"""Speculation off is the engine's own step: when no request of a step may draft, the loop steps the engine and
hands out its tokens, nothing else.

A step where no request plans drafts (speculation off by configuration, by every request's own setting, by the
guard's verdict or during its plain probes) needs none of the speculative step's work: no drafting round or its
planning, no context copies for drafters, no drafts written into the engine's scheduler, no device-work counters,
no controller fit. `PlainSteps.applies` says whether this step is one (a look at each running request, no copies);
`PlainSteps.step` runs it: the engine's step submitted straight to the thread the engine steps on (vLLM's CPU
engine: the thread that built it; one hop there and back), the outputs to their requests, the guard told (it counts
its off steps and measures plain decoding on them) and the loop's statistics kept.

The loop's own work on a step's outputs runs beside the next step: when a plain step ends, nothing waits in the
loop's inbox (no request to add or abort) and the next step is plain too, that step is submitted before the
outputs are handed out (`ahead`), so the engine's thread never waits for the loop's thread between plain steps. The
loop touches the engine (adds, aborts, admits, asks what may draft) only while no step is in flight: with a step
ahead, its next iteration takes that step's outputs first. Nothing here holds state a speculative step needs, so
the next step that plans drafts takes the speculative path as it would have, and no output changes: every token is
the target's either way.
"""

from __future__ import annotations

import asyncio
import logging
import time

logger = logging.getLogger(__name__)


class PlainSteps:
    """The plain steps of a `VerifyLoop` (speculation/loop.py, which makes one of these for itself)."""

    def __init__(self, loop):
        self.loop = loop
        self.steps = 0  # plain steps taken (the loop's `speculation_stats`; the breakdown benchmark reads them)
        self.ahead: asyncio.Future | None = None  # the next plain step, submitted before this one's outputs went out
        self.ahead_steps = 0  # plain steps submitted ahead

    def applies(self) -> bool:
        """May no request of the next step draft? Drafting off, the guard holding speculation off (or probing
        plain steps), or every running request with speculation off. Only while no step is in flight."""
        loop = self.loop
        if loop.drafting is None:
            return True
        guard = loop.planner.guard
        if guard is not None and not guard.allow(min(len(loop.engine.running), loop.engine.max_batch)):
            return True
        return not any(loop._speculating(r) for r in loop.engine.running)

    async def step(self, since: float) -> float | None:
        """One plain step (the one submitted ahead, if any); `since`: the previous step's end (or now, after
        idling). Returns this step's end, or None when the engine failed (its requests failed with it)."""
        loop = self.loop
        t = time.perf_counter()
        running, self.ahead = self.ahead, None
        step = running if running is not None else loop.submit_step({}, None)
        loop.deliver([])  # a speculative step's held outputs, while this one runs
        try:
            outs = await step
        except Exception as e:  # noqa: BLE001 - an engine failure fails the requests in it, not the loop
            logger.exception("verify step failed")
            loop.fail(list(loop.engine.running), e)
            return None
        end = time.perf_counter()
        started = since if running is not None else t  # a step submitted ahead started as the one before it ended
        self.steps += 1
        tokens = loop.engine.last_step_tokens  # before the next step, submitted below, changes it
        if loop.inbox.empty() and loop.engine.has_unfinished() and self.applies():
            self.ahead = loop.submit_step({}, None)
            self.ahead_steps += 1
        loop.stats.verify_step(end - started, {}, outs, len(loop.requests))
        prefill = bool(loop._fresh) and any(o.request_id in loop._fresh for o in outs)
        if prefill:
            loop._fresh.difference_update(o.request_id for o in outs)
        if loop._asked:  # drafts asked for before speculation went off: no longer pending
            loop._asked.difference_update(o.request_id for o in outs)
        loop.planner.observe_committed(len(outs), sum(len(o.new_token_ids) for o in outs), end - since, False,
                                       prefill)
        if loop.trace:
            loop.trace.step(end, len(outs), tokens, end - started, 0.0, 0)
        loop.deliver(outs)
        loop._catching_up = True  # the next speculative step's drafters catch up on this step's tokens
        return end
