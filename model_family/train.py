"""Training loops: the target on the domain mixture, drafters by distillation from the target."""

from __future__ import annotations

from collections.abc import Callable

import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import LlamaForCausalLM

from model_family.data import sample_windows


def set_seed(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _optimizer(model, lr: float) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95))


def train_target(config, streams: dict[str, np.ndarray], steps: int, batch: int, seq_len: int,
                 lr: float, seed: int, desc: str = "target") -> tuple[LlamaForCausalLM, dict]:
    """Next-token training on an equal mixture of every domain's stream."""
    set_seed(seed)
    model = LlamaForCausalLM(config)
    domains = sorted(streams)

    def batch_loss(rng: np.random.Generator) -> torch.Tensor:
        picks = rng.integers(0, len(domains), size=batch)
        x = torch.from_numpy(np.concatenate(
            [sample_windows(streams[domains[d]], 1, seq_len + 1, rng) for d in picks]))
        logits = model(input_ids=x[:, :-1]).logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1))

    seconds = fit(model, steps, lr, seed, desc, batch_loss)
    return model, {"steps": steps, "tokens": steps * batch * seq_len, "seconds": seconds}


class TrainingCut(Exception):
    """A run stopped at its time budget with its checkpoint saved: the same call again goes on from there."""

    def __init__(self, steps_done: int):
        super().__init__(f"stopped at step {steps_done} (its time budget); run again to resume")
        self.steps_done = steps_done


def fit(model, steps: int, lr: float, seed: int, desc: str,
        batch_loss: Callable[[np.random.Generator], torch.Tensor], checkpoint: Path | None = None,
        every: int = 100, on_step: Callable[[int], None] | None = None, budget_s: float | None = None) -> float:
    """The training loop every model of the family shares: AdamW with warm-up and schedule (`lr_at`), gradient
    clipping at 1, a progress bar; `batch_loss(rng)` draws a batch and returns its loss. Returns the seconds.

    With `checkpoint`, the model, optimiser, data order and seconds so far are saved there every `every` steps,
    and a run that finds one resumes from it (a session cut off mid-model loses at most `every` steps); the
    file is removed once training completes. `on_step(steps_done)` runs after every step (evaluations along
    the way). `budget_s` (with `checkpoint`): once this call has run that long, the checkpoint is saved and
    `TrainingCut` raised (runs on a machine lent for minutes at a time)."""
    opt = _optimizer(model, lr)
    called = time.time()
    rng = np.random.default_rng(seed)
    first, spent = 0, 0.0
    if checkpoint is not None and checkpoint.exists():
        # onto the CPU first: a checkpoint saved on a GPU resumes anywhere (the model's and the optimiser's
        # load_state_dict copy the tensors to wherever the model is)
        state = torch.load(checkpoint, weights_only=False, map_location="cpu")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        rng.bit_generator.state = state["rng"]
        torch.set_rng_state(state["torch_rng"])
        first, spent = state["step"], state["seconds"]
    start = time.time() - spent
    bar = tqdm(range(first, steps), desc=desc, unit="step", initial=first, total=steps)
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, lr, warmup=max(1, steps // 20))
        loss = batch_loss(rng)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if on_step is not None:
            on_step(step + 1)
        cut = budget_s is not None and time.time() - called >= budget_s and step + 1 < steps
        if checkpoint is not None and ((step + 1) % every == 0 or cut) and step + 1 < steps:
            checkpoint.parent.mkdir(parents=True, exist_ok=True)
            partial = checkpoint.with_suffix(".partial")
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "rng": rng.bit_generator.state,
                        "torch_rng": torch.get_rng_state(), "step": step + 1, "seconds": time.time() - start},
                       partial)
            partial.replace(checkpoint)  # a cut-off mid-write leaves the previous checkpoint whole
        if cut:
            bar.close()
            raise TrainingCut(step + 1)
    if checkpoint is not None:
        checkpoint.unlink(missing_ok=True)
    return round(time.time() - start, 1)


@torch.no_grad()
def perplexity(model, stream: np.ndarray, seq_len: int = 256, max_windows: int = 64) -> float:
    """Held-out perplexity over non-overlapping windows, on the model's device."""
    model.eval()
    device = next(model.parameters()).device
    n = min(max_windows, (len(stream) - 1) // seq_len)
    total, count = 0.0, 0
    for i in range(0, n, 16):
        rows = [stream[j * seq_len:(j + 1) * seq_len + 1] for j in range(i, min(n, i + 16))]
        x = torch.from_numpy(np.stack(rows).astype(np.int64)).to(device)
        logits = model(input_ids=x[:, :-1]).logits
        total += F.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1), reduction="sum").item()
        count += x[:, 1:].numel()
    return math.exp(total / count)


def save_model(model, out_dir: Path, tokenizer, meta: dict) -> None:
    """fp16 storage halves the repository size; every consumer loads it back as fp32. A model trained on a GPU is
    saved from the CPU (where it is left), so the files are the same whatever the device."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model.to(device="cpu", dtype=torch.float16).save_pretrained(out_dir, safe_serialization=True)
    model.to(torch.float32)
    cfg = json.loads((out_dir / "config.json").read_text())
    cfg["dtype"] = "float32"
    cfg.pop("torch_dtype", None)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    tokenizer.save_pretrained(out_dir)
    gen = {"bos_token_id": 0, "eos_token_id": [0, 2], "pad_token_id": 0, "do_sample": False}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2))
    (out_dir / "family.json").write_text(json.dumps(meta, indent=2))
