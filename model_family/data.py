"""Token streams of the corpora and random training windows over them."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from model_family import DOMAINS
from model_family.corpora import load_split


def tokenize_split(tokenizer, texts: list[str]) -> np.ndarray:
    """One uint16 stream: documents separated by EOS (which doubles as BOS)."""
    eos = tokenizer.eos_token_id
    out: list[int] = []
    for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        out.append(eos)
        out.extend(ids)
    return np.asarray(out, dtype=np.uint16)


def token_streams(data_dir: Path, tokenizer, split: str) -> dict[str, np.ndarray]:
    """Tokenised splits, cached next to the text."""
    streams = {}
    for domain in DOMAINS:
        cache = data_dir / domain / f"{split}.tokens.npy"
        if not cache.exists():
            np.save(cache, tokenize_split(tokenizer, load_split(data_dir, domain, split)))
        streams[domain] = np.load(cache)
    return streams


def sample_windows(stream: np.ndarray, n: int, length: int, rng: np.random.Generator) -> np.ndarray:
    starts = rng.integers(0, len(stream) - length, size=n)
    return np.stack([stream[s:s + length] for s in starts]).astype(np.int64)
