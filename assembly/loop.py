"""The service's verify loop in one process, and every prompt through it at once."""

from __future__ import annotations

import asyncio
import gc
from dataclasses import dataclass

from assembly.drafting_tier import InProcessDraftingTier, step_on_verifier_thread
from config import AppConfig
from engines.build import build_verifier_engine, in_passing_thread
from engines.interface import VerifierEngine
from engines.sampling import SamplingParams
from speculation.loop import VerifyLoop
from speculation.messages import SpeculationOverrides


@dataclass
class Generation:
    token_ids: list[int]
    finish_reason: str | None
    stats: dict  # the request's speculation statistics (vLLM's names)


def build_loop(cfg: AppConfig, engine: VerifierEngine | None = None,
               drafter_models: dict | None = None) -> VerifyLoop:
    """The service's loop in this process: the configured verifier engine (or `engine`) and drafters (or the
    already loaded `drafter_models`, name -> model or `DrafterEngine`)."""
    tier = in_passing_thread(InProcessDraftingTier.from_config, cfg, drafter_models) \
        if cfg.speculation.mode != "off" else None
    loop = VerifyLoop(engine if engine is not None else in_passing_thread(build_verifier_engine, cfg), cfg, tier)
    loop.drafting_overlaps_verification = cfg.speculation.colocated_overlaps(loop.engine.device)
    step_on_verifier_thread(tier, loop, loop.drafting_overlaps_verification)
    freeze_startup_heap()
    return loop


def freeze_startup_heap() -> None:
    """Once models and engines are loaded: everything alive now moved out of the garbage collector's reach, so that
    its collections while serving walk only what serving allocates (vLLM's engine core does the same at its own
    startup, before our drafters and deployment exist). Frozen objects in reference cycles are never collected: a
    process that builds loops and drops them must `gc.unfreeze()` after (the test suite does, per module)."""
    gc.collect()
    gc.freeze()


async def generate_all(loop: VerifyLoop, prompts: list[list[int]], params: list[SamplingParams],
                       overrides: list[SpeculationOverrides | None] | None = None) -> list[Generation]:
    """Every prompt through the loop at once (continuous batching up to the engine's max_batch)."""
    async def one(prompt, sp, o) -> Generation:
        out = Generation([], None, {})
        async for chunk in loop.generate(prompt, sp, overrides=o):
            out.token_ids += chunk.token_ids
            if chunk.finished:
                out.finish_reason, out.stats = chunk.finish_reason, chunk.usage or {}
        return out

    overrides = overrides or [None] * len(prompts)
    return list(await asyncio.gather(*(one(p, sp, o) for p, sp, o in zip(prompts, params, overrides))))
