"""The weights a runner's forward pass uses, laid out for few-token steps.

The Hugging Face Llama modules stay the source of truth (the model is not modified, so callers can still run it
through transformers); this class holds what the runner calls per layer, resolved once:
- q/k/v and gate/up projections fused into one matrix each (one matmul instead of three or two), the modules'
  own weights then views of it, shared by every runner of the model;
- each matrix prepacked for oneDNN where that is faster (engines/cpu_kernels.py), plain otherwise;
- RMSNorm as one fused op, and the rotary embedding's cos/sin as a table indexed by position;
- Qwen3's per-head q/k RMSNorms where the model has them (`qk_norms`, None for the others: no work per step).

A forward step of a 2-layer drafter issues some 60 small ops, and per-op overhead is most of its cost: a drafter
step's forward for one request took 1.6 ms with one module call per projection and norm, 0.8 ms laid out
like this.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engines.cpu_kernels import Linear


def _fuse(mods: tuple[nn.Linear, ...]) -> torch.Tensor:
    """The modules' weights as one matrix, the modules' own weights then views of it (no second copy of them: a
    32B model's weights would not fit twice on one 80 GB GPU); the matrix an earlier runner of the same model made,
    where the weights are still its views."""
    weight = getattr(mods[0], "_fused_weight", None)
    offsets = [sum(m.out_features for m in mods[:i]) for i in range(len(mods))]
    if weight is None or any(m.weight.data_ptr() != weight[o:].data_ptr() for m, o in zip(mods, offsets)):
        weight = torch.cat([m.weight.detach() for m in mods])
        for m, o in zip(mods, offsets):
            m.weight.data = weight[o:o + m.out_features]
        object.__setattr__(mods[0], "_fused_weight", weight)  # not a parameter or buffer of the module
    return weight


class LlamaWeights:
    def __init__(self, model: nn.Module, prepack: bool = True, max_len: int | None = None):
        cfg = model.config
        layers = model.model.layers
        self.act = layers[0].mlp.act_fn
        self.scaling = layers[0].self_attn.scaling
        a0, m0 = layers[0].self_attn, layers[0].mlp
        self.qkv_sizes = [a0.q_proj.out_features, a0.k_proj.out_features, a0.v_proj.out_features]
        self.inter = m0.gate_proj.out_features

        def fused(*mods: nn.Linear) -> Linear:
            weight = mods[0].weight.detach() if len(mods) == 1 else _fuse(mods)
            biases = [m.bias for m in mods]
            bias = None if all(b is None for b in biases) else torch.cat(
                [b.detach() if b is not None else torch.zeros(m.out_features, dtype=weight.dtype, device=weight.device)
                 for m, b in zip(mods, biases)])
            return Linear(weight, bias, prepack)

        self.qkv = [fused(lay.self_attn.q_proj, lay.self_attn.k_proj, lay.self_attn.v_proj) for lay in layers]
        self.o = [fused(lay.self_attn.o_proj) for lay in layers]
        self.gate_up = [fused(lay.mlp.gate_proj, lay.mlp.up_proj) for lay in layers]
        self.down = [fused(lay.mlp.down_proj) for lay in layers]
        self.head = fused(model.lm_head)
        self.norms = [(lay.input_layernorm, lay.post_attention_layernorm) for lay in layers]
        self.qk_norms = ([(lay.self_attn.q_norm, lay.self_attn.k_norm) for lay in layers]
                         if hasattr(a0, "q_norm") else None)
        self.final_norm = model.model.norm
        self.embed_tokens = model.model.embed_tokens
        # cos/sin of every position, computed by the model's own rotary module (the same numbers as per step)
        n = min(max_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        param = next(model.parameters())
        with torch.no_grad():
            positions = torch.arange(n, device=param.device)[None]
            cos, sin = model.model.rotary_emb(torch.zeros(1, dtype=param.dtype, device=param.device), positions)
        self.cos, self.sin = cos[0], sin[0]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids)

    def rotary(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[pos], self.sin[pos]

    @staticmethod
    def norm(module: nn.Module, h: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(h, h.shape[-1:], module.weight, module.variance_epsilon)

    def lm_head(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(h)
