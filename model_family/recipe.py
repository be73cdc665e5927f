"""The full recipe, step by step: package names -> corpora -> tokenizer -> target -> drafters.

Each step reads the previous step's output from disk, so steps can be re-run alone. Seeds are fixed.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer

from model_family import DOMAINS
from model_family.configs import drafter_config, target_config

# Budgets of the CPU recipe (2 cores). Measured step rates on such a machine give the estimates printed.
TARGET_STEPS, TARGET_BATCH, SEQ_LEN, TARGET_LR = 1000, 16, 256, 2e-3


def step_corpora(data_dir: Path, seed: int = 0) -> dict:
    from model_family.corpora import prepare

    return prepare(data_dir, seed=seed, progress=lambda d, r: print(
        f"  {d:<11} train {r['train_chars'] / 1e6:5.1f} MB in {r['train_chunks']} chunks, "
        f"test {r['test_chunks']} chunks", flush=True))


def step_tokenizer(data_dir: Path, models_dir: Path, seed: int = 0):
    from model_family.corpora import load_split
    from model_family.tokenizer import train_tokenizer

    return train_tokenizer({d: load_split(data_dir, d, "train") for d in DOMAINS}, models_dir / "tokenizer", seed)


def step_target(data_dir: Path, models_dir: Path, seed: int = 0, steps: int = TARGET_STEPS) -> dict:
    from model_family.data import token_streams
    from model_family.train import perplexity, save_model, train_target

    tok = AutoTokenizer.from_pretrained(models_dir / "tokenizer")
    train = token_streams(data_dir, tok, "train")
    test = token_streams(data_dir, tok, "test")
    model, stats = train_target(target_config(), train, steps, TARGET_BATCH, SEQ_LEN, TARGET_LR, seed)
    stats["held_out_ppl"] = {d: round(perplexity(model, test[d]), 2) for d in DOMAINS}
    stats["params"] = sum(p.numel() for p in model.parameters())
    save_model(model, models_dir / "target", tok, {"role": "target", "seed": seed, **stats})
    print(json.dumps(stats, indent=2))
    return stats


# Distillation budgets: per domain, greedy target continuations of prompts plus plain text windows.
N_GENERATED, N_TEXT, PROMPT_LEN, DISTILL_SEQ = 2000, 1000, 32, 128
# Every drafter is the same shared base (trained on all domains) fine-tuned for the same number of steps: a domain
# drafter on its domain, the generic drafter on all six. CoSine's drafters are domain-tuned copies of one small
# model, and equal budgets keep the comparison fair: given 800 more steps on the mixed data, the generic drafter
# gained 11-14% held-out accepted length, more than the domain drafters gained from their own (measured,
# docs/model_card.md "Recipe ablation").
# These are the shipped family's budgets. Top1 distillation with 2400 fine-tuning steps and 8000 or 24000
# continuations per domain (`--device cuda`: minutes on a GPU) gives far better drafters, but its specialists only
# match the generic drafter, and its likelihoods no longer rank drafters for routing's cold start
# (docs/drafter_recipe.md, "The recipe at equal budget on a GPU").
BASE_STEPS, DRAFTER_BATCH, BASE_LR = 350, 32, 3e-3
FINETUNE_STEPS, FINETUNE_LR, DISTILL_LOSS = 250, 1.5e-3, "fkl"
DRAFTERS = tuple(DOMAINS) + ("generic",)


def drafter_recipe() -> dict:
    """What a drafter's weights depend on, recorded in its family.json: a drafter whose record matches is kept
    when the recipe runs again (the step resumes where it stopped)."""
    return {"base_steps": BASE_STEPS, "base_lr": BASE_LR, "finetune_steps": FINETUNE_STEPS,
            "finetune_lr": FINETUNE_LR, "batch": DRAFTER_BATCH, "loss": DISTILL_LOSS,
            "n_generated": N_GENERATED, "n_text": N_TEXT}


def _target(models_dir: Path):
    import torch

    return AutoModelForCausalLM.from_pretrained(models_dir / "target", dtype=torch.float32).eval()


def distill_set_path(data_dir: Path, domain: str) -> Path:
    """The domain's distill set, named by its sizes: a set built with other budgets is never taken for this one."""
    return data_dir / "distill" / f"{domain}-g{N_GENERATED}-t{N_TEXT}.npz"


