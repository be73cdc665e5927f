"""`routing`: which drafters draft each request."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from config.base import Strict


class RoutingSpec(Strict):
    """CoSine's routing (Eq. 1-3): per-request drafter scores from how well each drafter's tokens aligned with
    what the target committed, explore/exploit, and a cold start from the prompt's likelihood."""

    drafters_per_request: int = Field(2, ge=1, le=8, description="routed drafters per request and round (the "
                                      "most, when the goodput controller picks fewer); CoSine used 2-3")
    tau: float = Field(2.0, ge=1.0, description="accepted length (bonus included) below which a request explores")
    alpha: float = Field(0.3, ge=0, le=1, description="probability of a random pick per place while exploring")
    beta: float = Field(0.05, ge=0, le=1, description="probability of a random pick per place while exploiting")
    # fused drafters are scored on the same positions, so one round separates them little; 0.2 flipped close calls
    # on noise (own domain first at release 19/24 vs 21/24 over 12 tokens, 14/24 vs 17/24 over 128, same MAL)
    ema: float = Field(0.1, gt=0, le=1, description="weight of the newest round in a request's routing scores")
    cold_start_temperature: float = Field(0.5, gt=0, description="softmax temperature over the drafters' mean "
                                          "prompt log-likelihoods (a new request's first ranking)")
    generalist_margin: float = Field(0.5, ge=0, description="nats per prompt token by which a generalist drafter "
                                     "must out-explain every domain drafter to lead a new request's ranking")
    score_tokens: int | None = Field(
        64, ge=2, description="routing's cold start: every drafter scores at most this many of a new request's "
        "first context tokens, and only the routed drafters read the rest of a longer context (a long prompt, or a "
        "request first drafted after the guard held speculation off); null: every drafter reads the whole context")
    seed: int = Field(0, description="seed of the router's random picks")
    model_free_alone: float | None = Field(
        2.0, ge=0, description="with model-free drafters in the roster: a round asks them first, and where one's "
        "chain is expected to have at least this many tokens accepted (the sum over its depths of the product of its "
        "match confidences) the request's round is drafted by the model-free drafters alone, without the drafter "
        "models' forwards (Snowflake's hybrid of suffix and model drafts, chosen per step by the match's score); "
        "where every request's round could go without the models and the tokens they are expected to add (their "
        "recent acceptance over the weak matches') are worth less than the wait for their forwards (measured), the "
        "whole round goes without them; null: the model-free drafters join every round beside the models")
    chain_choice: Literal["score", "latency"] = Field(
        "score", description="a request drafting with one drafter (one chain): score: the top routing score; "
        "latency: SpecRouter's choice, the drafter with the least predicted time per accepted token from the "
        "request's measured acceptance of each drafter, each drafter's measured time per token (an assisted "
        "drafter, a multi-level chain, is cheaper per token) and the measured verify cycle (speculation/chains.py), "
        "among the router's pick, the chains the request has drafted with and those of the same drafter model "
        "(which share its acceptance; one not yet timed is tried once)")

    @model_validator(mode="after")
    def _alpha_above_beta(self):
        if self.alpha < self.beta:
            raise ValueError("routing.alpha (exploration) must be >= routing.beta (exploitation)")
        return self
