"""The contracts between the engines and their callers, written down: protocols and the types they exchange.

- `DrafterRunner`: what a drafter engine needs from the runner under it (per-request KV caches, batched forward
  steps, rollback). `runner.LlamaRunner` (the fast path, its own layers over a preallocated cache) and
  `transformers_runner.TransformersRunner` (any causal LM, through the model's own forward) implement it;
  `drafter_runners.make_drafter_runner` picks one by the model's architecture.
- `DraftingEngine`: what the drafting tier uses of a drafter engine (`drafter.DrafterEngine`,
  `cascade.CascadeDrafterEngine`, and the model-free `ngram_drafter.NgramDrafterEngine` and
  `suffix_drafter.SuffixDrafterEngine`, whose `model` and `runner` are None), and `Proposal`, what its steps
  return.
- `VerifierEngine`: what the verify loop (speculation/loop.py) asks of a verifier engine: `verifier.py` (the torch
  engine, trees), `vllm_engine.py` (our drafts verified inside vLLM) and `collaborative.py` (CoS) implement it.
  `StepOutput`, `RequestCounts` and `check_prompt` are shared by them.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from engines.draft_tree import Draft
from engines.sampling import SamplingParams

if TYPE_CHECKING:
    from engines.stopping import StopChecker


class CacheFull(RuntimeError):
    """A runner has no free slot for another request, or a request's context would exceed its `max_len`."""


@runtime_checkable
class DrafterRunner(Protocol):
    """Forward passes of one model over many requests, each with its own KV cache.

    A request is added (`add`), then fed tokens by `forward`: their keys/values are written after the request's
    cached prefix but are part of its cache only once `commit` keeps them (uncommitted ones are dropped by the next
    `forward`, `commit` or `rollback`). `rollback` cuts committed tokens, which is how a drafter follows a context
    that diverged from what it drafted. The logits each step returns are on the host (the CPU), whatever `device`
    the model runs on, and must be what the model itself computes for those tokens after that prefix: the
    implementations are tested token for token against transformers' own greedy decoding.
    """

    max_len: int  # tokens a request's cache holds at most (its context plus the tokens being fed)
    max_slots: int  # requests held at once; `add` beyond it raises CacheFull
    device: torch.device  # where the model and its caches live
    vocab_size: int
    kv_cache_bytes: int  # the most memory the requests' keys/values take (all slots at max_len)
    forward_seconds: float  # wall time spent in `forward`, accumulated (benchmarks split it from orchestration)
    pads_prompts: bool  # prompts of different lengths in one `forward` cost one padded pass (else one each)

    def add(self, rid: str) -> None:
        """Take a slot for a new request with an empty cache; KeyError if present, CacheFull if none is free."""

    def release(self, rid: str) -> None:
        """Free the request's slot and cache (a request not present is ignored)."""

    def __contains__(self, rid: str) -> bool: ...

    def length(self, rid: str) -> int:
        """Committed tokens in the request's cache."""

    def tokens(self, rid: str) -> list[int]:
        """The committed tokens themselves (`length` of them); the caller must not modify the list."""

    def rollback(self, rid: str, length: int) -> None:
        """Keep only the first `length` committed tokens (ValueError past the current length)."""

    def forward(self, rids: list[str], inputs: list[list[int]], *,
                hidden_only_last: bool = False) -> list[torch.Tensor]:
        """One step over `rids`, request i fed the chain `inputs[i]` (at least one token) after its committed
        prefix: a [len(inputs[i]), vocab] tensor of logits per request on the host, or [1, vocab] for its last token
        only with `hidden_only_last`. CacheFull if a context would exceed `max_len`. The tokens' keys/values are
        written but not committed."""

    def commit(self, rid: str, new_tokens: list[int], keep: list[int]) -> None:
        """Make the last forward's tokens at indices `keep` part of the cache; drafters keep a prefix of the chain
        they fed (keep = [0, 1, ..., n - 1])."""

    def commit_all(self, rid: str, new_tokens: list[int]) -> None:
        """`commit` of every token the last forward fed."""


