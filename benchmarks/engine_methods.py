"""What `cosine bench engine` compares: our configurations (`Method`, `methods`), and the drafting tier made slow
on purpose (`SlowedDrafting`) by which it shows the guard at work."""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Method:
    """One of our configurations. `drafters`: a prompt's drafters given its domain (one drafts a chain, two a
    tree: their chains fused one-shot, or in lockstep), None for routing (cosine) or every voter (vote)."""

    name: str
    drafters: Callable[[str], list[str]] | None
    lockstep: bool = False
    adaptive: bool = False
    mode: str = "cosine"
    vote_per_request: bool = False
    levels: bool = False  # SpecRouter's chains: the target's 10M original as a drafter, alone or assisted
    chain_choice: bool = False  # SpecRouter's choice among every chain (routing.chain_choice: latency)
    slowed: bool = False  # every drafting round made `slow_factor` verify steps longer on purpose (`SlowedDrafting`)
    blind: bool = False  # the controller does not see what rounds cost: only the guard can switch speculation off


def methods(k: int) -> list[Method]:
    """Every configuration of ours that `cosine bench engine` measures, at draft length `k`."""
    return [Method("target-only (our engine)", lambda d: [], mode="off"),
            Method(f"ours: chain, domain drafter, k={k}", lambda d: [d]),
            Method(f"ours: chain, generic drafter, k={k}", lambda d: ["generic"]),
            Method(f"ours: tree, domain + generic drafters, k={k}", lambda d: [d, "generic"]),
            Method(f"ours: chain, goodput-adaptive k<={2 * k}", lambda d: [d], adaptive=True),
            Method(f"ours: full CoSine (routing, fusion, adaptive), k<={2 * k}", None, True, True),
            # the same, each fused tree verified as its best chain: what the vLLM engine verifies
            Method(f"ours: full CoSine, best chain of each tree, k<={2 * k}", None, True, True),
            # Minions: every drafter drafts, the weighted majority chain is verified
            Method(f"ours: Minions vote of all 7 drafters, k={k}", None, mode="vote"),
            Method(f"ours: Minions vote of all 7 drafters, per-request weights, k={k}", None, mode="vote",
                   vote_per_request=True),
            Method(f"ours: Minions vote of domain + generic drafters, k={k}", lambda d: [d, "generic"], mode="vote"),
            # SpecRouter: the bench target's 10M original drafts (2 levels), or a domain drafter drafts for it (3)
            Method(f"ours: 2-level chain, 10M original, k={k}", lambda d: ["original"], levels=True),
            Method(f"ours: 3-level chain, domain drafter -> 10M original, k={k}", lambda d: [f"3level-{d}"],
                   levels=True),
            Method(f"ours: 2-level chain, 10M original, goodput-adaptive k<={2 * k}", lambda d: ["original"],
                   adaptive=True, levels=True),
            Method(f"ours: 3-level chain, domain drafter -> 10M original, goodput-adaptive k<={2 * k}",
                   lambda d: [f"3level-{d}"], adaptive=True, levels=True),
            # SpecRouter's choice per request and round among all of them: domain, generic, 2- and 3-level chains
            Method(f"ours: SpecRouter chain choice among all chains, k={k}", None, levels=True, chain_choice=True),
            # never slower than plain decoding: drafting made slow on purpose, as shipped and with only the guard
            Method(f"ours: full CoSine, k<={2 * k}, drafting slowed on purpose", None, True, True, slowed=True),
            Method(f"ours: full CoSine, k<={2 * k}, drafting slowed on purpose, controller blind to it (the guard "
                   "alone)", None, True, True, slowed=True, blind=True)]


class SlowedDrafting:
    """A drafting tier with every round made longer on purpose (its drafts unchanged): by `delay_s`, or by `factor`
    times the loop's recent verify step (median of the last 32 in `stats`; `delay_s` before any), so that drafting
    costs more than it saves on any machine. How the loop and its guard behave then."""

    def __init__(self, tier, delay_s: float, factor: float | None = None, stats=None):
        self.tier, self.delay_s, self.factor, self.stats, self.rounds = tier, delay_s, factor, stats, 0

    async def draft(self, batch):
        self.rounds += 1
        recent = list(self.stats.verify_seconds)[-32:] if self.stats is not None else []
        await asyncio.sleep(self.factor * statistics.median(recent) if self.factor and recent else self.delay_s)
        return await self.tier.draft(batch)

    def __getattr__(self, name):  # release, stats, servers, coordinator: the tier's own
        return getattr(self.tier, name)
