"""Acceptance matrix: every drafter against the target on every domain's held-out prompts.

Greedy verification is deterministic: at every round the target accepts the longest prefix of the draft that
equals its own greedy continuation, then adds its own next token (the bonus/correction). So the target's greedy
continuation is computed once per prompt, and each drafter is run exactly as a chain drafter would be: it
drafts k tokens greedily from the committed context, the matching prefix plus one token is committed, repeat.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from model_family.distill import greedy_continue


@dataclass
class Acceptance:
    mean_accepted_length: float  # tokens committed per verification, bonus token included
    acceptance_rate: float  # accepted draft tokens / drafted tokens
    verifications: int


def held_out_prompts(stream: np.ndarray, n: int, length: int, seed: int) -> torch.Tensor:
    """Prompts starting at document boundaries of the held-out stream (EOS marks them)."""
    starts = np.flatnonzero(stream[:-length] == 0)
    rng = np.random.default_rng(seed)
    picks = rng.choice(starts, size=min(n, len(starts)), replace=False)
    return torch.from_numpy(np.stack([stream[s:s + length] for s in sorted(picks)]).astype(np.int64))


def held_out_sequences(models_dir, domains, n_prompts: int = 24, prompt_len: int = 64, new_tokens: int = 64,
                       seed: int = 1234) -> dict[str, torch.Tensor]:
    """The acceptance matrix's evaluation: per domain, the target's greedy continuations of held-out prompts."""
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from model_family.samples import heldout_streams

    test = heldout_streams(models_dir, AutoTokenizer.from_pretrained(models_dir / "tokenizer"))
    target = AutoModelForCausalLM.from_pretrained(models_dir / "target", dtype=torch.float32).eval()
    return {d: target_continuations(target, held_out_prompts(test[d], n_prompts, prompt_len, seed), new_tokens)
            for d in tqdm(domains, desc="target continuations")}


@torch.no_grad()
def target_continuations(target, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    return greedy_continue(target, prompts, new_tokens)


@torch.no_grad()
def _draft(drafter, contexts: list[torch.Tensor], k: int) -> torch.Tensor:
    """k greedy tokens for each context (right-padded batch; causal attention ignores the padding)."""
    lens = torch.tensor([len(c) for c in contexts])
    width = int(lens.max()) + k
    batch = torch.zeros(len(contexts), width, dtype=torch.long)
    for i, c in enumerate(contexts):
        batch[i, :len(c)] = c
    rows = torch.arange(len(contexts))
    out = []
    for j in range(k):
        hidden = drafter.model(input_ids=batch[:, :int(lens.max()) + j]).last_hidden_state
        nxt = drafter.lm_head(hidden[rows, lens + j - 1]).argmax(-1)  # the LM head only where it is needed
        batch[rows, lens + j] = nxt
        out.append(nxt)
    return torch.stack(out, dim=1)


@torch.no_grad()
def measure(drafter, sequences: torch.Tensor, prompt_len: int, k: int = 4) -> Acceptance:
    """Simulate greedy chain speculation of `drafter` against target continuations `sequences`."""
    n, total = sequences.shape
    pos = torch.full((n,), prompt_len)
    accepted_sum = drafted_sum = verifications = committed_sum = 0
    while True:
        active = [i for i in range(n) if pos[i] < total]
        if not active:
            break
        draft = _draft(drafter, [sequences[i, :pos[i]] for i in active], k)
        for row, i in enumerate(active):
            remaining = total - int(pos[i])
            kk = min(k, remaining - 1) if remaining > 1 else 0
            truth = sequences[i, pos[i]:pos[i] + kk]
            match = (draft[row, :kk] == truth).long()
            acc = int(match.cumprod(0).sum()) if kk else 0
            accepted_sum += acc
            drafted_sum += kk
            committed_sum += acc + 1
            verifications += 1
            pos[i] += acc + 1
    return Acceptance(committed_sum / verifications, accepted_sum / max(1, drafted_sum), verifications)


def copy_mask(sequences: torch.Tensor, prompt_len: int, window: int = 128) -> torch.Tensor:
    """For every continuation token: whether it already occurs among the `window` tokens before it (a copy, which
    any drafter that has learned to copy predicts) rather than a token new to the context."""
    n, total = sequences.shape
    mask = torch.zeros(n, total - prompt_len, dtype=torch.bool)
    for j in range(prompt_len, total):
        before = sequences[:, max(0, j - window):j]
        mask[:, j - prompt_len] = (before == sequences[:, j:j + 1]).any(-1)
    return mask


@torch.no_grad()
def agreement_by_kind(drafter, sequences: torch.Tensor, prompt_len: int) -> dict:
    """Teacher-forced agreement of the drafter's argmax with the target's continuation, on copied tokens and on
    tokens new to the context, with the share of copies: where a domain drafter can beat a generic one."""
    right = drafter(input_ids=sequences[:, :-1]).logits[:, prompt_len - 1:].argmax(-1) == sequences[:, prompt_len:]
    copies = copy_mask(sequences, prompt_len)
    return {"copy_share": round(copies.float().mean().item(), 3),
            "copy": round(right[copies].float().mean().item(), 3),
            "new": round(right[~copies].float().mean().item(), 3),
            "all": round(right.float().mean().item(), 3)}
