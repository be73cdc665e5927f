"""CoS collaborative decoding: outputs distributed as a combination of two models, computed with speculation.

Collaborative decoding samples every token from r = C(q, p), a combination of a partner model's next-token
distribution q and the target's p: a weighted ensemble (r = w q + (1 - w) p, each model's distribution processed by
temperature, top-k and top-p first) or contrastive decoding (r = process(l_p - mu l_q) on the raw logits, the
target the expert and the partner the amateur). Token by token that costs a forward pass of each model per token.

CoS (Fu et al., ICML 2025) computes the same r with speculation. The partner (the smaller model) drafts k tokens
from its own processed distribution d, keeping each position's logits; the target scores them all in one pass;
each draft is checked against r at its position with the generalized rule min(1, r(x) / d(x)) and a residual
draw from norm(max(0, r - d)) (`verify_token`), so every output token follows r exactly, and the partner's logits
are reused in r instead of a second partner pass. After a full accept, the alternate proposal framework (APF,
`alternate`) draws a bonus token from the target's next distribution p: the target proposes it, the partner
verifies it against r at the start of the next cycle (the same pass in which it starts drafting after it), so a
cycle can yield k + 1 tokens. Without APF (naive CoS) the target's next distribution is discarded.

Greedy decoding (temperature 0) follows the argmax of the combination at temperature 1.

KV caches: the target's holds every committed token but the last one (fed with the next drafts); the partner's
holds the committed tokens but those in `pending`. A drafted token is in the partner's cache once the next draft
was computed from it, and rolled back with the target's rejection.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from engines.graphs import VERIFIER
from engines.interface import StepOutput
from engines.rules import verify_token
from engines.runner import LlamaRunner, prefill
from engines.sampling import SamplingParams, target_probs
from engines.verifier import TorchVerifierEngine, load_causal_lm

PARTNER, TARGET = "partner", "target"  # who proposed a token (per-proposer statistics)


@dataclass(frozen=True)
class Combination:
    """C(q, p): how the partner's logits and the target's make the distribution the output follows."""

    kind: Literal["ensemble", "contrastive"] = "ensemble"
    weight: float = 0.5  # ensemble: the partner's weight w
    mu: float = 0.1  # contrastive: how much of the partner's logits is subtracted

    def __post_init__(self):
        if self.kind not in ("ensemble", "contrastive"):
            raise ValueError(f"unknown combination {self.kind!r}")
        if not 0 <= self.weight <= 1 or self.mu < 0:
            raise ValueError("weight must be in [0, 1] and mu >= 0")

    def probs(self, partner_logits: torch.Tensor, target_logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """r over the vocabulary (greedy: one-hot on the argmax of the combination at temperature 1)."""
        if self.kind == "contrastive":
            return target_probs(target_logits.float() - self.mu * partner_logits.float(), params)
        if params.greedy:
            mix = self.weight * torch.softmax(partner_logits.float(), -1) + \
                (1 - self.weight) * torch.softmax(target_logits.float(), -1)
            return target_probs(mix.log(), params)
        return self.weight * target_probs(partner_logits, params) + \
            (1 - self.weight) * target_probs(target_logits, params)


@dataclass
class _Cycle:
    """A request's collaborative state between steps."""

    pending: list[int]  # committed tokens not yet in the partner's cache
    # APF: the target's proposed token, the distribution it was drawn from and the logits behind it
    bonus: tuple[int, torch.Tensor, torch.Tensor] | None = None
    drafts: list[int] = field(default_factory=list)  # this step's partner drafts, with the distribution each was
    draft_probs: list[torch.Tensor] = field(default_factory=list)  # drawn from and the logits behind it
    draft_logits: list[torch.Tensor] = field(default_factory=list)
    verdict: list[int] = field(default_factory=list)  # this step's token from the bonus check (committed)
    bonus_accepted: bool = False
    base: int = 0  # the partner's cache length before this step's drafts


