"""Where a model comes from: a shipped name, a local directory, or a Hugging Face id.

Every model field of the configuration (and every `--model`/`--drafter` of the CLI) takes one of:
- a shipped name (`target`, `bench-target`, `tokenizer`, `drafter-<domain>`), a directory of `models_dir()`;
- a local directory holding a transformers checkpoint (`config.json`, weights, tokenizer files);
- a Hugging Face model id, `org/name`, optionally pinned as `org/name@revision` (a branch, tag or commit).

An id is resolved with `huggingface_hub.snapshot_download` on the node that loads the model, so the node's own
`HF_HOME` / `HF_HUB_CACHE`, `HF_HUB_OFFLINE` and `HF_TOKEN` apply, and what is already cached is not fetched
again. Engines, vLLM included, are given the resolved local directory. A model that cannot be had raises
`ModelUnavailable`, one message that says which model, where it was looked for and what to do.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from model_family.paths import models_dir

# what a checkpoint needs to load in transformers or vLLM; other files of a hub repo (other weight formats, images,
# ONNX and GGUF exports) are not fetched
CHECKPOINT_FILES = ["*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja", "*.py"]
TOKENIZER_FILES = ["*.json", "*.model", "*.tiktoken", "*.txt", "*.jinja"]

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?(@[\w./-]+)?$")


class ModelUnavailable(RuntimeError):
    """A model named in the configuration or on the command line cannot be had on this node."""


def split_revision(ref: str) -> tuple[str, str | None]:
    """`org/name@revision` -> (`org/name`, `revision`); no `@`: (ref, None)."""
    repo, sep, revision = ref.partition("@")
    return (repo, revision) if sep and revision else (ref, None)


def shipped(ref: str) -> Path | None:
    p = models_dir() / ref
    return p if "/" not in ref and "@" not in ref and p.is_dir() else None


def resolve_model(ref: str, tokenizer_only: bool = False) -> Path:
    """The local directory holding `ref` (see the module docstring), fetched into the Hugging Face cache first when
    it is an id not cached yet (unless offline). `tokenizer_only`: for an id, only the tokenizer's and config
    files (startup checks read those on nodes that do not load the weights)."""
    local = Path(ref).expanduser()
    if local.is_dir():
        return local
    if ref == "bench-target":  # the widened target (model_family/bench_target.py): built here the first time
        from model_family.bench_target import ensure_bench_target

        return ensure_bench_target(models_dir())
    found = shipped(ref)
    if found is not None:
        return found
    if local.is_absolute() or ref.startswith((".", "~")) or not _HUB_ID.match(ref):
        raise ModelUnavailable(f"model {ref!r}: no such directory. Give an existing directory, a shipped name "
                               f"({', '.join(shipped_names()) or 'none in ' + str(models_dir())}), or a Hugging Face "
                               f"id such as Qwen/Qwen2.5-0.5B")
    return _from_hub(ref, TOKENIZER_FILES if tokenizer_only else CHECKPOINT_FILES)


def shipped_names() -> list[str]:
    root = models_dir()
    return sorted(p.name for p in root.iterdir() if (p / "tokenizer_config.json").is_file()) if root.is_dir() else []


def _from_hub(ref: str, patterns: list[str]) -> Path:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    repo, revision = split_revision(ref)
    where = f"the Hugging Face cache {constants.HF_HUB_CACHE}"
    offline = constants.is_offline_mode()
    try:
        return Path(snapshot_download(repo, revision=revision, allow_patterns=patterns))
    except LocalEntryNotFoundError:
        if offline:
            fix = (f"it is not in {where} and HF_HUB_OFFLINE is set: download it on a connected machine "
                   f"(`hf download {repo}{' --revision ' + revision if revision else ''}`) into that cache, "
                   f"or unset HF_HUB_OFFLINE")
        else:
            fix = (f"it is not in {where} and the hub could not be reached: check the node's network (or "
                   f"HF_ENDPOINT), or put the model in that cache or a local directory and name the directory")
        raise ModelUnavailable(f"model {ref!r}: {fix}") from None
    except GatedRepoError:
        raise ModelUnavailable(f"model {ref!r}: the repository is gated; accept its terms on huggingface.co and set "
                               f"HF_TOKEN on every node that loads it (looked in {where} and on the hub)") from None
    except RepositoryNotFoundError:
        token = "HF_TOKEN is set" if os.environ.get("HF_TOKEN") else "no HF_TOKEN is set"
        raise ModelUnavailable(f"model {ref!r}: no such repository on the hub (or it is private and {token}); "
                               f"check the id (looked in {where} and on the hub)") from None
    except RevisionNotFoundError:
        raise ModelUnavailable(f"model {ref!r}: the repository has no revision {revision!r}") from None
    except HfHubHTTPError as e:
        raise ModelUnavailable(f"model {ref!r}: the hub answered {e} (looked in {where})") from None
