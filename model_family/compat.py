"""Whether models can serve together: drafter and partner vocabularies against the target's, and the target's EOS.

A drafter's token ids are verified by the target as the target's own ids, so a drafter whose id `i` means another
string than the target's `i` would draft garbage that is always rejected (lossless, but never faster, and nobody
told). A drafter whose vocabulary is larger than the target's (padded embeddings, extra added tokens) may propose an
id the target does not have: the drafter engines never propose ids at or past `shared_vocab_size`.
Special tokens are compared as strings at the ids the target uses: an instruct drafter whose tokenizer names another
EOS than a base target's is fine (the target alone decides where a reply ends), one whose id for the target's EOS is
another string is not.
"""

from __future__ import annotations

import json
from pathlib import Path

SHOWN = 5  # mismatching ids quoted in an error


class IncompatibleModels(ValueError):
    """Two models that cannot serve together, with what differs and how to fix it."""


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def model_vocab_size(path: Path) -> int | None:
    """The model's embedding rows (`vocab_size` of config.json, or of its text config), None without a config."""
    return _config(path).get("vocab_size")


def _config(path: Path) -> dict:
    f = Path(path) / "config.json"
    cfg = json.loads(f.read_text()) if f.is_file() else {}
    return {**cfg.get("text_config", {}), **{k: v for k, v in cfg.items() if k != "text_config"}}


def eos_token_ids(path: Path, tokenizer=None) -> tuple[int, ...]:
    """Every id that ends the target's reply: generation_config.json's `eos_token_id` (one or several: chat models
    list their end-of-turn token there) and the tokenizer's EOS, in that order, without repeats."""
    ids: list[int] = []
    f = Path(path) / "generation_config.json"
    if f.is_file():
        eos = json.loads(f.read_text()).get("eos_token_id")
        ids.extend(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return tuple(dict.fromkeys(int(i) for i in ids))


def shared_vocab_size(target_tokenizer, target_path: Path | None = None) -> int:
    """Ids a drafter may propose: those the target's tokenizer and embedding both have."""
    n = len(target_tokenizer)
    rows = model_vocab_size(target_path) if target_path is not None else None
    return min(n, rows) if rows else n


def check_vocabulary(role: str, name: str, tokenizer, target_tokenizer, target_name: str) -> list[str]:
    """Raise `IncompatibleModels` unless `tokenizer` maps every ordinary token id it shares with the target's to
    the same string and has ids for the target's special tokens. Added tokens (chat markers, EOS) that differ are
    returned as warnings, not refused: the target alone decides them, a drafter only guesses them wrong (the paper's
    pair differs so: DeepSeek-R1-Distill-Qwen renames Qwen2.5's chat markers)."""
    common = min(len(tokenizer), len(target_tokenizer))
    ids = list(range(common))
    ours, theirs = tokenizer.convert_ids_to_tokens(ids), target_tokenizer.convert_ids_to_tokens(ids)
    added = set(tokenizer.added_tokens_decoder) | set(target_tokenizer.added_tokens_decoder)
    bad = [i for i in ids if ours[i] != theirs[i] and i not in added]
    fix = (f"use a {role} trained with the target's tokenizer (the same model family and tokenizer version), or "
           f"set the tokenizer to match")
    if bad:
        shown = ", ".join(f"id {i}: {ours[i]!r} vs the target's {theirs[i]!r}" for i in bad[:SHOWN])
        raise IncompatibleModels(
            f"{role} {name!r} does not share the target's vocabulary ({target_name!r}): {len(bad)} of {common} "
            f"shared token ids mean other strings ({shown}). Its drafts would never be accepted: {fix}")
    missing = sorted(i for i in target_tokenizer.all_special_ids if i >= len(tokenizer))
    if missing:
        names = ", ".join(repr(target_tokenizer.convert_ids_to_tokens(i)) for i in missing[:SHOWN])
        raise IncompatibleModels(
            f"{role} {name!r} has {len(tokenizer)} tokens and lacks the target's special tokens {names} (ids "
            f"{missing[:SHOWN]}) of {target_name!r}: {fix}")
    renamed = [i for i in ids if ours[i] != theirs[i]]
    if not renamed:
        return []
    shown = ", ".join(f"id {i}: {ours[i]!r} vs {theirs[i]!r}" for i in renamed[:SHOWN])
    return [f"{role} {name!r}: {len(renamed)} added tokens differ from the target's ({shown}); drafts of them "
            f"will be rejected, which costs acceptance only at those tokens"]