def step_distill_sets(data_dir: Path, models_dir: Path, seed: int = 0, device: str = "cpu") -> None:
    """The target runs on `device`; on a GPU it takes larger batches, which change nothing in the sets."""
    import torch

    from model_family.data import token_streams
    from model_family.distill import build_distill_set

    tok = AutoTokenizer.from_pretrained(models_dir / "tokenizer")
    train = token_streams(data_dir, tok, "train")
    target = _target(models_dir).to(device)
    batch, label_batch = (100, 50) if torch.device(device).type == "cpu" else (2000, 500)
    for i, d in enumerate(DOMAINS):
        out = distill_set_path(data_dir, d)
        if not out.exists():
            build_distill_set(target, train[d], N_GENERATED, N_TEXT, PROMPT_LEN, DISTILL_SEQ,
                              seed + i, desc=d, batch=batch, label_batch=label_batch).save(out)


def _load_distill_set(data_dir: Path, domain: str):
    from model_family.distill import DistillSet

    path = distill_set_path(data_dir, domain)
    s = DistillSet.load(path)
    if s.tokens.shape != (N_GENERATED + N_TEXT, DISTILL_SEQ):
        raise ValueError(f"{path}: {s.tokens.shape[0]} rows of {s.tokens.shape[1]} tokens, the recipe asks for "
                         f"{N_GENERATED + N_TEXT} of {DISTILL_SEQ}; remove it and run the distill step again")
    return s


def _trained(path: Path, recipe: dict) -> bool:
    meta = path / "family.json"
    return meta.exists() and json.loads(meta.read_text()).get("recipe") == recipe


def step_drafters(data_dir: Path, models_dir: Path, seed: int = 0, only: list[str] | None = None,
                  device: str = "cpu") -> dict:
    """The shared base, then each drafter fine-tuned from it, trained and evaluated on `device`, saved as soon as
    it is done. Resumable: drafters already trained with this recipe are kept, and a model cut off mid-training
    continues from its checkpoint under data_dir (on any device)."""
    import torch

    from model_family.data import token_streams
    from model_family.distill import distill_drafter
    from model_family.train import perplexity, save_model

    tok = AutoTokenizer.from_pretrained(models_dir / "tokenizer")
    test = token_streams(data_dir, tok, "test")
    sets = {d: _load_distill_set(data_dir, d) for d in DOMAINS}
    recipe = drafter_recipe()
    ckpts = data_dir / "checkpoints"
    todo = [n for n in (only or DRAFTERS) if not _trained(models_dir / f"drafter-{n}", recipe)]
    base_dir = data_dir / "drafter-base"  # not shipped: only the drafters' common starting point
    if todo and not _trained(base_dir, recipe):
        base, stats = distill_drafter(drafter_config(), list(sets.values()), BASE_STEPS, DRAFTER_BATCH, BASE_LR,
                                      seed, desc="drafter-base", loss=DISTILL_LOSS,
                                      checkpoint=ckpts / "drafter-base.ckpt", device=device)
        save_model(base, base_dir, tok, {"role": "drafter-base", "seed": seed, "recipe": recipe, **stats})
    report = {}
    for name in todo:
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        data = list(sets.values()) if name == "generic" else [sets[name]]
        model, stats = distill_drafter(drafter_config(), data, FINETUNE_STEPS, DRAFTER_BATCH, FINETUNE_LR, seed,
                                       desc=f"drafter-{name}", init=base, loss=DISTILL_LOSS,
                                       checkpoint=ckpts / f"drafter-{name}.ckpt", device=device)
        base_meta = json.loads((base_dir / "family.json").read_text())
        stats.update(init="drafter-base", steps=BASE_STEPS + stats["steps"], tokens=base_meta["tokens"] + stats["tokens"],
                     seconds=base_meta["seconds"] + stats["seconds"])
        stats["held_out_ppl"] = {d: round(perplexity(model, test[d]), 2) for d in DOMAINS}
        stats["params"] = sum(p.numel() for p in model.parameters())
        save_model(model, models_dir / f"drafter-{name}", tok,
                   {"role": "drafter", "domain": name, "seed": seed, "recipe": recipe, "device": device, **stats})
        report[name] = stats
    return report


