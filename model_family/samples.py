"""The shipped slice of every domain's held-out split (models/heldout/<domain>.jsonl), never trained on."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from model_family import DOMAINS
from model_family.corpora import read_jsonl, write_jsonl


def write_heldout(models_dir: Path, texts: dict[str, list[str]]) -> None:
    for domain, items in texts.items():
        write_jsonl(models_dir / "heldout" / f"{domain}.jsonl", items)


def heldout_texts(models_dir: Path | None = None) -> dict[str, list[str]]:
    if models_dir is None:
        from model_family.paths import models_dir as default

        models_dir = default()
    return {d: read_jsonl(models_dir / "heldout" / f"{d}.jsonl") for d in DOMAINS}


def heldout_streams(models_dir: Path, tokenizer) -> dict[str, np.ndarray]:
    from model_family.data import tokenize_split

    return {d: tokenize_split(tokenizer, texts) for d, texts in heldout_texts(models_dir).items()}


def domain_prompts(per_domain: int = 4, chars: int = 400, models_dir: Path | None = None) -> list[tuple[str, str]]:
    """(domain, prompt) pairs: the opening `chars` characters of held-out passages, cut at a word boundary."""
    out = []
    for domain, texts in heldout_texts(models_dir).items():
        for text in texts[:per_domain]:
            cut = text[:chars]
            cut = cut[:cut.rfind(" ")] if " " in cut[chars // 2:] else cut
            out.append((domain, cut))
    return out
