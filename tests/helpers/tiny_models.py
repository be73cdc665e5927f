"""Tiny random-weight causal LMs of real architectures with this project's vocabulary, saved as checkpoints (the
config alone defines a model's shape; the shipped tokenizer makes them share the target's vocabulary)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

VOCAB = 8192
# head_dim 32: the smallest vLLM's CPU attention runs
SHAPE = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=512, bos_token_id=0, eos_token_id=[0, 2], pad_token_id=0)


def tiny_config(model_type: str, **overrides):
    """A small config of `model_type`; initializer_range is raised so that random logits are peaked (greedy tokens
    are then not decided by rounding)."""
    from transformers import AutoConfig

    extra = {"gpt_neox": dict(rotary_pct=1.0)}.get(model_type, dict(num_key_value_heads=2, head_dim=32))
    return AutoConfig.for_model(model_type, **{**SHAPE, "initializer_range": 0.2, **extra, **overrides})


def save_tiny(model_type: str, out: Path, tokenizer_dir: Path, seed: int = 0, **overrides) -> Path:
    """Random weights of `model_type` and the tokenizer files of `tokenizer_dir` in `out` (a checkpoint)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides), dtype=torch.float32)
    model.generation_config.eos_token_id = [0, 2]
    model.save_pretrained(out)
    for f in Path(tokenizer_dir).iterdir():
        if f.is_file():
            shutil.copy(f, out / f.name)
    return out