def step_heldout_samples(data_dir: Path, models_dir: Path, per_domain: int = 60) -> None:
    """Ship a slice of every domain's held-out split so a fresh clone can evaluate without the corpora. Passages
    that quote paths under a home directory (root's or a user's) are skipped: in the repository they read as paths
    of the machine that built it."""
    from model_family.corpora import load_split
    from model_family.samples import write_heldout

    home = re.compile(r"(?<![\w.])/(?:root|home)/")
    write_heldout(models_dir, {d: [t for t in load_split(data_dir, d, "test") if not home.search(t)][:per_domain]
                               for d in DOMAINS})


def step_acceptance_matrix(models_dir: Path, out: Path, k: int = 4, n_prompts: int = 24,
                           prompt_len: int = 64, new_tokens: int = 64, seed: int = 1234) -> dict:
    import torch
    from tqdm import tqdm

    from model_family.acceptance import held_out_sequences, measure

    seqs = held_out_sequences(models_dir, DOMAINS, n_prompts, prompt_len, new_tokens, seed)
    matrix: dict = {"k": k, "prompts_per_domain": n_prompts, "prompt_len": prompt_len,
                    "new_tokens": new_tokens, "drafters": {}}
    for name in tqdm(DRAFTERS, desc="drafters"):
        drafter = AutoModelForCausalLM.from_pretrained(models_dir / f"drafter-{name}", dtype=torch.float32).eval()
        matrix["drafters"][name] = {d: vars(measure(drafter, seqs[d], prompt_len, k)) for d in DOMAINS}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(matrix, indent=2))
    return matrix


def check_acceptance(matrix: dict) -> list[str]:
    """The family's acceptance criteria; returns the violations (empty when met)."""
    m = {n: {d: v["mean_accepted_length"] for d, v in row.items()} for n, row in matrix["drafters"].items()}
    problems = []
    for d in DOMAINS:
        own, generic = m[d][d], m["generic"][d]
        if own < 1.15 * generic:
            problems.append(f"{d}: own drafter {own:.2f} < 1.15 x generic {generic:.2f}")
        for other in DOMAINS:
            if other != d and m[other][d] >= own:
                problems.append(f"{d}: drafter-{other} {m[other][d]:.2f} >= own {own:.2f}")
    avg = sum(m["generic"].values()) / len(DOMAINS)
    if avg < 1.8:
        problems.append(f"generic drafter averages {avg:.2f} < 1.8")
    return problems


def step_model_card(data_dir: Path, models_dir: Path, docs_dir: Path, matrix_json: Path,
                    latency_json: Path | None = None) -> Path:
    from model_family.model_card import render

    stats_path = data_dir / "stats.json"
    corpus = json.loads(stats_path.read_text()) if stats_path.exists() else None
    matrix = json.loads(matrix_json.read_text()) if matrix_json.exists() else None
    lat = json.loads(latency_json.read_text()) if latency_json and latency_json.exists() else None
    docs_dir.mkdir(parents=True, exist_ok=True)
    out = docs_dir / "model_card.md"
    ablation_json = models_dir / "recipe_ablation.json"
    ablation = json.loads(ablation_json.read_text()) if ablation_json.exists() else None
    out.write_text(render(models_dir, corpus, matrix, lat, ablation))
    return out
