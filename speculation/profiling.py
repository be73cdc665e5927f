"""Offline step-latency profiling: the goodput model's step models fitted from timed engine steps on this machine
(`cosine profile`'s drafter seed, the bench's seeds, a drafter replica's step-cost profile for the autoscaler).
`profile_verifier`: a verifier engine (either kind) as the loop drives it (`cosine profile`)."""

from __future__ import annotations

from engines.runner import step_seconds
from speculation.latency import LinearLatency


def fit_verify_latency(model, batch: int, context: int = 128, news=(1, 3, 5, 9)) -> LinearLatency:
    """t(total tokens in the step) for a verifier running `batch` requests."""
    lat = LinearLatency()
    for b in sorted({1, batch}):
        for n in news:
            lat.samples.append((b * n, step_seconds(model, b, context, n)))
    lat.refit()
    return lat


def fit_draft_latency(model, batch: int, context: int = 128, make_runner=None) -> LinearLatency:
    """t(batch size) of one lockstep drafter step (one new token per request); `make_runner`: as `step_seconds`."""
    lat = LinearLatency()
    for b in sorted({1, max(1, batch // 2), batch}):
        lat.samples.append((b, step_seconds(model, b, context, 1, make_runner=make_runner)))
    lat.refit()
    return lat


def fit_step_latency(engine, batch: int, context: int = 128, vocab: int = 1000, steps: int = 8) -> LinearLatency:
    """t(batch size) of a drafting engine's one-token step, timed on repetitive random contexts (a model-free
    drafter's cost, which no model's step time gives); its test requests are released after."""
    import random
    import time

    rng = random.Random(0)
    lat = LinearLatency()
    for b in sorted({1, max(1, batch // 2), batch}):
        rids = [f"profile-{b}-{i}" for i in range(b)]
        for r in rids:
            text = [rng.randrange(3, vocab) for _ in range(context // 4)]
            engine.sync(r, (text * 4)[:context])
        t = time.perf_counter()
        for _ in range(steps):
            engine.step(rids)
        lat.samples.append((b, (time.perf_counter() - t) / steps))
        for r in rids:
            engine.release(r)
    lat.refit()
    return lat


def profile_verifier(engine, batches=(1, 4, 8), ks=(0, 2, 4), prompt_len: int = 128, steps: int = 4,
                     vocab: int = 1000) -> LinearLatency:
    """t(tokens in the step) of a verifier engine (either kind) as the loop drives it: `batches` requests, each
    with a draft of k tokens (random ones: verification costs the same whatever is accepted); prefill excluded."""
    import random

    from engines.draft_tree import Draft
    from engines.sampling import SamplingParams

    rng = random.Random(0)
    lat = LinearLatency()
    for b in batches:
        rids = [engine.add_request([rng.randrange(3, vocab) for _ in range(prompt_len)],
                                   SamplingParams(max_tokens=4 * steps * (max(ks) + 1) + 8, ignore_eos=True),
                                   request_id=f"profile-{b}-{i}") for i in range(b)]
        engine.admit()
        engine.step({})  # prefill
        for k in ks:
            for _ in range(steps):
                drafts = {r: Draft.chain([rng.randrange(3, vocab) for _ in range(k)]) for r in rids} if k else {}
                engine.step(drafts)
                lat.samples.append((engine.last_step_tokens, engine.last_verify_seconds))
        for r in rids:
            engine.abort(r)
    lat.refit()
    return lat
