"""The typed messages of one speculation round, the same in-process and across Ray Serve handles.

    Verifier --[DraftRequest]--> speculation cluster --[DrafterCall]--> Drafter
    Verifier <--{request id: Draft}-- speculation cluster <--DrafterReply--
    Verifier --[TokenChunk]--> ingress (one per request and verify step)

Plain dataclasses: Serve pickles them as they are, and there is no codec. Tokens proposed by drafters are
`engines.interface.Proposal`; drafts (chains or token trees) are `engines.draft_tree.Draft`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from config import RequestMode
from engines.draft_tree import Draft
from engines.interface import Proposal

__all__ = ["Draft", "DraftRequest", "DrafterCall", "DrafterReply", "Participation", "Proposal",
           "SpeculationOverrides", "TokenChunk"]


@dataclass(frozen=True)
class Participation:
    """How a request drafts a round: how many routed drafters, and whether they are fused in lockstep (the fused
    token fed back to every drafter at every depth) or one-shot (each drafter's own chain, fused after), or vote
    (Minions: each voter's own chain, the weighted-majority chain verified). `generalist`: the request drafts
    with the generalist drafter instead of its routed one, so that the round's requests share one drafter's
    batched steps (where drafters share hardware, every drafter a round uses costs a step per depth)."""

    drafters_per_request: int = 1
    lockstep: bool = False
    vote: bool = False
    generalist: bool = False

    def __str__(self) -> str:
        if self.vote:
            return f"{self.drafters_per_request} vote"
        if self.generalist:
            return "1 generalist"
        if self.drafters_per_request == 1:
            return "1"
        return f"{self.drafters_per_request} {'lockstep' if self.lockstep else 'one-shot'}"


@dataclass
class SpeculationOverrides:
    """A request's own bounds on speculation (the API's `speculation` field); None leaves the server's choice."""

    enabled: bool = True
    max_draft_tokens: int | None = None
    drafters: list[str] | None = None  # fixed drafters: no routing
    routing: Literal["router", "random"] = "router"
    lockstep: bool | None = None
    drafters_per_request: int | None = None
    mode: RequestMode | None = None  # None: the server's speculation.mode
    tenant: str | None = None  # who sent it (the ingress: its API key's id); scopes drafting across requests


@dataclass
class DraftRequest:
    """Verifier -> speculation cluster: draft up to `k` tokens deep for this request, at most `budget` tree nodes,
    continuing `context` (the committed tokens)."""

    request_id: str
    context: list[int]
    k: int
    budget: int
    participation: Participation = Participation()
    drafters: list[str] | None = None  # the request's fixed drafters (SpeculationOverrides.drafters)
    routing: Literal["router", "random"] = "router"
    # drafted ahead, while the verifier checks the draft `context` ends with (its full acceptance assumed): the
    # context is not all committed, so routing feedback waits for a round that starts from committed tokens
    ahead: bool = False
    wait_s: float | None = None  # how long the verifier waits for this round's drafts (None: draft_timeout_ms)
    verify_s: float | None = None  # the verifier's recent verify step (median, seconds): what a round's wait costs
    tenant: str | None = None  # SpeculationOverrides.tenant
    # the round's time prices its participation (the goodput controller's round model); a drafting tier clears it
    # for a round that is not on the tier a plan drafts on (the auto tier's warm-up and probes)
    priced: bool = True


@dataclass
class DraftRound:
    """Speculation cluster -> verifier: a round's drafts, by request id (a request left without one decodes a plain
    step), and whether a drafter's call in it failed or came late. A faulted round's time is the fault's (it waited
    for the call's deadline), not drafting's: the drafter sits out its next rounds (`DrafterHealth`), so the round
    prices nothing (one 5 s wait among rounds of a few ms fitted its participation so slow that no request drafted)."""

    drafts: dict[str, Draft] = field(default_factory=dict)
    faulted: bool = False


@dataclass
class DrafterCall:
    """Speculation cluster -> one drafter: continue `context` for `steps` tokens, each fed back as the next input
    (the drafter's whole chain from one call). `score_context` asks for the context's mean log-likelihood too
    (routing's cold start)."""

    request_id: str
    context: list[int]
    steps: int = 1
    score_context: bool = False
    tenant: str | None = None  # DraftRequest.tenant: a drafter that remembers outputs keeps them per tenant
    alternatives: bool = False  # each proposal's runner-up tokens too (lockstep fusion's branches), not its token alone


@dataclass
class DrafterReply:
    """One drafter's answer: each request's chain of proposals (requests it could not hold are missing), the
    time its engine spent (the rest of the call is hops and queueing), and which replica answered (the requests'
    home from now on)."""

    chains: dict[str, list[Proposal]]
    compute_ms: float = 0.0
    replica: str | None = None


@dataclass
class TokenChunk:
    """Verifier -> ingress: what one verify step committed for a request."""

    token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_drafters: list[str] = field(default_factory=list)
    usage: dict | None = None  # with the last chunk: the request's speculation statistics
    # when asked for (vLLM verifier): per token, {token id: the target's log-probability}, the token's own first
    logprobs: list[dict[int, float]] | None = None
    # once, with the first tokens, when asked for (vLLM verifier): per prompt token, None for the first, then
    # {token id: (the target's log-probability, its rank)}, the prompt token first (vLLM's prompt_logprobs)
    prompt_logprobs: list[dict[int, tuple[float, int]] | None] | None = None

    def extend(self, later: TokenChunk) -> None:
        """Append a later chunk of the same request (a whole request's chunks become one reply)."""
        self.token_ids += later.token_ids
        if later.logprobs is not None:
            self.logprobs = (self.logprobs or []) + later.logprobs
        if self.prompt_logprobs is None:
            self.prompt_logprobs = later.prompt_logprobs
        self.finished, self.finish_reason, self.usage = later.finished, later.finish_reason, later.usage
        self.num_draft_tokens += later.num_draft_tokens
        self.num_accepted_tokens += later.num_accepted_tokens
        self.accepted_drafters += later.accepted_drafters
