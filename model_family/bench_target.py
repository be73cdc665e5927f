"""The cost-realistic "bench" target: a function-preserving widening of the trained target.

A ~10M-parameter target decodes in a few milliseconds on a CPU, where fixed per-step overheads dominate and no
speculation can pay off. For performance work we therefore widen the trained target Net2Net-style by an integer
factor k: every residual unit, attention head and MLP unit is duplicated k times, and every weight that reads
duplicated units is divided by k. RMSNorm statistics are unchanged by exact duplication, so the widened model
computes the same next-token distribution (up to float rounding) at roughly k^2 times the cost per token. The LM
head is untied (the widened embedding and head differ by the 1/k factor). It is not a better model, only a
slower one with identical behaviour: a stand-in for a real large target.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def _grid(w: torch.Tensor, k: int) -> torch.Tensor:
    """[out, in] -> [k*out, k*in]: the block grid that maps tiled inputs to tiled outputs."""
    return w.repeat(k, k) / k


def widen(model: LlamaForCausalLM, k: int) -> LlamaForCausalLM:
    c = model.config
    head_dim = c.hidden_size // c.num_attention_heads
    cfg = LlamaConfig(**{**c.to_dict(), "hidden_size": c.hidden_size * k,
                         "intermediate_size": c.intermediate_size * k,
                         "num_attention_heads": c.num_attention_heads * k,
                         "num_key_value_heads": c.num_key_value_heads * k,
                         "head_dim": head_dim, "tie_word_embeddings": False})
    wide = LlamaForCausalLM(cfg).to(torch.float32)
    src = {n: p.detach().float() for n, p in model.named_parameters()}
    src.setdefault("lm_head.weight", src["model.embed_tokens.weight"])
    with torch.no_grad():
        for name, p in wide.named_parameters():
            w = src[name]
            if name == "model.embed_tokens.weight":
                p.copy_(w.repeat(1, k))
            elif name == "lm_head.weight":
                p.copy_(w.repeat(1, k) / k)
            elif name.endswith("norm.weight"):
                p.copy_(w.repeat(k))
            elif w.dim() == 2:
                p.copy_(_grid(w, k))
            else:
                raise ValueError(f"unexpected parameter {name}")
    return wide.eval()


def build_bench_target(target_dir: Path, out_dir: Path, factor: int = 4) -> Path:
    from transformers import AutoTokenizer

    model = LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    wide = widen(model, factor)
    out_dir.mkdir(parents=True, exist_ok=True)
    wide.save_pretrained(out_dir, safe_serialization=True)
    AutoTokenizer.from_pretrained(target_dir).save_pretrained(out_dir)
    gen = target_dir / "generation_config.json"
    if gen.exists():
        (out_dir / "generation_config.json").write_text(gen.read_text())
    (out_dir / "family.json").write_text(json.dumps(
        {"role": "bench-target", "widened_from": "target", "factor": factor,
         "params": sum(p.numel() for p in wide.parameters())}, indent=2))
    return out_dir


def ensure_bench_target(models_dir: Path, log=print) -> Path:
    """`models_dir`/bench-target, built from the shipped target the first time a benchmark needs it (it is not
    committed: a fresh checkout has none)."""
    out = models_dir / "bench-target"
    if not (out / "config.json").exists():
        log("building the bench target (cosine models bench-target) ...")
        build_bench_target(models_dir / "target", out)
    return out