@dataclass
class Proposal:
    """A drafter's next token for one request."""

    token: int
    prob: float  # the drafter's probability of `token` (its confidence)
    top_tokens: list[int]
    top_probs: list[float]
    context_loglik: float | None = None  # mean log-probability of the fed tokens (when more than one was fed)


@runtime_checkable
class DraftingEngine(Protocol):
    """One drafter model drafting greedily for many requests; what a drafter server calls.

    A request's state is the context in the engine's cache plus the tokens it was told about but has not processed
    yet. `sync` makes a given full context the request's context (keeping the agreeing cached prefix: never wrong,
    at worst slower), `feed` appends tokens, `step` processes every listed request's pending tokens in one batched
    pass and proposes the next token for each, appending nothing (the caller decides what is fed next). Not
    re-entrant: one caller at a time.
    """

    name: str
    model: torch.nn.Module | None  # the transformers model it runs (latency fits time it); None: model-free
    runner: DrafterRunner | None
    max_requests: int  # requests it holds at once (the runner's slots; fewer than asked where the KV budget is less)
    kv_cache_bytes: int  # the most memory its requests' keys/values take
    states: Mapping[str, object]  # the requests it holds, by id
    forward_passes: int  # runner forward passes so far

    def sync(self, rid: str, context: list[int], tenant: str | None = None) -> None:
        """Make `context` the request's context (adding the request if new); CacheFull if it cannot fit.
        `tenant`: who sent the request (its API key's id), for an engine that keeps text across requests (the
        suffix drafter's tree of recent outputs, scoped per tenant); a request's first sync names it."""

    def feed(self, rid: str, tokens: list[int]) -> None:
        """Append tokens to the request's pending ones."""

    def release(self, rid: str) -> None:
        """Forget the request and free its cache."""

    def __contains__(self, rid: str) -> bool: ...

    def step(self, rids: list[str], want_loglik: bool = False, alternatives: bool = False) -> dict[str, Proposal]:
        """Process the pending tokens of `rids` (each needs at least one); the next-token proposal for each, with
        `context_loglik` where `want_loglik` and more than one token was pending (a model-free drafter: only for
        the requests it has a match for, never a log-likelihood). `alternatives`: its top tokens and their
        probabilities too (lockstep fusion's branches); without, a model drafter gives its token alone there."""

    def draft(self, rids: list[str], k: int | dict[str, int], alternatives: bool = False) -> dict[str, list[Proposal]]:
        """The greedy chain of up to k proposals per request (each fed back as the next input); shorter where the
        cache is full."""


@runtime_checkable
class VerifierEngine(Protocol):
    """The target's side of speculation: continuous batching of requests and lossless verification of their
    drafts. The loop calls every method from one task, in this order per step: `admit`, drafting for `draftable`
    requests (from their `context`), then `step` in a worker thread."""

    partial_steps: bool  # a step may verify part of the pool (the loop's pipeline halves); vLLM steps it whole
    drafts_itself: bool  # the engine drafts inside its step (CoS's partner): the loop sends it no drafts
    device: str  # where the target runs ("cpu", "cuda"): the verifier deployment's placement check reads it
    running: Mapping[str, object]  # the requests admitted and not finished, by id
    max_batch: int  # the most requests one step decodes
    last_step_tokens: int  # tokens the last verify forward fed, and its seconds: the goodput model's inputs
    last_verify_seconds: float
    # the thread `step` must run on, where the engine has one (vLLM's CPU worker steps on the thread that built it):
    # the loop submits `step` to it directly; None: the loop runs `step` on a thread of its own
    step_executor: Executor | None

    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str) -> str:
        """Queue a request. ValueError when it cannot be served (a prompt too long, a setting the engine does
        not apply): the loop fails that request alone."""

    def abort(self, rid: str) -> None:
        """Drop a request and free its cache (a client hung up)."""

    def has_unfinished(self) -> bool: ...

    def admit(self) -> None:
        """Move waiting requests into the running batch (the torch engine prefills their prompts here; vLLM
        admits inside its step), before the round that drafts for them."""

    def draftable(self) -> list[str]:
        """The requests the next step decodes: a draft for any other would not be verified."""

    def context(self, rid: str) -> list[int]:
        """Prompt and committed tokens: what the drafters continue."""

    def chain_of(self, draft: Draft) -> Draft:
        """What this engine verifies of a draft (vLLM: its best chain, at most k long): the loop drafts the
        next round ahead from the context this chain's full acceptance would give."""

    def step(self, drafts: dict[str, Draft | None] | None = None, only: set[str] | None = None) -> list[StepOutput]:
        """One verify step of the running requests (of `only`, where `partial_steps`); blocking (the loop runs
        it in a worker thread). The output of a greedy request is token for token the target's."""

    def finished_stats(self, rid: str) -> dict | None:
        """A finished request's counters (`RequestCounts.stats`: the OpenAI usage extras)."""


