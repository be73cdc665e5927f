"""A drafter runner for any causal LM transformers runs: the model's own forward over per-request caches.

`LlamaRunner` reimplements the layers of the architectures it was tested on, which is what makes it fast; every
other architecture (Gemma 2/3, Phi-3, GPT-NeoX, a Mistral whose sliding window is shorter than the context, ...)
runs here through the model's own forward pass, so its numbers are transformers' by construction: its attention
variants, soft-capping, sliding windows, norms and rotary embeddings included.

Each request has its own `DynamicCache` of full (not windowed) layers: the model's masks apply sliding windows
themselves, and keeping every position is what lets `rollback` cut the cache back anywhere (`DynamicCache.crop`).
Requests are batched where that is exact without padding: a step groups the requests whose cached and new token
counts are both equal, and runs each group as one forward over their caches concatenated along the batch; requests
of different lengths run as separate forwards, since padding them together would change the numbers (pad
positions shift where each request's rotary positions and masks start, and softmax reductions round differently).
Logits come back to the host, as from `LlamaRunner`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from engines.device_work import count
from engines.graphs import DRAFTERS, join_stream, on_stream, role_stream
from engines.interface import CacheFull
from engines.runner import kv_bytes_per_token, resolve_max_len


@dataclass
class _Request:
    cache: DynamicCache = field(default_factory=DynamicCache)
    length: int = 0  # committed tokens; the cache may hold more (the last forward's, until commit or rollback)
    tokens: list[int] = field(default_factory=list)


class TransformersRunner:
    """The `DrafterRunner` protocol (engines/interface.py) over the model's own forward; chains only (a commit keeps
    a prefix of what was fed)."""
    pads_prompts = False  # one forward per (cached length, new tokens): prompts are prefilled one by one

    def __init__(self, model, max_slots: int = 16, max_len: int | None = None):
        self.model = model.eval()
        self.config = model.config.get_text_config(decoder=True)
        self.vocab_size = self.config.vocab_size
        self.max_len = resolve_max_len(self.config, max_len)
        self.max_slots = max_slots
        param = next(model.parameters())
        self.device = param.device
        self.stream = role_stream(self.device, DRAFTERS)  # a drafter's device work, as the fast runner's (graphs.py)
        join_stream(self.stream)  # after the model's upload
        # caches grow as requests do (DynamicCache), up to this when every slot is full
        self.kv_cache_bytes = max_slots * self.max_len * kv_bytes_per_token(self.config, param.dtype)
        self.requests: dict[str, _Request] = {}
        self.forward_seconds = 0.0

    def add(self, rid: str) -> None:
        if rid in self.requests:
            raise KeyError(f"request {rid!r} already present")
        if len(self.requests) >= self.max_slots:
            raise CacheFull(f"all {self.max_slots} slots in use")
        self.requests[rid] = _Request()

    def release(self, rid: str) -> None:
        self.requests.pop(rid, None)

    def __contains__(self, rid: str) -> bool:
        return rid in self.requests

    def length(self, rid: str) -> int:
        return self.requests[rid].length

    def tokens(self, rid: str) -> list[int]:
        return self.requests[rid].tokens

    def rollback(self, rid: str, length: int) -> None:
        r = self.requests[rid]
        if length > r.length:
            raise ValueError(f"cannot roll {rid!r} forward from {r.length} to {length}")
        r.length = length
        del r.tokens[length:]
        self._crop(r)

    @staticmethod
    def _crop(r: _Request) -> None:
        """Drop whatever the cache holds past the committed tokens."""
        extra = r.cache.get_seq_length() - r.length
        if extra > 0:
            r.cache.crop(-extra)

    @torch.no_grad()
    def forward(self, rids: list[str], inputs: list[list[int]], *,
                hidden_only_last: bool = False) -> list[torch.Tensor]:
        t_start = time.perf_counter()
        reqs = [self.requests[r] for r in rids]
        if any(len(x) == 0 for x in inputs):
            raise ValueError("every request needs at least one new token")
        if max(r.length + len(x) for r, x in zip(reqs, inputs)) > self.max_len:
            raise CacheFull(f"context would exceed {self.max_len} tokens")
        groups: dict[tuple[int, int], list[int]] = {}
        for i, (r, x) in enumerate(zip(reqs, inputs)):
            self._crop(r)
            groups.setdefault((r.length, len(x)), []).append(i)
        out: list[torch.Tensor] = [None] * len(rids)
        with on_stream(self.stream):
            for idx in groups.values():
                for i, logits in zip(idx, self._group_step([reqs[i] for i in idx], [inputs[i] for i in idx],
                                                           hidden_only_last)):
                    out[i] = logits
        self.forward_seconds += time.perf_counter() - t_start
        return out

    def _group_step(self, reqs: list[_Request], inputs: list[list[int]], hidden_only_last: bool) -> torch.Tensor:
        """One forward over requests whose cached and new token counts are equal: logits [B, N or 1, vocab] on the
        host."""
        cache = reqs[0].cache if len(reqs) == 1 else DynamicCache(  # their layers' keys/values along the batch
            [(torch.cat([k for k, _, _ in layer]), torch.cat([v for _, v, _ in layer]))
             for layer in zip(*(r.cache for r in reqs))])
        ids = torch.tensor(inputs, device=self.device)
        logits = self.model(input_ids=ids, past_key_values=cache, use_cache=True,
                            logits_to_keep=1 if hidden_only_last else 0).logits
        if len(reqs) > 1:
            for b, r in enumerate(reqs):
                r.cache = DynamicCache([(k[b:b + 1], v[b:b + 1]) for k, v, _ in cache])
        count(host_reads=1)
        return logits.cpu()

    def commit(self, rid: str, new_tokens: list[int], keep: list[int]) -> None:
        if keep != list(range(len(keep))):
            raise ValueError("the transformers runner keeps a prefix of the fed chain only (no token trees)")
        r = self.requests[rid]
        r.length += len(keep)
        r.tokens.extend(new_tokens[:len(keep)])
        self._crop(r)

    def commit_all(self, rid: str, new_tokens: list[int]) -> None:
        self.commit(rid, new_tokens, list(range(len(new_tokens))))
