"""Batched forward passes of Llama-architecture models with one KV cache per request, for chains and token trees.

All requests live in slots of one preallocated cache ([layers, slots, heads, max_len, head_dim] for keys and for
values). Active requests are kept in the lowest slots so a step attends over a view of the cache instead of a
gathered copy. A step feeds each request a few new tokens whose structure is given by parent indices (a chain is
the special case parent[j] = j - 1); they attend to the request's cached prefix and to their own ancestors, at
positions prefix_len + depth. Their keys/values are written after the prefix but only become part of the cache
when `commit` keeps them, which is also how rejected draft tokens are rolled back.

The layers of the Hugging Face model are reused as they are (projections, norms, MLP, rotary embedding), so the
numbers match `transformers` up to the attention kernel's rounding. That holds for the architectures in
`FAST_MODEL_TYPES` (Llama, Mistral, Qwen2, Qwen3) and is checked per model (`fast_runner_refusal`: e.g. a sliding
attention window shorter than the context is refused); any other causal LM runs as a drafter through
engines/transformers_runner.py.

The runner works on whatever device the model is on (CPU, or CUDA after `model.to("cuda")`): the cache lives
there, the step's index tensors are built on the host and copied over (a chain's one-token step writes its inputs
into one persistent buffer), and logits come back to the host, where the verification rules and samplers run (one
copy per step, which the `.tolist()`s downstream would sync on anyway).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from engines.device_work import count
from engines.graphs import DRAFTERS, GRAPH_MAX_NEW, StepGraphs, join_stream, on_stream, role_stream
from engines.interface import CacheFull
from engines.weights import LlamaWeights

# The architectures this runner's layers reproduce, each tested token for token against transformers
# (tests/test_drafter_architectures.py): Llama's layers, with q/k biases (Qwen2) and per-head q/k RMSNorm (Qwen3).
FAST_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass
class _Slot:
    slot: int
    length: int = 0  # tokens whose keys/values are in the cache
    pending: int = 0  # tokens written by the last forward, not yet committed
    tokens: list[int] = field(default_factory=list)  # the cached tokens, for callers that need them


def tree_depths(parents: list[int]) -> list[int]:
    depth = []
    for p in parents:
        depth.append(0 if p < 0 else depth[p] + 1)
    return depth


def chain_parents(n: int) -> list[int]:
    return list(range(-1, n - 1))


PREFILL_TOKENS = 4096  # prompts prefilled in one forward while (prompts x the longest) stays within this


def prefill_groups(rids: list[str], length, pads: bool = True) -> list[list[str]]:
    """Prompts to prefill, in as few forwards as keep (prompts x longest, padded) within `PREFILL_TOKENS` where the
    runner `pads` prompts (else one forward each): requests admitted together (a batch's arrivals, a drafter's first
    round over new prompts) cost one forward per group, not one per prompt. Sorted by length, so a group pads little."""
    if not pads:
        return [[r] for r in rids]
    groups: list[list[str]] = []
    for r in sorted(rids, key=length):
        if groups and (len(groups[-1]) + 1) * length(r) <= PREFILL_TOKENS:
            groups[-1].append(r)
        else:
            groups.append([r])
    return groups


def prefill(runner, prompts: dict[str, list[int]]) -> int:
    """Feed and commit each request's `prompts` tokens (admitted requests' prompts but the last token), grouped by
    `prefill_groups` where the runner pads prompts; the number of forwards taken."""
    groups = prefill_groups(list(prompts), lambda r: len(prompts[r]), runner.pads_prompts)
    for group in groups:
        runner.forward(group, [prompts[r] for r in group], hidden_only_last=True)
        for r in group:
            runner.commit_all(r, prompts[r])
    return len(groups)


def resolve_max_len(config, max_len: int | None) -> int:
    """The context a runner holds: `max_len`, at most the model's position limit (None: that limit)."""
    limit = getattr(config, "max_position_embeddings", None)
    if limit is None and max_len is None:
        raise ValueError(f"model_type {config.model_type!r} states no position limit: give max_len")
    return min(max_len or limit, limit) if limit else max_len


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Keys and values of one position over all layers, from the model's attention shape: what a runner's cache
    takes per token (multi-head, multi-query and grouped-query attention)."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers * 2 * kv_heads * head_dim * dtype.itemsize


