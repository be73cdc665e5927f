"""Architectures of the family. All are Llama-architecture causal LMs over the shared 8k tokenizer."""

from __future__ import annotations

from transformers import LlamaConfig

from model_family.tokenizer import VOCAB_SIZE

MAX_POSITIONS = 2048


def _llama(hidden: int, layers: int, intermediate: int, heads: int, tie: bool = True) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
        max_position_embeddings=MAX_POSITIONS, rope_theta=10000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=tie, bos_token_id=0, eos_token_id=[0, 2], pad_token_id=0,
        torch_dtype="float32",
    )


def target_config() -> LlamaConfig:
    """~10M parameters: the largest target the CPU recipe can train well within its time budget."""
    return _llama(hidden=384, layers=4, intermediate=1024, heads=6)


def drafter_config() -> LlamaConfig:
    """~1.5M parameters, about 5x cheaper per decode step than the target on a CPU."""
    return _llama(hidden=128, layers=2, intermediate=352, heads=4)


def lm_target_config() -> LlamaConfig:
    """~29M parameters (8 layers of 512): the larger target trained on a GPU on all the corpora (model_family/
    lm_target.py). Its decode step costs well under the bench target's (138M, the 10M target widened 4x), and its
    fp16 weights (58 MB) come back from a lent GPU machine in one call (64 MiB at most, in pieces of 16 MiB)."""
    return _llama(hidden=512, layers=8, intermediate=1344, heads=8)
