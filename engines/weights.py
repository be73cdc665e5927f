"""The weights a runner's forward pass uses: one Llama model, or several same-shaped ones stacked.

`LlamaWeights` calls the Hugging Face modules (through prepacked CPU linears where available). `StackedLlamaWeights`
holds several drafters of one architecture (the domain drafters of a family) and runs them in ONE forward pass:
each request names its model, every projection is a batched matmul over [models, rows, features] with each
model's rows gathered into its own block. A lockstep drafting step of eight requests spread over six domain
drafters then costs about one small forward instead of six, which is what decides whether speculation pays at
batch 8 when all drafters share one device.
"""

from __future__ import annotations

import torch
from torch import nn

from engines.cpu_kernels import PackedLinears

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


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
        self.n_models = 1

    def bind(self, model_idx: torch.Tensor) -> None:
        """Which model each request of the coming forward uses (one model here: nothing to do)."""

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.model.embed_tokens(ids)

    def norm(self, li: int, name: str, h: torch.Tensor) -> torch.Tensor:
        return (self.model.model.norm if li < 0 else getattr(self.layers[li], name))(h)

    def proj(self, li: int, name: str, x: torch.Tensor) -> torch.Tensor:
        return self.linear(_module(self.layers[li], name), x)

    def lm_head(self, h: torch.Tensor) -> torch.Tensor:
        return self.linear(self.model.lm_head, h)


class StackedLlamaWeights:
    def __init__(self, models: list[nn.Module]):
        first = models[0].config
        for m in models[1:]:
            c = m.config
            for attr in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                         "num_key_value_heads", "vocab_size", "hidden_act", "rms_norm_eps"):
                if getattr(c, attr) != getattr(first, attr):
                    raise ValueError(f"stacked drafters must share an architecture: {attr} differs")
        self.model = models[0]  # rotary embedding, activation, config
        self.layers = models[0].model.layers
        self.rotary = models[0].model.rotary_emb
        self.act = self.layers[0].mlp.act_fn
        self.scaling = self.layers[0].self_attn.scaling
        self.eps = first.rms_norm_eps
        self.n_models = len(models)
        n_layers = first.num_hidden_layers
        with torch.no_grad():
            self.emb = torch.stack([m.model.embed_tokens.weight.detach() for m in models])  # [M, V, H]
            self.w = {(li, name): torch.stack([_module(m.model.layers[li], name).weight.detach().t()
                                               for m in models]).contiguous()  # [M, in, out]
                      for li in range(n_layers) for name in ATTN + MLP}
            self.norms = {(li, name): torch.stack([getattr(m.model.layers[li], name).weight.detach()
                                                   for m in models])
                          for li in range(n_layers) for name in ("input_layernorm", "post_attention_layernorm")}
            self.norms[(-1, "norm")] = torch.stack([m.model.norm.weight.detach() for m in models])
            self.head = torch.stack([m.lm_head.weight.detach().t() for m in models]).contiguous()  # [M, H, V]
        self.model_idx = torch.zeros(0, dtype=torch.long)
        self.single: int | None = None
        self._layouts: dict[int, tuple] = {}

    def bind(self, model_idx: torch.Tensor) -> None:
        self.model_idx = model_idx
        self._layouts = {}
        used = model_idx.unique()
        self.single = int(used[0]) if len(used) == 1 else None  # one model in use: plain matmuls, no padding

    def _layout(self, rows: int):
        """Gather index [M * L] into the flattened rows (padding points past the end, at a zero row) and the
        position of every real row in the padded [M, L] blocks, for `rows` rows per request."""
        if rows not in self._layouts:
            idx, B = self.model_idx.cpu(), len(self.model_idx)
            counts = torch.bincount(idx, minlength=self.n_models)
            per_block = int(counts.max())
            rank = torch.zeros(B, dtype=torch.long)  # a request's place among the requests of its model
            seen = [0] * self.n_models
            for b, m in enumerate(idx.tolist()):
                rank[b] = seen[m]
                seen[m] += 1
            L = per_block * rows
            flat = (idx * L + rank * rows)[:, None] + torch.arange(rows)  # [B, rows]
            gather = torch.full((self.n_models * L,), B * rows, dtype=torch.long)
            gather[flat.reshape(-1)] = torch.arange(B * rows)
            dev = self.emb.device
            self._layouts[rows] = (gather.to(dev), flat.reshape(-1).to(dev), L)
        return self._layouts[rows]

    def _bmm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x [B, rows, in] with request b using model idx[b]; w [M, in, out]."""
        if self.single is not None:
            return x @ w[self.single]
        B, rows, fin = x.shape
        gather, flat, L = self._layout(rows)
        xf = torch.cat([x.reshape(B * rows, fin), x.new_zeros(1, fin)])
        y = torch.bmm(xf[gather].view(self.n_models, L, fin), w)
        return y.view(-1, w.shape[-1])[flat].view(B, rows, -1)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.emb[self.model_idx[:, None], ids]

    def norm(self, li: int, name: str, h: torch.Tensor) -> torch.Tensor:
        hf = h.float()
        hf = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.norms[(li, name)][self.model_idx][:, None, :] * hf.to(h.dtype)

    def proj(self, li: int, name: str, x: torch.Tensor) -> torch.Tensor:
        return self._bmm(x, self.w[(li, name)])

    def lm_head(self, h: torch.Tensor) -> torch.Tensor:
        if h.dim() == 2:  # [B, H]: one row per request
            return self._bmm(h[:, None], self.head)[:, 0]
        return self._bmm(h, self.head)
