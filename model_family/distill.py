"""Distillation of drafters from the target (Minions' recipe: learn the target's own continuations).

For each domain the target greedily continues prompts cut from the domain's training text, and its top-K
next-token distribution is recorded at every position of those continuations and of plain domain text. A
drafter then minimises the cross-entropy to those soft labels. Greedy continuations are exactly the
contexts the drafter meets at serving time, so agreement there is what raises the accepted length.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import DynamicCache, LlamaForCausalLM

from model_family.data import sample_windows
from model_family.train import fit, set_seed

TOP_K = 16


@dataclass
class DistillSet:
    tokens: np.ndarray  # [N, L] uint16
    topk_ids: np.ndarray  # [N, L-1, K] uint16: target's top-K next tokens after each position
    topk_p: np.ndarray  # [N, L-1, K] float16: their probabilities

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez(path, tokens=self.tokens, topk_ids=self.topk_ids, topk_p=self.topk_p)

    def concat(self, other: "DistillSet") -> "DistillSet":
        return DistillSet(*(np.concatenate([a, b]) for a, b in
                            zip((self.tokens, self.topk_ids, self.topk_p), (other.tokens, other.topk_ids, other.topk_p))))

    @classmethod
    def load(cls, path: Path) -> "DistillSet":
        z = np.load(path)
        return cls(z["tokens"], z["topk_ids"], z["topk_p"])


@torch.no_grad()
def greedy_continue(model: LlamaForCausalLM, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy continuation of equal-length prompts, ignoring EOS (it is just another argmax here)."""
    cache = DynamicCache()
    out = model(input_ids=prompts, past_key_values=cache, use_cache=True)
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    generated = [nxt]
    for _ in range(new_tokens - 1):
        out = model(input_ids=nxt, past_key_values=out.past_key_values, use_cache=True)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        generated.append(nxt)
    return torch.cat([prompts] + generated, dim=1)


@torch.no_grad()
def build_distill_set(target: LlamaForCausalLM, stream: np.ndarray, n_generated: int, n_text: int,
                      prompt_len: int, seq_len: int, seed: int, desc: str, batch: int = 100,
                      label_batch: int = 50) -> DistillSet:
    """Runs on the target's device. `batch` (continuations) and `label_batch` (soft labels) only set how many rows
    go through the target at once: every prompt and text window is drawn before any of them runs."""
    target.eval()
    device = next(target.parameters()).device
    rng = np.random.default_rng(seed)
    rows = []
    prompts = torch.from_numpy(sample_windows(stream, n_generated, prompt_len, rng))
    for i in tqdm(range(0, n_generated, batch), desc=f"{desc}: target continuations", unit="batch"):
        rows.append(greedy_continue(target, prompts[i:i + batch].to(device), seq_len - prompt_len).cpu())
    if n_text:
        rows.append(torch.from_numpy(sample_windows(stream, n_text, seq_len, rng)))
    tokens = torch.cat(rows)
    ids, probs = [], []
    for i in tqdm(range(0, len(tokens), label_batch), desc=f"{desc}: target soft labels", unit="batch"):
        logits = target(input_ids=tokens[i:i + label_batch, :-1].to(device)).logits
        p, idx = F.softmax(logits, dim=-1).topk(TOP_K, dim=-1)
        ids.append(idx.to(torch.int32).cpu().numpy().astype(np.uint16))
        probs.append(p.cpu().numpy().astype(np.float16))
    return DistillSet(tokens.numpy().astype(np.uint16), np.concatenate(ids), np.concatenate(probs))


def _fkl(p: torch.Tensor, logp_k: torch.Tensor) -> torch.Tensor:
    """Forward KL up to the target's entropy: cross-entropy to its renormalised top-K distribution."""
    return -(p / p.sum(-1, keepdim=True) * logp_k).sum(-1).mean()


def _tvd(p: torch.Tensor, logp_k: torch.Tensor) -> torch.Tensor:
    """Total variation distance (DistillSpec's choice for greedy acceptance): over the target's top-K tokens,
    plus the drafter's remaining mass against the target's remaining mass."""
    q_k = logp_k.exp()
    rest = (1 - p.sum(-1)).clamp(min=0) - (1 - q_k.sum(-1))
    return 0.5 * ((p - q_k).abs().sum(-1) + rest.abs()).mean()


def _top1(p: torch.Tensor, logp_k: torch.Tensor) -> torch.Tensor:
    """Cross-entropy to the target's argmax alone: greedy acceptance asks only that the drafter's argmax match, so
    none of the drafter's capacity goes to the rest of the target's distribution."""
    return -logp_k[..., 0].mean()  # top-K ids are sorted: column 0 is the target's argmax


LOSSES = {"fkl": _fkl, "tvd": _tvd, "top1": _top1}


def distill_drafter(config, sets: list[DistillSet], steps: int, batch: int, lr: float, seed: int,
                    desc: str, init: LlamaForCausalLM | None = None, loss: str = "fkl",
                    checkpoint: Path | None = None, checkpoint_every: int = 100,
                    on_step: Callable[[int, LlamaForCausalLM], None] | None = None,
                    device: str | torch.device = "cpu") -> tuple[LlamaForCausalLM, dict]:
    """Train a drafter on the union of `sets`, drawing each row from a uniformly chosen set; from scratch, or
    fine-tuning `init` (a copy of it). `loss` is a divergence of `LOSSES`; `checkpoint` makes it resumable (saved
    every `checkpoint_every` steps; one saved on another device resumes too); `on_step(steps_done, model)` runs
    after every step. The model is initialised on the CPU, whatever the device, trains on `device` and is
    returned there; the batches are drawn on the CPU as they are for `device="cpu"`."""
    set_seed(seed)
    model = LlamaForCausalLM(config)
    if init is not None:
        model.load_state_dict(init.state_dict())
    model.to(device)
    divergence = LOSSES[loss]

    def batch_loss(rng: np.random.Generator) -> torch.Tensor:
        which = rng.integers(0, len(sets), size=batch)
        rows = [rng.integers(0, len(sets[s].tokens)) for s in which]
        x = torch.from_numpy(np.stack([sets[s].tokens[r] for s, r in zip(which, rows)]).astype(np.int64))
        ids = torch.from_numpy(np.stack([sets[s].topk_ids[r] for s, r in zip(which, rows)]).astype(np.int64))
        p = torch.from_numpy(np.stack([sets[s].topk_p[r] for s, r in zip(which, rows)]).astype(np.float32))
        x, ids, p = x.to(device), ids.to(device), p.to(device)
        logp = F.log_softmax(model(input_ids=x[:, :-1]).logits, dim=-1)
        return divergence(p, logp.gather(-1, ids))

    seconds = fit(model, steps, lr, seed, desc, batch_loss, checkpoint=checkpoint, every=checkpoint_every,
                  on_step=None if on_step is None else lambda done: on_step(done, model))
    tokens = steps * batch * (sets[0].tokens.shape[1] - 1)
    return model, {"steps": steps, "tokens": tokens, "seconds": seconds, "loss": loss}
