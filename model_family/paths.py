"""Where the shipped model family lives."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def models_dir() -> Path:
    """The shipped family, or another directory of the same layout named by COSINE_MODELS_DIR."""
    return Path(os.environ.get("COSINE_MODELS_DIR", REPO_ROOT / "models"))


def model_path(name: str) -> Path:
    """`target`, `bench-target`, `tokenizer`, `drafter-<domain>` or any directory path."""
    p = Path(name)
    return p if p.is_dir() else models_dir() / name