@dataclass
class StepOutput:
    """A request's result of one verifier step."""

    request_id: str
    new_token_ids: list[int]  # committed and emitted by this step (stops applied)
    num_draft_tokens: int  # draft nodes that were verified
    num_accepted_tokens: int  # draft nodes accepted
    accepted_drafters: list[str | None]
    finished: bool
    finish_reason: str | None
    text: str | None = None  # text so far, when stop strings are in use
    draft_depth: int = 0  # longest root-to-leaf path of the verified draft (its length as a chain)
    # per emitted token, where the request asked for logprobs (the vLLM engine only): {token id: the target's
    # log-probability}, the emitted token first, then the top ones (vLLM's order)
    logprobs: list[dict[int, float]] | None = None
    # with the request's first tokens, where it asked for prompt_logprobs (the vLLM engine only): per prompt token,
    # None for the first, then {token id: (the target's log-probability, its rank)}, the prompt token first
    prompt_logprobs: list[dict[int, tuple[float, int]] | None] | None = None


@dataclass
class RequestCounts:
    """A request's speculation counters, in both engines; `stats` gives them as the OpenAI usage extras."""

    generated: list[int] = field(default_factory=list)
    verify_steps: int = 0
    draft_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    drafters_used: set = field(default_factory=set)

    def verified(self, drafted: int, accepted: int, drafters) -> None:
        """One verify step; `drafted` 0: the request decoded without a draft."""
        self.verify_steps += 1
        if drafted:
            self.draft_steps += 1
            self.drafted += drafted
            self.accepted += accepted
            self.drafters_used.update(n for n in drafters if n)

    def stats(self) -> dict:
        return {
            "completion_tokens": len(self.generated),
            "verify_steps": self.verify_steps,
            "num_drafts": self.draft_steps,
            "num_draft_tokens": self.drafted,
            "num_accepted_tokens": self.accepted,
            # vLLM's definitions: 1 + accepted / drafts, accepted / drafted
            "mean_acceptance_length": 1 + self.accepted / self.draft_steps if self.draft_steps else 1.0,
            "draft_acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
            "drafters_used": sorted(self.drafters_used),
        }


@dataclass
class EngineRequest(RequestCounts):
    """A request in a verifier engine: its prompt, its stop conditions and its counters (engines add their own
    state: the torch engine's `_Request`)."""

    prompt: list[int] = field(default_factory=list)
    stop: StopChecker | None = None


def check_prompt(prompt_ids: list[int], max_len: int) -> None:
    """A verifier engine's admission check of a prompt."""
    if not prompt_ids:
        raise ValueError("empty prompt")
    if len(prompt_ids) >= max_len:
        raise ValueError(f"prompt of {len(prompt_ids)} tokens does not fit the context of {max_len}")


def common_prefix(cached: list[int], context: list[int], limit: int) -> int:
    """How many leading tokens `cached` and `context` share, at most `limit`: what a drafting engine's `sync` keeps.
    A drafter's cache is its last context plus the tokens it drafted, so the two agree but for a short tail: the head
    is compared as one slice (in C), the last `_SYNC_TAIL` walked (a walk of every token cost ~80 us per request and
    drafter per round at 2,000 tokens of context)."""
    start = max(0, limit - _SYNC_TAIL)
    if cached[:start] != context[:start]:
        start = 0
    while start < limit and cached[start] == context[start]:
        start += 1
    return start


_SYNC_TAIL = 32
