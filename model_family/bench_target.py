"""The cost-realistic "bench" target: a function-preserving widening of the trained target.

A ~10M-parameter target decodes in a few milliseconds on a CPU, where fixed per-step overheads dominate and no
speculation can pay off. For performance work we therefore widen the trained target Net2Net-style by an integer
factor k: every residual unit, attention head and MLP unit is duplicated k times, and every weight that reads
duplicated units is divided by k. RMSNorm statistics are unchanged by exact duplication, so the widened model
computes the same next-token distribution (up to float rounding) at roughly k^2 times the cost per token. The LM
head is untied (the widened embedding and head differ by the 1/k factor). It is not a better model, only a
slower one with identical behaviour: a stand-in for a real large target.

On a GPU a 4x widening is still far cheaper than any target anyone speculates for (a step of 0.56 ms on an H200),
so `widen` can also deepen: layers appended whose attention output and MLP down projections are zero add nothing
to the residual stream (each is the identity, exactly, in any dtype) but cost a full layer's reads and FLOPs.
`realistic_target` builds such a model directly on the device, in the dtype asked for, without writing it to disk:
16x wider and 16 layers deep is 7.3B parameters, a 7B-class model's step.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def _grid(w: torch.Tensor, k: int) -> torch.Tensor:
    """[out, in] -> [k*out, k*in]: the block grid that maps tiled inputs to tiled outputs."""
    return w.repeat(k, k) / k


def widen(model: LlamaForCausalLM, k: int, layers: int | None = None, device: str = "cpu",
          dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    """The model widened k times, computing the same function; `layers` (at least the model's): deepened to that
    many layers with identity layers appended. Built on `device` in `dtype`."""
    c = model.config
    head_dim = c.hidden_size // c.num_attention_heads
    depth = layers or c.num_hidden_layers
    if depth < c.num_hidden_layers:
        raise ValueError(f"cannot deepen a {c.num_hidden_layers}-layer model to {depth} layers")
    cfg = LlamaConfig(**{**c.to_dict(), "hidden_size": c.hidden_size * k,
                         "intermediate_size": c.intermediate_size * k,
                         "num_attention_heads": c.num_attention_heads * k,
                         "num_key_value_heads": c.num_key_value_heads * k,
                         "num_hidden_layers": depth, "head_dim": head_dim, "tie_word_embeddings": False})
    with torch.device(device):
        wide = LlamaForCausalLM(cfg).to(dtype)
    src = {n: p.detach().to(device, torch.float32) for n, p in model.named_parameters()}
    src.setdefault("lm_head.weight", src["model.embed_tokens.weight"])
    with torch.no_grad():
        for name, p in wide.named_parameters():
            if name not in src:  # an appended layer: zero output projections make it the identity
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    p.zero_()
                continue
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


def realistic_target(models_dir: Path, factor: int, layers: int, device: str, dtype: torch.dtype):
    """The trained target widened `factor` times and deepened to `layers`, built on `device` in `dtype` (not saved):
    the bench target at the cost of a real one."""
    model = LlamaForCausalLM.from_pretrained(models_dir / "target", dtype=torch.float32)
    return widen(model, factor, layers, device, dtype)


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
    """`models_dir`/bench-target, built from the shipped target the first time it is needed (it is not committed: a
    fresh checkout has none). Built aside and renamed into place, so a process that finds it finds it whole, and
    processes that build it at once (a Serve replica and a benchmark) each keep the first one renamed."""
    import os
    import shutil
    import tempfile

    out = models_dir / "bench-target"
    if not (out / "config.json").exists():
        log("building the bench target (cosine models bench-target) ...")
        if out.exists() and not (out / "config.json").exists():  # an interrupted build of an older version
            shutil.rmtree(out, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=".bench-target-", dir=models_dir))
        try:
            build_bench_target(models_dir / "target", tmp)
            os.rename(tmp, out)
        except OSError:
            if not (out / "config.json").exists():  # not another process's build: a real failure
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out
