"""`cosine models ablate`: does a change to the distillation recipe widen the domain drafters' margin?

One configuration per run: from a common starting drafter, each chosen domain's drafter is fine-tuned on its
domain and a generic drafter on all six, with the same steps, learning rate, divergence and data per domain, so
the margin own / generic on that domain's held-out prompts is measured at equal budget. Results append to a JSON
list, one record per run.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from model_family import DOMAINS
from model_family.distill import DistillSet, distill_drafter


def _extra(data_dir: Path, models_dir: Path, domain: str, n: int, seed: int) -> DistillSet:
    """`n` more greedy target continuations of the domain's training prompts (cached; other prompts than the
    recipe's set, by seed)."""
    from model_family.data import token_streams
    from model_family.distill import build_distill_set
    from model_family.recipe import DISTILL_SEQ, PROMPT_LEN

    path = data_dir / "distill" / f"extra-{domain}-{n}.npz"
    if not path.exists():
        tok = AutoTokenizer.from_pretrained(models_dir / "tokenizer")
        target = AutoModelForCausalLM.from_pretrained(models_dir / "target", dtype=torch.float32).eval()
        stream = token_streams(data_dir, tok, "train")[domain]
        build_distill_set(target, stream, n, 0, PROMPT_LEN, DISTILL_SEQ, seed + 100 + DOMAINS.index(domain),
                          desc=f"{domain} extra").save(path)
    return DistillSet.load(path)


def ablate(data_dir: Path, models_dir: Path, domains: list[str], steps: int, lr: float, loss: str,
           extra_generated: int, init: Path, seed: int = 0, k: int = 4, eval_at: tuple[int, ...] = ()) -> dict:
    """One run; `eval_at` adds the learning curve: the same measurements after those numbers of steps."""
    from model_family.acceptance import agreement_by_kind, held_out_sequences, measure
    from model_family.configs import drafter_config
    from model_family.recipe import DRAFTER_BATCH, distill_set_path

    start = time.time()
    sets = {d: DistillSet.load(distill_set_path(data_dir, d)) for d in DOMAINS}
    if extra_generated:
        for d in domains:  # the generic drafter sees the same data of the measured domains as their drafters
            sets[d] = sets[d].concat(_extra(data_dir, models_dir, d, extra_generated, seed))
    seqs = held_out_sequences(models_dir, domains)
    start_model = AutoModelForCausalLM.from_pretrained(init, dtype=torch.float32)
    milestones = sorted({s for s in eval_at if 0 < s < steps} | {steps})
    curve: dict[int, dict] = {s: {"generic": {}, "own": {}} for s in milestones}
    kinds: dict[str, dict] = {"generic": {}, "own": {}}

    def accepted(model, domain: str) -> float:
        return round(measure(model, seqs[domain], 64, k).mean_accepted_length, 3)

    def record(key: str, measured: list[str]):
        def on_step(done: int, model) -> None:
            if done not in curve:
                return
            model.eval()
            curve[done][key].update({d: accepted(model, d) for d in measured})
            if done == steps:
                kinds[key].update({d: agreement_by_kind(model, seqs[d], 64) for d in measured})
            model.train()
        return on_step

    row = {"start": {d: accepted(start_model.eval(), d) for d in domains}}
    distill_drafter(drafter_config(), list(sets.values()), steps, DRAFTER_BATCH, lr, seed, desc="generic",
                    init=start_model, loss=loss, on_step=record("generic", domains))
    for d in domains:
        distill_drafter(drafter_config(), [sets[d]], steps, DRAFTER_BATCH, lr, seed, desc=d, init=start_model,
                        loss=loss, on_step=record("own", [d]))
    for point in curve.values():
        point["margin"] = {d: round(point["own"][d] / point["generic"][d], 3) for d in domains}
    row.update(curve.pop(steps))
    row["mean_margin"] = round(float(np.mean(list(row["margin"].values()))), 3)
    row["agreement"] = kinds
    config = {"domains": domains, "steps": steps, "lr": lr, "loss": loss, "extra_generated": extra_generated,
              "init": init.name, "seed": seed, "k": k}
    return {"config": config, **row, "curve": {str(s): v for s, v in curve.items()},
            "seconds": round(time.time() - start)}


def append_result(path: Path, result: dict) -> None:
    runs = json.loads(path.read_text()) if path.exists() else []
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(runs + [result], indent=2))
