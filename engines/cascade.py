"""A drafter whose chains are themselves drafted by a smaller model: SpecRouter's multi-level chain.

assistant -> this drafter -> target: the assistant drafts a few tokens, this drafter verifies them in one batched
forward pass and keeps the agreeing prefix plus its own next token, until the chain is long enough. The chain is
exactly this drafter's greedy chain (the assistant only changes how many forward passes it costs), so to the
target it is the same deterministic proposal as before, and verification stays lossless. It pays when this
drafter is much closer to the target than the assistant but much slower: the bench target's own 10M original,
which predicts it almost perfectly, drafted for by a 2-layer domain drafter.
"""

from __future__ import annotations

import torch

from engines.drafter import DrafterEngine
from engines.interface import Proposal


class CascadeDrafterEngine(DrafterEngine):
    def __init__(self, model, assistant, name: str = "drafter", assistant_k: int = 4, max_requests: int = 64,
                 max_len: int | None = 2048, device: str | None = None, dtype: str = "auto", **kw):
        """`kw`: more `DrafterEngine` arguments, for this drafter (`runner`, `kv_cache_bytes`, ...). The assistant
        runs beside it, in the same dtype, on the runner "auto" picks, with as many request slots (its keys/values
        are not part of `kv_cache_bytes`)."""
        super().__init__(model, name=name, max_requests=max_requests, max_len=max_len, device=device, dtype=dtype,
                         **kw)
        self.assistant = DrafterEngine(assistant, name=f"{name}/assistant", max_requests=self.max_requests,
                                       max_len=max_len, device=device or self.runner.device.type, dtype=dtype,
                                       vocab_limit=self.vocab_limit)
        self.assistant_k = assistant_k
        self.assistant_accepted = 0  # the assistant's tokens this drafter kept, and those it drafted
        self.assistant_drafted = 0

    def release(self, rid: str) -> None:
        super().release(rid)
        if rid in self.assistant:
            self.assistant.release(rid)

    @torch.no_grad()
    def draft(self, rids: list[str], k: int | dict[str, int], alternatives: bool = False) -> dict[str, list[Proposal]]:
        """This drafter's greedy chains of up to k proposals, as `DrafterEngine.draft` returns them, in fewer
        forward passes: per pass, the assistant's chain of up to `assistant_k` tokens is checked and the agreeing
        prefix is kept with this drafter's own next token."""
        ks = k if isinstance(k, dict) else {r: k for r in rids}
        chains: dict[str, list[Proposal]] = {r: [] for r in rids}
        active = [r for r in rids if ks.get(r, 0) > 0]
        while active:
            # room: the cache must hold the pending tokens, the assistant's and the next one
            room = {r: self.runner.max_len - self.runner.length(r) - len(self.states[r].pending) - 1 for r in active}
            active = [r for r in active if room[r] > 0]
            if not active:
                break
            want = {r: min(self.assistant_k, ks[r] - len(chains[r]) - 1, room[r] - 1) for r in active}
            guessing = [r for r in active if want[r] > 0]
            for r in guessing:
                self.assistant.sync(r, self.runner.tokens(r) + self.states[r].pending)
            guesses = self.assistant.draft(guessing, want) if guessing else {}
            inputs = {r: self.states[r].pending + [p.token for p in guesses.get(r, [])] for r in active}
            logits = self.runner.forward(active, [inputs[r] for r in active])
            self.forward_passes += 1
            for r, lg in zip(active, logits):
                pending, guess = self.states[r].pending, [p.token for p in guesses.get(r, [])]
                base = len(pending) - 1  # the row that predicts the first token after the pending ones
                n = 0
                while n < len(guess) and int(lg[base + n, :self.vocab_limit].argmax()) == guess[n]:
                    n += 1
                self.assistant_drafted += len(guess)
                self.assistant_accepted += n
                self.runner.commit(r, inputs[r], list(range(len(pending) + n)))
                props = self._propose(lg[base:base + n + 1], alternatives)  # the kept guesses, then its own
                chains[r] += props
                self.states[r].pending = [props[-1].token] if len(chains[r]) < ks[r] else []
            active = [r for r in active if len(chains[r]) < ks[r]]
        return chains