def sliding_window(config) -> int | None:
    """The window of the model's sliding-window attention layers (queries see only the last `window` positions),
    None where every layer attends over the whole context."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)  # Qwen2/3 window some layers only, where configured; Mistral all
    return None if window is None or (types is not None and "sliding_attention" not in types) else window


def fast_runner_refusal(config, max_len: int | None) -> str | None:
    """Why `LlamaRunner` would not compute what transformers computes for this model at this `max_len`, or None
    where it does."""
    kind = config.model_type
    if kind not in FAST_MODEL_TYPES:
        return (f"the fast runner cannot run model_type {kind!r}: it runs only the architectures tested equal to "
                f"transformers ({', '.join(FAST_MODEL_TYPES)}); a drafter of it runs with runner='transformers'")
    n = resolve_max_len(config, max_len)
    window = sliding_window(config)
    if window is not None and window < n:  # the fast runner attends over the whole context
        return (f"the fast runner cannot run this {kind!r} model at max_len {n}: its attention sees only the last "
                f"{window} positions and the fast runner's the whole context; use max_len <= {window}, or (a "
                f"drafter) runner='transformers'")
    rope_type = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if "dynamic" in rope_type or rope_type == "longrope":  # the runner's cos/sin table is built once
        return (f"the fast runner cannot run this {kind!r} model: its rotary embedding ({rope_type}) changes with "
                f"the sequence length; a drafter of it runs with runner='transformers'")
    return None


class LlamaRunner:
    pads_prompts = True  # prompts of different lengths go in one forward, padded (DrafterEngine prefills them so)
    def __init__(self, model, max_slots: int = 16, max_len: int | None = None, prepack: bool = True,
                 graphs: bool | None = None, role: str = DRAFTERS):
        """`model`: a causal LM of an architecture in `FAST_MODEL_TYPES` (ValueError otherwise, or where
        `fast_runner_refusal` finds it would differ from transformers). `graphs`: run chain steps of up to
        `GRAPH_MAX_NEW` new tokens per request at bucketed, padded shapes, replayed from CUDA graphs on a GPU (None:
        on for a model on CUDA; engines/graphs.py). `role`: whose stream its device work goes to on a GPU (the
        verifier's or the drafters', engines/graphs.py)."""
        cfg = model.config
        refusal = fast_runner_refusal(cfg, max_len)
        if refusal:
            raise ValueError(refusal)
        model = model.eval()
        self.model = model
        self.n_layers = cfg.num_hidden_layers
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.vocab_size = cfg.vocab_size
        self.max_len = resolve_max_len(cfg, max_len)
        self.max_slots = max_slots
        dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        self.stream = role_stream(self.device, role)
        join_stream(self.stream)  # after the model's upload
        use_graphs = self.device.type == "cuda" if graphs is None else graphs
        # with graphs one more slot, never a request's: padded steps write their padding's keys/values there
        self.scratch = max_slots
        shape = (self.n_layers, max_slots + (1 if use_graphs else 0), self.n_kv, self.max_len, self.head_dim)
        with on_stream(self.stream):
            self.w = LlamaWeights(model, prepack, self.max_len)
            self.k = torch.zeros(shape, dtype=dtype, device=self.device)
            self.v = torch.zeros(shape, dtype=dtype, device=self.device)
        self.graphs = StepGraphs(self) if use_graphs else None
        # one-token steps' inputs (token, slot, cached length per request) written into one persistent host
        # buffer, not built as tensors each step; the key positions their mask compares against
        self._one = torch.zeros(3, max_slots, dtype=torch.long)
        self._one_np = self._one.numpy()
        self._key_pos = torch.arange(self.max_len, device=self.device)
        self.kv_cache_bytes = 2 * self.k.numel() * self.k.element_size()
        self.requests: dict[str, _Slot] = {}
        self.forward_seconds = 0.0  # time spent in forward passes (benchmarks split it from orchestration)

    def use_cache(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keep the keys/values in `k`, `v` from now on (a drafter pool's views, engines/drafter_pool.py; the caller
        copied them there). The CUDA graphs captured so far address the old cache, which goes now: they are dropped,
        and the shapes captured again (at startup, or on first use)."""
        self.k, self.v = k, v
        if self.graphs is not None:
            self.graphs = StepGraphs(self)

    # ------------------------------------------------------------------ request bookkeeping
    def add(self, rid: str) -> None:
        if rid in self.requests:
            raise KeyError(f"request {rid!r} already present")
        if len(self.requests) >= self.max_slots:
            raise CacheFull(f"all {self.max_slots} slots in use")
        self.requests[rid] = _Slot(slot=len(self.requests))

    def release(self, rid: str) -> None:
        """Free the request's slot; the highest slot moves into the hole so active slots stay contiguous."""
        gone = self.requests.pop(rid, None)
        if gone is None:
            return
        last = len(self.requests)  # index of the highest occupied slot before the pop
        if gone.slot != last:
            mover = next(s for s in self.requests.values() if s.slot == last)
            n = mover.length + mover.pending  # written but not yet committed tokens move too
            with on_stream(self.stream):
                self.k[:, gone.slot, :, :n] = self.k[:, last, :, :n]
                self.v[:, gone.slot, :, :n] = self.v[:, last, :, :n]
            mover.slot = gone.slot

    def length(self, rid: str) -> int:
        return self.requests[rid].length

    def tokens(self, rid: str) -> list[int]:
        return self.requests[rid].tokens

    def __contains__(self, rid: str) -> bool:
        return rid in self.requests

    def rollback(self, rid: str, length: int) -> None:
        s = self.requests[rid]
        if length > s.length:
            raise ValueError(f"cannot roll {rid!r} forward from {s.length} to {length}")
        s.length = length
        del s.tokens[length:]
        s.pending = 0

    # ------------------------------------------------------------------ the forward pass
    @torch.no_grad()
    def forward(self, rids: list[str], inputs: list[list[int]], parents: list[list[int]] | None = None,
                hidden_only_last: bool = False) -> list[torch.Tensor]:
        """Logits [n_i, vocab] for every request's new tokens (or only the last one's, [1, vocab]).

        The new tokens' keys/values are written to the cache but not committed: call `commit` (or `commit_all`).
        """
        t_start = time.perf_counter()
        slots = [self.requests[r] for r in rids]
        if any(len(x) == 0 for x in inputs):
            raise ValueError("every request needs at least one new token")
        if max(s.length + len(x) for s, x in zip(slots, inputs)) > self.max_len:
            raise CacheFull(f"context would exceed {self.max_len} tokens")
        chains = parents is None or all(p == chain_parents(len(p)) for p in parents)
        with on_stream(self.stream):
            if self.graphs is not None and chains and max(map(len, inputs)) <= GRAPH_MAX_NEW:
                logits = self.graphs.step([s.slot for s in slots], [s.length for s in slots], inputs,
                                          hidden_only_last)
            elif all(len(x) == 1 for x in inputs):
                logits = self._step_one(slots, inputs)
            else:
                logits = self._step(slots, inputs, None if chains else parents, hidden_only_last)
            if self.device.type != "cpu":
                logits = logits.cpu()
        count(host_reads=1)
        for s, x in zip(slots, inputs):
            s.pending = len(x)
        out = list(logits.unbind(0)) if hidden_only_last or logits.shape[1] == 1 else \
            [logits[b, :len(x)] for b, x in enumerate(inputs)]
        self.forward_seconds += time.perf_counter() - t_start
        return out

    def _step(self, slots: list[_Slot], inputs: list[list[int]], parents: list[list[int]] | None,
              hidden_only_last: bool) -> torch.Tensor:
        """The step at the exact shapes of its inputs (chains when `parents` is None): logits [B, N or 1, vocab]."""
        B, N = len(slots), max(len(x) for x in inputs)
        lens = torch.tensor([s.length for s in slots])
        n_new = torch.tensor([len(x) for x in inputs])
        total = int((lens + n_new).max())
        ids = torch.tensor([x + [0] * (N - len(x)) for x in inputs])
        steps = torch.arange(N)
        if N == 1 and B == 1:
            pos = lens[:, None]
            mask = None  # one query over the whole prefix and itself: nothing to hide
        elif parents is None:
            # chains: query j sees the prefix and new tokens 0..j; padded queries see key 0 only (finite softmax)
            pos = lens[:, None] + steps
            limit = torch.where(steps < n_new[:, None], pos + 1, 1)
            mask = (torch.arange(total) < limit[..., None])[:, None]
        else:
            pos = torch.zeros(B, N, dtype=torch.long)
            # mask[b, q, key]: may query q of request b attend to cache position key?
            mask = torch.zeros(B, 1, N, total, dtype=torch.bool)
            for b, (s, x, par) in enumerate(zip(slots, inputs, parents)):
                n = len(x)
                pos[b, :n] = s.length + torch.tensor(tree_depths(par))
                mask[b, 0, :, :s.length] = True
                for j in range(n):
                    a = j
                    while a >= 0:  # the node and its ancestors
                        mask[b, 0, j, s.length + a] = True
                        a = par[a]
                if n < N:
                    mask[b, 0, n:, 0] = True

        contiguous = [s.slot for s in slots] == list(range(B))
        slot_idx = torch.tensor([s.slot for s in slots])
        if N == 1:  # one new token each: nothing padded
            b_idx, t_idx = torch.arange(B), torch.zeros(B, dtype=torch.long)
            write_pos = lens
        else:
            valid = steps < n_new[:, None]  # [B, N]: real (not padded) new tokens
            b_idx, t_idx = valid.nonzero(as_tuple=True)
            write_pos = lens[b_idx] + t_idx
        write_slot = slot_idx[b_idx]
        last = n_new - 1
        if self.device.type != "cpu":
            ids, pos, slot_idx, b_idx, t_idx, write_slot, write_pos, last = (
                t.to(self.device, non_blocking=True) for t in
                (ids, pos, slot_idx, b_idx, t_idx, write_slot, write_pos, last))
            mask = None if mask is None else mask.to(self.device, non_blocking=True)

        w = self.w

        def store(li: int, k: torch.Tensor, v: torch.Tensor) -> None:
            self.k[li, write_slot, :, write_pos] = k[b_idx, :, t_idx]
            self.v[li, write_slot, :, write_pos] = v[b_idx, :, t_idx]

        def attended(li: int) -> tuple[torch.Tensor, torch.Tensor]:
            if contiguous:
                return self.k[li, :B, :, :total], self.v[li, :B, :, :total]
            return self.k[li, slot_idx, :, :total], self.v[li, slot_idx, :, :total]

        # a padded token's position may run past the cache's end (a short run beside a longer one): clamped for
        # the rotary table; it is masked and never written
        h = self._layers(w.embed(ids), *w.rotary(pos.clamp(max=self.max_len - 1)), mask, store, attended)
        if hidden_only_last:
            return w.lm_head(h[torch.arange(B, device=self.device), last]).unsqueeze(1)
        return w.lm_head(h)

    def _step_one(self, slots: list[_Slot], inputs: list[list[int]]) -> torch.Tensor:
        """`_step` for one new token per request (a chain's next depth), its inputs from the persistent buffer:
        logits [B, 1, vocab]."""
        B = len(slots)
        lens = [s.length for s in slots]
        self._one_np[0, :B] = [x[0] for x in inputs]
        self._one_np[1, :B] = [s.slot for s in slots]
        self._one_np[2, :B] = lens
        one = self._one[:, :B] if self.device.type == "cpu" else self._one[:, :B].to(self.device)
        ids, slot_idx, pos = one[0, :, None], one[1], one[2]
        total = max(lens) + 1
        # each query sees its request's prefix and itself; alone, that is every key attended over
        mask = None if B == 1 else (self._key_pos[:total] < (pos + 1)[:, None])[:, None, None]
        contiguous = [s.slot for s in slots] == list(range(B))

        def store(li: int, k: torch.Tensor, v: torch.Tensor) -> None:
            self.k[li, slot_idx, :, pos] = k[:, :, 0]
            self.v[li, slot_idx, :, pos] = v[:, :, 0]

        def attended(li: int) -> tuple[torch.Tensor, torch.Tensor]:
            if contiguous:
                return self.k[li, :B, :, :total], self.v[li, :B, :, :total]
            return self.k[li, slot_idx, :, :total], self.v[li, slot_idx, :, :total]

        w = self.w
        return w.lm_head(self._layers(w.embed(ids), *w.rotary(pos[:, None]), mask, store, attended))

    def padded_step(self, ids: torch.Tensor, slot_idx: torch.Tensor, lens: torch.Tensor, n_new: torch.Tensor,
                    hidden_only_last: bool, contiguous: bool) -> torch.Tensor:
        """A chain step at fixed shapes, so that one CUDA graph serves every step of its shape: `ids` [B, N] padded,
        `slot_idx`, `lens`, `n_new` [B] (rows with n_new = 0 are padding). Attention runs over the whole cache
        length under a mask; the keys/values of padding go to the scratch slot. `contiguous`: the rows are slots
        0..B-1 (attend over a view of the cache, not a gathered copy). Logits [B, N or 1, vocab]."""
        B, N = ids.shape
        w = self.w
        steps = torch.arange(N, device=ids.device)
        pos = lens[:, None] + steps
        valid = steps < n_new[:, None]
        write_slot = torch.where(valid, slot_idx[:, None], self.scratch)
        write_pos = torch.where(valid, pos, 0)
        limit = torch.where(valid, pos + 1, 1)  # as in `_step`: the prefix and new tokens 0..j; padding key 0
        mask = (torch.arange(self.max_len, device=ids.device) < limit[..., None])[:, None]

        def store(li: int, k: torch.Tensor, v: torch.Tensor) -> None:
            self.k[li, write_slot, :, write_pos] = k.transpose(1, 2)
            self.v[li, write_slot, :, write_pos] = v.transpose(1, 2)

        def attended(li: int) -> tuple[torch.Tensor, torch.Tensor]:
            if contiguous:
                return self.k[li, :B], self.v[li, :B]
            return self.k[li, slot_idx], self.v[li, slot_idx]

        # padding may run past the cache's end: its positions are clamped for the rotary table, and masked
        h = self._layers(w.embed(ids), *w.rotary(pos.clamp(max=self.max_len - 1)), mask, store, attended)
        if hidden_only_last:
            h = h[torch.arange(B, device=ids.device), (n_new - 1).clamp(min=0)][:, None]
        return w.lm_head(h)

    def _layers(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
                store, attended) -> torch.Tensor:
        """The decoder layers and the final norm over hidden states h [B, N, hidden]: `store(layer, k, v)` writes
        the new tokens' keys/values ([B, kv heads, N, head_dim]) to the cache, `attended(layer)` gives the cached
        keys/values the queries attend over (under `mask`)."""
        w = self.w
        B, N = h.shape[:2]
        for li in range(self.n_layers):
            norm_in, norm_post = w.norms[li]
            q, k, v = w.qkv[li](w.norm(norm_in, h)).split(w.qkv_sizes, dim=-1)
            q = q.view(B, N, self.n_heads, self.head_dim)
            k = k.view(B, N, self.n_kv, self.head_dim)
            if w.qk_norms is not None:  # Qwen3: each head's query and key RMS-normed, before the rotary embedding
                q_norm, k_norm = w.qk_norms[li]
                q, k = w.norm(q_norm, q), w.norm(k_norm, k)
            q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            v = v.view(B, N, self.n_kv, self.head_dim).transpose(1, 2)
            store(li, k, v)
            keys, values = attended(li)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=w.scaling,
                                                 enable_gqa=self.n_kv != self.n_heads)
            h = h + w.o[li](out.transpose(1, 2).reshape(B, N, -1))
            gate, up = w.gate_up[li](w.norm(norm_post, h)).split(w.inter, dim=-1)
            h = h + w.down[li](w.act(gate) * up)
        return w.norm(w.final_norm, h)

    def commit(self, rid: str, new_tokens: list[int], keep: list[int]) -> None:
        """Keep the keys/values of new tokens at indices `keep` (a root-to-node path, in order)."""
        s = self.requests[rid]
        if keep != list(range(len(keep))):  # a tree path: move the kept nodes next to the prefix
            with on_stream(self.stream):
                src = torch.tensor(keep, device=self.device) + s.length
                dst = torch.arange(len(keep), device=self.device) + s.length
                self.k[:, s.slot, :, dst] = self.k[:, s.slot, :, src]
                self.v[:, s.slot, :, dst] = self.v[:, s.slot, :, src]
        s.length += len(keep)
        s.tokens.extend(new_tokens[i] for i in keep)
        s.pending = 0

    def commit_all(self, rid: str, new_tokens: list[int]) -> None:
        self.commit(rid, new_tokens, list(range(len(new_tokens))))


@torch.no_grad()
def step_seconds(model, batch: int, context: int, new: int, repeats: int = 5, make_runner=None) -> float:
    """Median time of one batched step feeding `new` chain tokens per request after `context` cached tokens.
    `make_runner(model, max_slots, max_len)`: the runner to time (a drafter's own kind); None: `LlamaRunner`."""
    runner = (make_runner or LlamaRunner)(model, max_slots=batch, max_len=context + new + 8)
    rids = [f"r{i}" for i in range(batch)]
    prefix = [3 + (i % 1000) for i in range(context)]
    for r in rids:
        runner.add(r)
        runner.forward([r], [prefix], hidden_only_last=True)
        runner.commit_all(r, prefix)
    runner.forward(rids, [list(range(5, 5 + new))] * batch)  # warm-up
    times = []
    for _ in range(repeats):
        for r in rids:
            runner.rollback(r, context)
        t = time.perf_counter()
        runner.forward(rids, [list(range(5, 5 + new))] * batch)
        times.append(time.perf_counter() - t)
    return statistics.median(times)
