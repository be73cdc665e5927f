"""What a simulated run returns: each finished request (`Finished`) and the run's totals (`Result`), with the
aggregates the studies report (`Result.summary`)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from speculation.tiers import REMOTE


@dataclass
class Finished:
    rid: str  # the trace's request id, '#' and its arrival's number
    output: list[int]  # what the replayed verification committed
    arrival: float  # sent by its client
    started: float  # admitted into the running batch
    first: float
    end: float
    tokens: int
    passes: int
    rounds: int
    accepted: int


@dataclass
class Result:
    finished: list[Finished]
    makespan: float
    steps: int
    step_tokens: int
    drafter_gpu_seconds: float
    cost_usd: float
    replicas: list[tuple[float, int]]  # (time, drafter replicas running)
    ahead: tuple[int, int] = (0, 0)  # drafts made ahead of a step, and of them used
    tier_rounds: dict[str, int] = field(default_factory=dict)  # drafting rounds per tier (`drafting_tier: auto`)

    def summary(self, slo_ms_per_token: float | None = None) -> dict:
        """Aggregates of the run. Goodput counts the tokens of requests whose latency per token from sending
        met `slo_ms_per_token` (every request's without one)."""
        f = self.finished
        tokens = sum(r.tokens for r in f)
        good = sum(r.tokens for r in f if slo_ms_per_token is None
                   or 1000 * (r.end - r.arrival) <= slo_ms_per_token * r.tokens)
        rounds = sum(r.rounds for r in f)
        per_token = [(r.end - r.arrival) / r.tokens for r in f if r.tokens]
        tpot = [(r.end - r.first) / (r.tokens - 1) for r in f if r.tokens > 1]
        return {"requests": len(f), "tokens": tokens, "throughput_tok_s": tokens / max(self.makespan, 1e-9),
                "latency_ms_per_token": 1000 * statistics.fmean(per_token) if per_token else 0.0,
                # from admission: the time per token of a running request, queueing excluded (offline batches)
                "service_ms_per_token": 1000 * statistics.fmean((r.end - r.started) / r.tokens for r in f if r.tokens)
                if f else 0.0,
                "tpot_ms": 1000 * statistics.fmean(tpot) if tpot else 0.0,
                "ttft_ms": 1000 * statistics.fmean([r.first - r.arrival for r in f]) if f else 0.0,
                "mean_accepted_length": (sum(r.accepted for r in f) + rounds) / rounds if rounds else 1.0,
                "target_passes_per_token": sum(r.passes for r in f) / max(tokens, 1),
                "drafter_gpu_hours": self.drafter_gpu_seconds / 3600,
                "ahead_used_share": self.ahead[1] / self.ahead[0] if self.ahead[0] else 0.0,
                "remote_round_share": self.tier_rounds.get(REMOTE, 0) / max(1, sum(self.tier_rounds.values()))
                if self.tier_rounds else None,
                "usd_per_million_tokens": 1e6 * self.cost_usd / max(tokens, 1),
                "goodput_tok_s": good / max(self.makespan, 1e-9),
                "usd_per_million_good_tokens": 1e6 * self.cost_usd / good if good else None}
