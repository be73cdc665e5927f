"""A Hugging Face hub cache built from local model directories, in huggingface_hub's own layout.

No hub is reachable here, so tests that load models by id publish them into a cache first and run with
`HF_HUB_OFFLINE=1` and `HF_HUB_CACHE` pointing at it: huggingface_hub then resolves an id exactly as on a node that
downloaded it before (`refs/<revision>` names a commit, `snapshots/<commit>/` holds links into `blobs/`).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def publish(cache: Path, repo_id: str, src: Path, revision: str = "main", files: dict[str, bytes] | None = None) -> str:
    """Add the files of directory `src` (and `files`: name -> content, overriding) as a commit of `repo_id` that
    `revision` points to; returns the commit hash."""
    contents = {p.name: p.read_bytes() for p in sorted(Path(src).iterdir()) if p.is_file()}
    contents.update(files or {})
    digest = b"".join(hashlib.sha256(c).digest() for c in contents.values())
    commit = hashlib.sha1(repo_id.encode() + digest).hexdigest()
    repo = Path(cache) / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for name, data in contents.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / name
        if not link.exists():
            link.symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / revision).write_text(commit)
    return commit


def offline_env(cache: Path) -> dict[str, str]:
    """The environment of a node that has `cache` and no network."""
    return {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
