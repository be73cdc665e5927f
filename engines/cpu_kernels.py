"""Prepacked linear weights for CPU inference.

PyTorch's default CPU matmul repacks the weight matrix on every call. With one token (a matrix-vector product) that
is cheap, but a verify step feeds a few tokens per request, and for 4-32 rows the repacking dominates: on a 2-core
x86 machine a 5-token step of the bench target cost 2.5x a 1-token step. oneDNN can pack a weight once into its
blocked layout (the same op PyTorch's inductor uses when it freezes a CPU model); with packed weights the 5-token
step costs about 1.3x the 1-token step, which is what makes speculation pay on a CPU at all.

`Linear` holds one weight, packed where that pays (steps of `PACKED_MIN_ROWS` rows or more), and falls back to a
plain matmul where the op is missing, the weight is not float32 on CPU, or a self-check disagrees.
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


# Below this many weights a packed matmul loses to a plain one: oneDNN's fixed cost per call (~10 us) outweighs
# the repacking it saves (measured on x86, 1-5 rows: 256x256 plain 6-17 us vs packed 18-22; 256x704 plain 16-50
# vs packed 27-36; 512x512 plain 24-72 vs packed 32-47). A drafter's projections stay plain, its LM head is packed.
PACK_MIN_WEIGHTS = 1 << 17
# Below this many rows a plain matmul beats the packed one even for a packed weight (measured on the 2-core x86 CPU,
# one and two threads, warm: 8192x128 at one row 239 us plain against 289 packed, 4608x1536 1299 against 1367; at
# four rows packed wins, 289 against 444 and 1459 against 2571; with the caches cold, as after a verify step, the
# drafter's 8192x128 LM head at one row 0.58-0.64 ms plain against 0.77-0.80). A chain's one-token drafter steps run
# plain, verify steps of several tokens packed.
PACKED_MIN_ROWS = 4


def _few_rows(x: torch.Tensor) -> bool:
    return x.numel() < PACKED_MIN_ROWS * x.shape[-1]


_packing_checked: bool | None = None


def packing_available(param: torch.Tensor) -> bool:
    """Whether weights like `param` (float32 on CPU) can be packed here; the op is self-checked once."""
    global _packing_checked
    if not (param.device.type == "cpu" and param.dtype == torch.float32 and _op_available()):
        return False
    if _packing_checked is None:
        try:
            _packing_checked = _self_check()
        except Exception as e:  # an unsupported build: plain matmuls are correct, only slower
            log.warning("prepacked CPU linears disabled: %s", e)
            _packing_checked = False
    return _packing_checked


@torch.no_grad()
def _self_check() -> bool:
    w = torch.randn(512, 384, generator=torch.Generator().manual_seed(0))
    packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
    for rows in (1, 5):
        x = torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(rows))
        want = F.linear(x, w)
        if not torch.allclose(_packed_linear(x, packed, None, w.shape[0]), want, rtol=1e-4,
                              atol=1e-4 * float(want.abs().max())):
            raise RuntimeError("packed linear disagrees with F.linear")
    return True


class Linear:
    """`x @ weight.T + bias`, through a prepacked weight where packing is available and pays (`prepack` off:
    always plain)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, prepack: bool = True):
        self.weight, self.bias, self.out_features = weight, bias, weight.shape[0]
        self.packed = None
        if prepack and weight.numel() >= PACK_MIN_WEIGHTS and packing_available(weight):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None or _few_rows(x):
            return F.linear(x, self.weight, self.bias)
        return _packed_linear(x, self.packed, self.bias, self.out_features)


class PackedLinear(nn.Module):
    """A drop-in nn.Linear replacement holding a packed weight, for code that runs the model's own forward
    (the benchmark gives Hugging Face's assisted generation the same kernels as our engine)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None),
                             persistent=False)
        self.weight, self.bias = linear.weight, linear.bias  # the plain weight, for steps of few rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _few_rows(x):
            return F.linear(x, self.weight, self.bias)
        return _packed_linear(x, self.packed, self.bias, self.out_features)


def pack_linear_modules(model: nn.Module) -> nn.Module:
    """Replace every nn.Linear of `model` big enough to gain (in place) with a PackedLinear; a no-op where packing
    is unavailable."""
    if not packing_available(next(model.parameters())):
        return model
    for mod in list(model.modules()):
        for name, child in list(mod.named_children()):
            if isinstance(child, nn.Linear) and child.weight.numel() >= PACK_MIN_WEIGHTS:
                setattr(mod, name, PackedLinear(child))
    return model
