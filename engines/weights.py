"""The weights a runner's forward pass uses: the Hugging Face Llama modules, through prepacked CPU linears where
available (engines/cpu_kernels.py)."""

from __future__ import annotations

import torch
from torch import nn

from engines.cpu_kernels import PackedLinears

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")


def _module(layer: nn.Module, name: str) -> nn.Module:
    return getattr(layer.self_attn if name in ATTN else layer.mlp, name)


class LlamaWeights:
    def __init__(self, model: nn.Module, prepack: bool = True):
        self.model = model
        self.layers = model.model.layers
        self.linear = PackedLinears(model, enabled=prepack)
        self.rotary = model.model.rotary_emb
        self.act = self.layers[0].mlp.act_fn
        self.scaling = self.layers[0].self_attn.scaling

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.model.embed_tokens(ids)

    def norm(self, li: int, name: str, h: torch.Tensor) -> torch.Tensor:
        return (self.model.model.norm if li < 0 else getattr(self.layers[li], name))(h)

    def proj(self, li: int, name: str, x: torch.Tensor) -> torch.Tensor:
        return self.linear(_module(self.layers[li], name), x)

    def lm_head(self, h: torch.Tensor) -> torch.Tensor:
        return self.linear(self.model.lm_head, h)
