"""Acceptance replayed from a trace of real runs.

A trace holds each request's prompt and the target's output (greedy). Every drafter is run once over prompt +
output, teacher-forced: its top tokens and probabilities at each output position are what it would propose there
from the target's own prefix. While a draft follows the target's prefix the replay is exact (the drafter's cache
would hold exactly that prefix); once a drafter's own token differs, its further tokens were conditioned on a
token the target rejects, so they can never be accepted: the teacher-forced ones stand in for them (they still
take tree budget, compete in fusion and enter routing scores as plausible guesses). The coordinator,
router and fusion run unchanged on these proposals, and the drafts are verified by the engines' own greedy rule.
Sampling is not replayed: its acceptance is random where greedy acceptance is a function of the trace.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from config import AppConfig
from engines.draft_tree import Draft
from engines.drafter import LOGLIK_FLOOR
from engines.interface import Proposal
from engines.rules import verify_greedy
from speculation.messages import DrafterCall

TOP = 4  # alternatives per position, as DrafterEngine proposes


@dataclass
class Predictions:
    """One drafter on one request: at output position j, its top tokens and probabilities for output[j]."""

    tokens: np.ndarray  # [len(output), TOP]
    probs: np.ndarray
    prompt_loglik: float  # mean log-probability of the prompt (cold-start routing), floored per token


@dataclass
class ReplayRequest:
    rid: str
    prompt: list[int]
    output: list[int]
    preds: dict[str, Predictions]
    domain: str | None = None

    @property
    def full(self) -> list[int]:
        return self.prompt + self.output


@torch.no_grad()
def annotate(records: list[dict], cfg: AppConfig) -> list[ReplayRequest]:
    """Teacher-force every configured drafter over each recorded request (`records`: a trace's request records,
    with a `domain` where the recording knew it)."""
    from engines.verifier import load_causal_lm
    from model_family.sources import resolve_model

    model_free = [d.name for d in cfg.drafters if d.model_free]
    if model_free:
        raise ValueError(f"cosine simulate replays drafter models only; drafters {model_free} are model-free "
                         "(n-gram, suffix): leave them out of the simulated configuration")
    reqs = [ReplayRequest(r["id"], list(r["prompt"]), list(r["output"]), {}, r.get("domain"))
            for r in records if r["output"]]
    for spec in cfg.drafters:
        model = load_causal_lm(str(resolve_model(spec.model)))
        for req in reqs:
            ids = torch.tensor([req.full[:spec.max_len]])
            logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
            n_prompt = len(req.prompt)
            out = logp[n_prompt - 1:n_prompt - 1 + len(req.output)]
            top_p, top_i = out.exp().topk(TOP, dim=-1)
            lp = logp[:n_prompt - 1].gather(-1, ids[0, 1:n_prompt, None]).clamp(min=LOGLIK_FLOOR)
            req.preds[spec.name] = Predictions(top_i.numpy(), top_p.numpy(), float(lp.mean()) if n_prompt > 1 else 0.0)
    return reqs


def sharpened(requests: list[ReplayRequest], drafters: set[str], share: float, seed: int = 0) -> list[ReplayRequest]:
    """The requests with `drafters` made better: at a `share` of the output positions where one's top token is not
    the target's, the target's token takes its place (with the top token's probability). A what-if for the margin
    specialists hold over a generic drafter; the others' proposals are as replayed."""
    rng = np.random.default_rng(seed)
    out = []
    for req in requests:
        preds = dict(req.preds)
        for name in drafters & preds.keys():
            p = preds[name]
            tokens = p.tokens.copy()
            fix = (tokens[:, 0] != np.array(req.output)) & (rng.random(len(req.output)) < share)
            tokens[fix, 0] = np.array(req.output)[fix]
            preds[name] = Predictions(tokens, p.probs, p.prompt_loglik)
        out.append(ReplayRequest(req.rid, req.prompt, req.output, preds, req.domain))
    return out


@dataclass
class ReplayState:
    """A request being replayed: what of its output is committed."""

    req: ReplayRequest
    output: list[int] = field(default_factory=list)  # committed so far
    passes: int = 0  # verify steps it was in
    rounds: int = 0  # of them with a draft
    accepted: int = 0  # draft tokens accepted

    @property
    def committed(self) -> int:
        return len(self.output)

    @property
    def context(self) -> list[int]:
        return self.req.prompt + self.output

    @property
    def done(self) -> bool:
        return self.committed >= len(self.req.output)


@dataclass
class Replayer:
    """The drafters' answers (a `step_fn` for the coordinator) and the target's verification, from the trace."""

    states: dict[str, ReplayState] = field(default_factory=dict)
    calls: list[tuple[str, str, int, int]] = field(default_factory=list)  # (drafter, rid, depth, steps) this round
    bases: dict[str, int] = field(default_factory=dict)  # each request's context length when its round began

    def start_round(self, batch) -> None:
        self.calls.clear()
        self.bases = {d.request_id: len(d.context) for d in batch}
    async def step_fn(self, name: str, calls: list[DrafterCall]) -> dict[str, list[Proposal]]:
        out = {}
        for call in calls:
            st = self.states[call.request_id]
            preds = st.req.preds[name]
            self.calls.append((name, call.request_id, len(call.context) - self.bases[call.request_id], call.steps))
            j = len(call.context) - len(st.req.prompt)  # output position of the first proposal
            chain = []
            for i in range(call.steps):  # past the output's end: its last position's (never verified)
                pos = min(j + i, len(st.req.output) - 1)
                chain.append(Proposal(int(preds.tokens[pos, 0]), float(preds.probs[pos, 0]),
                                      preds.tokens[pos].tolist(), preds.probs[pos].tolist()))
            if call.score_context:
                chain[0].context_loglik = preds.prompt_loglik
            out[call.request_id] = chain
        return out

    def verify(self, rid: str, draft: Draft | None) -> tuple[list[int], int, int]:
        """Commit what the target would for `draft`: (tokens, accepted draft tokens, the draft's depth)."""
        st = self.states[rid]
        out, at = st.req.output, st.committed
        room = len(out) - at - 1  # as the engines do: no draft beyond the request's last token
        if draft is not None and len(draft) > room:
            draft = draft.truncated(room) if room > 0 else None
        depth_of: list[int] = []
        if draft is not None:
            for p in draft.parents:
                depth_of.append(0 if p < 0 else depth_of[p] + 1)

        def argmax_at(j: int) -> int:
            pos = at + (0 if j < 0 else depth_of[j] + 1)
            return out[pos] if pos < len(out) else -1

        path, tok = verify_greedy(draft, argmax_at)
        tokens = [draft.tokens[j] for j in path] + [tok]
        st.output += tokens
        st.passes += 1
        depth = max(depth_of, default=-1) + 1
        if depth:
            st.rounds += 1
            st.accepted += len(path)
        return tokens, len(path), depth
