"""The drafter engine: many requests at once, one KV cache each, batched one-token steps.

A request's state is the context in the drafter's cache plus `pending` tokens it has been told about but not yet
processed. `step` processes every listed request's pending tokens in one batched forward pass and returns what
the drafter would say next: its token, that token's probability, and (where asked) the top alternatives. The
caller decides what is appended next (`feed`): the drafter's own proposal when drafting a chain, or another token
chosen by fusion. `sync` brings a request to a given full context, keeping whatever prefix of its cache still
agrees; a drafter that never saw a request, or lost it, rebuilds it from the full context, never wrong, only
slower.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from engines.device_work import count
from engines.drafter_runners import make_drafter_runner, refuse_unless_causal_lm
from engines.interface import CacheFull, Proposal, common_prefix
from engines.runner import prefill_groups
from engines.verifier import load_causal_lm

log = logging.getLogger(__name__)

LONG_PENDING = 16  # pending runs longer than this (prompts) are prefilled apart from the short steps


# Per-token floor of the context log-likelihood used for routing's cold start: a token no drafter expects (a name,
# a number) says little about the domain, and unfloored a few of them decided the mean (own domain ranked first
# for 206 of 240 held-out 64-token prompts with the floor, 186 without).
LOGLIK_FLOOR = -8.0


def context_loglik(logits: torch.Tensor, tokens: list[int]) -> float:
    """How well a drafter knows the context (CoSine's cold start): the floored mean log-probability of `tokens`[1:]
    under `logits` [len(tokens), vocab], the drafter's logits after each fed token."""
    logp = torch.log_softmax(logits[:-1].float(), dim=-1)
    lp = logp.gather(-1, torch.tensor(tokens[1:])[:, None])
    return float(lp.clamp(min=LOGLIK_FLOOR).mean())


@dataclass
class _State:
    pending: list[int] = field(default_factory=list)


class DrafterEngine:
    """One drafter model, drafting greedily for many requests (its tokens are verified as deterministic
    proposals, which is lossless for sampling too). The `DraftingEngine` protocol (engines/interface.py)."""

    def __init__(self, model, name: str = "drafter", max_requests: int = 64, max_len: int | None = 2048,
                 top_alternatives: int = 4, device: str | None = None, runner: str = "auto", dtype: str = "auto",
                 kv_cache_bytes: int | None = None, vocab_limit: int | None = None, graphs: bool | None = None):
        """`model`: a causal LM, or its local directory (anything else is refused, saying why). `device`: where to
        load the model ("auto": a GPU if this process has one); None leaves a model object where it is. `dtype`: of
        a model loaded from its directory (`resolve_dtype`: "auto" is bf16 on a GPU, fp32 on a CPU). `runner`:
        "auto", "fast" or "transformers" (`make_drafter_runner`: the fast runner only for architectures tested
        equal to transformers). `kv_cache_bytes`: a budget for the requests' keys/values; the engine holds
        `max_requests` = min(max_requests, the requests it fits at max_len) (ValueError if none fits; None: no
        budget). `vocab_limit`: propose only token ids below it, the ids the target has (its probabilities are
        then over those ids; None: every id of the drafter's vocabulary). `graphs`: the fast runner's chain steps at
        padded shapes, CUDA graphs on a GPU (None: on CUDA; engines/graphs.py)."""
        refuse_unless_causal_lm(model)
        self.model = load_causal_lm(model, device, dtype)
        self.runner = make_drafter_runner(self.model, max_requests, max_len, runner, kv_cache_bytes, graphs)
        self.max_requests = self.runner.max_slots
        self.kv_cache_bytes = self.runner.kv_cache_bytes  # the most the requests' keys/values take
        budget = f" (budget {kv_cache_bytes} bytes)" if kv_cache_bytes is not None else ""
        log.info("drafter %s: %s for %s on %s, %d request slots at max_len %d, KV cache %d bytes%s", name,
                 type(self.runner).__name__, self.model.config.model_type, self.runner.device, self.max_requests,
                 self.runner.max_len, self.kv_cache_bytes, budget)
        self.name = name
        self.vocab_limit = vocab_limit
        self.top_alternatives = top_alternatives
        self.states: dict[str, _State] = {}
        self.forward_passes = 0

    # ------------------------------------------------------------------ request state
    def sync(self, rid: str, context: list[int], tenant: str | None = None) -> None:
        """Make `context` the request's context: keep the agreeing cached prefix, queue the rest. `tenant`: unused
        (a model drafter keeps nothing of a request once it is released)."""
        if len(context) + 1 > self.runner.max_len:
            raise CacheFull(f"context of {len(context)} tokens exceeds {self.runner.max_len}")
        if rid not in self.states:
            self.runner.add(rid)
            self.states[rid] = _State()
        cached = self.runner.tokens(rid)
        common = common_prefix(cached, context, min(len(cached), len(context) - 1))  # one token left to step
        self.runner.rollback(rid, common)
        self.states[rid].pending = list(context[common:])

    def feed(self, rid: str, tokens: list[int]) -> None:
        self.states[rid].pending.extend(tokens)

    def release(self, rid: str) -> None:
        self.states.pop(rid, None)
        self.runner.release(rid)

    def __contains__(self, rid: str) -> bool:
        return rid in self.states

    # ------------------------------------------------------------------ steps
    @torch.no_grad()
    def step(self, rids: list[str], want_loglik: bool = False, alternatives: bool = False) -> dict[str, Proposal]:
        """One batched forward over the pending tokens of `rids`; a proposal for each. `alternatives`: each
        proposal's top `top_alternatives` tokens too (lockstep fusion's branches); otherwise only its token."""
        out: dict[str, Proposal] = {}
        long = [r for r in rids if len(self.states[r].pending) > LONG_PENDING]
        short = [r for r in rids if len(self.states[r].pending) <= LONG_PENDING]
        prompts = prefill_groups(long, lambda r: len(self.states[r].pending), self.runner.pads_prompts)
        for group in prompts + ([short] if short else []):
            inputs = [self.states[r].pending for r in group]
            full = want_loglik and any(len(x) > 1 for x in inputs)
            logits = self.runner.forward(group, inputs, hidden_only_last=not full)
            self.forward_passes += 1
            count(drafter_forwards=1)
            last = torch.stack([lg[-1] for lg in logits]) if full else torch.cat(logits)
            proposals = self._propose(last, alternatives)
            for r, x, lg, proposal in zip(group, inputs, logits, proposals):
                self.runner.commit_all(r, x)
                self.states[r].pending = []
                out[r] = proposal
                if full and len(x) > 1:
                    out[r].context_loglik = context_loglik(lg, x)
        return out

    def _propose(self, logits: torch.Tensor, alternatives: bool = True) -> list[Proposal]:
        """A proposal from each row of `logits` [n, vocab], all rows in one pass (a step's requests together).
        Without `alternatives`, a proposal's top tokens are its own token alone (no top-k over the vocabulary)."""
        q = torch.softmax(logits[:, :self.vocab_limit].float(), dim=-1)
        probs, tokens = q.max(-1)  # the most likely token and its probability in one pass (argmax and gather: two)
        if not alternatives:
            return [Proposal(t, p, [t], [p]) for t, p in zip(tokens.tolist(), probs.tolist())]
        top_p, top_i = q.topk(self.top_alternatives, dim=-1)
        return [Proposal(t, p, i, tp) for t, p, i, tp in
                zip(tokens.tolist(), probs.tolist(), top_i.tolist(), top_p.tolist())]

    def draft(self, rids: list[str], k: int | dict[str, int], alternatives: bool = False) -> dict[str, list[Proposal]]:
        """Chains of up to k proposals per request, each fed back as the next input (`alternatives`: as in `step`)."""
        ks = k if isinstance(k, dict) else {r: k for r in rids}
        chains: dict[str, list[Proposal]] = {r: [] for r in rids}
        active = [r for r in rids if ks.get(r, 0) > 0]
        for i in range(max(ks.values(), default=0)):
            active = [r for r in active if len(chains[r]) < ks[r]
                      and self.runner.length(r) + len(self.states[r].pending) + 1 < self.runner.max_len]
            if not active:
                break
            props = self.step(active, alternatives=alternatives)
            for r, p in props.items():
                chains[r].append(p)
                if len(chains[r]) < ks[r]:
                    self.feed(r, [p.token])
        return chains