class CollaborativeEngine(TorchVerifierEngine):
    """A verifier engine whose outputs follow `combination` of a co-located partner model and the target. `k`: the
    partner's draft length per cycle (0: token-by-token collaborative decoding, the baseline); `alternate`: APF.
    Drafts sent by the loop are ignored: the partner, which must share the target's vocabulary, drafts here. A
    request may draft less (`add_request`'s `max_draft_tokens`; 0: token by token): r, and so the output's
    distribution, is the same at every k."""

    drafts_itself = True

    def __init__(self, model, partner, combination: Combination = Combination(), k: int = 4, alternate: bool = True,
                 max_batch: int = 16, max_len: int | None = 2048, tokenizer=None,
                 eos_token_ids: tuple[int, ...] | None = None, device: str | None = None):
        super().__init__(model, max_batch=max_batch, max_len=max_len, tokenizer=tokenizer,
                         eos_token_ids=eos_token_ids, device=device)
        partner = load_causal_lm(partner, device or self.device)
        if partner.config.vocab_size != self.model.config.vocab_size:
            raise ValueError("collaborative decoding needs one vocabulary: the partner has "
                             f"{partner.config.vocab_size} tokens, the target {self.model.config.vocab_size}")
        # it steps on the verifier's thread, between the target's steps: the verifier's stream
        self.partner = LlamaRunner(partner, max_slots=max_batch, max_len=self.max_len, role=VERIFIER)
        if self.partner.graphs is not None:  # as the target's: every bucket captured now, none while serving
            for hidden_only_last in (False, True):
                self.partner.graphs.capture(hidden_only_last)
        self.combination = combination
        self.k = k
        self.alternate = alternate
        self.cycles: dict[str, _Cycle] = {}
        self.caps: dict[str, int] = {}  # the requests drafting less than k
        self.partner_passes = 0

    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
                    max_draft_tokens: int | None = None) -> str:
        rid = super().add_request(prompt_ids, params, request_id)
        if max_draft_tokens is not None and max_draft_tokens < self.k:
            self.caps[rid] = max_draft_tokens
        return rid

    def _admit(self) -> None:
        super()._admit()
        joining = {}
        for rid, req in self.running.items():
            if rid not in self.cycles:
                self.partner.add(rid)
                if len(req.prompt) > 1:
                    joining[rid] = req.prompt[:-1]
                self.cycles[rid] = _Cycle(pending=[req.prompt[-1]])
        self.partner_passes += prefill(self.partner, joining)

    def abort(self, rid: str) -> None:
        super().abort(rid)
        self._release_partner(rid)

    def _retire(self, rid: str) -> None:
        super()._retire(rid)
        self._release_partner(rid)

    def _release_partner(self, rid: str) -> None:
        self.cycles.pop(rid, None)
        self.caps.pop(rid, None)
        self.partner.release(rid)

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self, drafts=None, only: set[str] | None = None) -> list[StepOutput]:
        """One cycle for every running request (or those in `only`): token by token, or partner drafts verified."""
        self._admit()
        self.last_step_tokens = 0
        rids = [r for r in self.running if only is None or r in only]
        one_by_one = [r for r in rids if self._k(r) == 0]
        rids = [r for r in rids if self._k(r)]
        outs = self._token_by_token(one_by_one) if one_by_one else []
        if not rids:
            return outs
        room = self._draft(rids)
        for r in rids:  # no room left (its tokens, or the context): it ends without a target pass
            if not room[r]:
                c = self.cycles[r]
                outs.append(self._emit(r, c.verdict, len(c.verdict), int(c.bonus_accepted),
                                       [TARGET] * c.bonus_accepted, len(c.verdict), out_of_room=True))
        drafting = [r for r in rids if room[r]]
        return outs + (self._verify(drafting) if drafting else [])

    def _k(self, rid: str) -> int:
        return self.caps.get(rid, self.k)

    def _room(self, rid: str) -> int:
        req = self.running[rid]
        c = self.cycles[rid]
        left = req.params.max_tokens - len(req.generated) - len(c.verdict)
        return max(0, min(self._k(rid), left, self.max_len - self.runner.length(rid) - 3,
                          self.max_len - self.partner.length(rid) - len(c.pending) - 3))

    def _draft(self, rids: list[str]) -> dict[str, int]:
        """The partner's passes: the pending bonus checked against r where there is one, then up to k drafts each
        from the partner's processed distribution, in batched passes (requests drop out as their drafts are done).
        Returns each request's room: the drafts it may have this step (0: it ends this step)."""
        feed, room = {}, {}
        for r in rids:
            c = self.cycles[r]
            c.drafts, c.draft_probs, c.draft_logits, c.verdict, c.bonus_accepted = [], [], [], [], False
            if c.bonus is None and not self._room(r):
                room[r] = 0
                continue
            feed[r] = c.pending + ([c.bonus[0]] if c.bonus else [])
        while feed:
            active = list(feed)
            logits = self.partner.forward(active, [feed[r] for r in active])
            self.partner_passes += 1
            for r, rows in zip(active, logits):
                c, req = self.cycles[r], self.running[r]
                fed = feed.pop(r)
                if c.bonus is not None:
                    token, p, target_logits = c.bonus
                    c.bonus = None
                    at = len(c.pending) - 1  # the partner's row for the bonus position
                    ok, y = verify_token(token, p,
                                         self.combination.probs(rows[at], target_logits, req.params),
                                         None if req.params.greedy else req.gen)
                    c.verdict, c.bonus_accepted = [y], ok
                    room[r] = self._room(r)
                    if not ok:  # the row after the bonus is void: the correction is fed next
                        self.partner.commit(r, fed, list(range(len(c.pending))))
                        c.pending = [y]
                        if room[r]:
                            feed[r] = [y]
                        continue
                self.partner.commit_all(r, fed)
                c.pending = []
                room.setdefault(r, self._room(r))
                if not room[r]:
                    continue
                if not c.drafts:
                    c.base = self.partner.length(r)
                d = target_probs(rows[-1], req.params)
                x = _draw(d, req)
                c.drafts.append(x)
                c.draft_probs.append(d)
                c.draft_logits.append(rows[-1])
                if len(c.drafts) < room[r]:
                    feed[r] = [x]
                else:
                    c.pending = [x]
        return room

    def _verify(self, rids: list[str]) -> list[StepOutput]:
        """One target pass over every request's drafts, each checked against r at its position."""
        inputs = [[self.cycles[r].verdict[-1] if self.cycles[r].verdict else self.running[r].last_token]
                  + self.cycles[r].drafts for r in rids]
        logits = self.runner.forward(rids, inputs)
        self.forward_passes += 1
        self.last_step_tokens += sum(len(x) for x in inputs)
        outs = []
        for r, x, rows in zip(rids, inputs, logits):
            c, req = self.cycles[r], self.running[r]
            gen = None if req.params.greedy else req.gen
            accepted, extra = 0, None
            for j, (tok, d, q) in enumerate(zip(c.drafts, c.draft_probs, c.draft_logits)):
                ok, y = verify_token(tok, d, self.combination.probs(q, rows[j], req.params), gen)
                if not ok:
                    extra = y
                    break
                accepted += 1
            k = len(c.drafts)
            if extra is not None:  # rejected: both caches keep the accepted drafts, the correction comes next
                self.runner.commit(r, x, list(range(accepted + 1)))
                self.partner.rollback(r, c.base + accepted)
                c.pending = [extra]
                req.last_token = extra
                committed = c.verdict + c.drafts[:accepted] + [extra]
            elif self.alternate:  # APF: the target proposes the next token, the partner checks it next cycle
                self.runner.commit_all(r, x)
                p = target_probs(rows[k], req.params)
                c.bonus = (_draw(p, req), p, rows[k])
                committed = c.verdict + c.drafts
            else:  # naive CoS: the target's next distribution is dropped; the last draft is fed again next cycle
                self.runner.commit(r, x, list(range(k)))
                req.last_token = c.drafts[-1]
                committed = c.verdict + c.drafts
            bonus_ok = bool(c.verdict) and c.bonus_accepted
            names = [TARGET] * bonus_ok + [PARTNER] * accepted
            outs.append(self._emit(r, committed, k + bool(c.verdict), accepted + bonus_ok, names, k))
        return outs

    def _token_by_token(self, rids: list[str]) -> list[StepOutput]:
        """The baseline: a pass of each model per token, the token drawn from r."""
        partner = self.partner.forward(rids, [self.cycles[r].pending for r in rids], hidden_only_last=True)
        target = self.runner.forward(rids, [[self.running[r].last_token] for r in rids])
        self.partner_passes += 1
        self.forward_passes += 1
        self.last_step_tokens += len(rids)
        outs = []
        for r, q, p in zip(rids, partner, target):
            c, req = self.cycles[r], self.running[r]
            self.partner.commit_all(r, c.pending)
            self.runner.commit_all(r, [req.last_token])
            y = _draw(self.combination.probs(q[-1], p[-1], req.params), req)
            c.pending, req.last_token = [y], y
            outs.append(self._emit(r, [y], 0, 0, [], 0))
        return outs


def _draw(probs: torch.Tensor, req) -> int:
    """A token from `probs` with the request's generator (greedy: the argmax, no draw)."""
    return int(probs.argmax()) if req.params.greedy else int(torch.multinomial(probs, 1, generator=req.gen))
