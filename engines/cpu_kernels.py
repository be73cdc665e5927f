"""Prepacked linear weights for CPU inference.

PyTorch's default CPU matmul repacks the weight matrix on every call. With one token (a matrix-vector product) that
is cheap, but a verify step feeds a few tokens per request, and for 2-32 rows the repacking dominates: on a 2-core
x86 machine a 5-token step of the bench target cost 2.5x a 1-token step. oneDNN can pack a weight once into its
blocked layout (the same op PyTorch's inductor uses when it freezes a CPU model); with packed weights the 5-token
step costs about 1.3x the 1-token step, which is what makes speculation pay on a CPU at all.

`PackedLinears` keeps packed copies next to the model (the model itself is not modified, so callers can still run
it through transformers) and is used as `linears(module, x)` in place of `module(x)`. It switches itself off, and
falls back to `module(x)`, where the op is missing, the model is not float32 on CPU, or a self-check disagrees.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)


def _op_available() -> bool:
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int):
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), packed, bias, "none", [], "")
    return y.view(*x.shape[:-1], out_features)


class PackedLinears:
    def __init__(self, model: nn.Module, enabled: bool = True):
        self.packed: dict[nn.Module, torch.Tensor] = {}
        param = next(model.parameters())
        if not (enabled and param.device.type == "cpu" and param.dtype == torch.float32 and _op_available()):
            return
        try:
            for m in model.modules():
                if isinstance(m, nn.Linear):
                    self.packed[m] = torch.ops.mkldnn._reorder_linear_weight(m.weight.detach(), None)
            self._self_check()
        except Exception as e:  # an unsupported build: plain matmuls are correct, only slower
            log.warning("prepacked CPU linears disabled: %s", e)
            self.packed = {}

    @property
    def enabled(self) -> bool:
        return bool(self.packed)

    @torch.no_grad()
    def _self_check(self) -> None:
        m = next(iter(self.packed))
        for rows in (1, 5):
            x = torch.randn(rows, m.in_features, generator=torch.Generator().manual_seed(rows))
            want = F.linear(x, m.weight, m.bias)
            got = self(m, x)
            if not torch.allclose(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max())):
                raise RuntimeError("packed linear disagrees with F.linear")

    def __call__(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        packed = self.packed.get(module)
        if packed is None:
            return module(x)
        return _packed_linear(x, packed, module.bias, module.out_features)


class PackedLinear(nn.Module):
    """A drop-in nn.Linear replacement holding a packed weight, for code that runs the model's own forward
    (the benchmark gives Hugging Face's assisted generation the same kernels as our engine)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None),
                             persistent=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _packed_linear(x, self.packed, self.bias, self.out_features)


def pack_linear_modules(model: nn.Module) -> nn.Module:
    """Replace every nn.Linear of `model` (in place) with a PackedLinear; a no-op where packing is unavailable."""
    if not PackedLinears(model).enabled:
        return model
    for mod in list(model.modules()):
        for name, child in list(mod.named_children()):
            if isinstance(child, nn.Linear):
                setattr(mod, name, PackedLinear(child))
    return model
