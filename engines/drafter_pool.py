"""Drafters of one shape stepping together: one batched forward per depth for every drafter and request.

Several drafters of the same shape (same config apart from the weights, the fast runner) each cost a forward pass
per depth when they step alone; on a CPU a small drafter's step is mostly the fixed cost of its ~60 ops, so a
round that used three drafters cost three steps per depth. `DrafterPool` runs them as one: each layer's weights
stacked on a leading drafter axis, each drafter's requests padded to the largest drafter's count, the projections
as batched matmuls over that axis, attention over each request's own KV slots. The ops per depth do not grow with
the drafters or the requests.

The pooled drafters stay `DrafterEngine`s: their requests, pending tokens and caches are theirs, and each can
still step alone (its own runner, prepacked weights). Their KV caches become views of one stacked cache
[layers, drafter, slot, kv heads, max_len, head_dim], so that a pooled step reads and writes every drafter's slots
with one indexing op per layer. A pooled step gives each request what its drafter's own step gives (token,
probability, top alternatives, context log-likelihood), up to float rounding: tests/test_drafter_pool.py.

A step over a subset of the drafters (those with requests at this depth) uses that subset's weights stacked;
the last few subsets' stacks are kept (`SUBSETS_KEPT`), since routing keeps using the same drafters. A step with
one drafter runs as that drafter's own step. Prompts (more than `LONG_PENDING` tokens pending) are prefilled by
their drafter alone, as `DrafterEngine.step` does. Runners with CUDA graphs are not pooled: on a GPU each
drafter's step is already one graph replay.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Collection

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from engines.drafter import LONG_PENDING, DrafterEngine, context_loglik
from engines.interface import Proposal
from engines.runner import LlamaRunner

SUBSETS_KEPT = 8

# config fields that differ between same-shape models without changing the computation
_NOT_SHAPE = {"_name_or_path", "name_or_path", "transformers_version", "architectures", "dtype", "torch_dtype"}


def pool_shape(engine) -> tuple | None:
    """What must agree for drafters to step together (None: this engine steps alone): a `DrafterEngine` on the
    fast runner without CUDA graphs, its config apart from names, its dtype, device, slots, context and what it
    proposes."""
    if type(engine) is not DrafterEngine or type(engine.runner) is not LlamaRunner or engine.runner.graphs:
        return None
    r = engine.runner
    cfg = {k: v for k, v in engine.model.config.to_dict().items() if k not in _NOT_SHAPE}
    return (repr(sorted(cfg.items())), r.k.dtype, str(r.device), tuple(r.k.shape), engine.vocab_limit,
            engine.top_alternatives)


def _stack(ts: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(ts).contiguous()


class _Stacked:
    """The weights of some of the pool's drafters, stacked on a leading axis, laid out for `torch.bmm` (the
    projections [drafters, in, out], biases [drafters, 1, out], norm weights [drafters, 1, hidden])."""

    def __init__(self, ws):
        def linear(lins):
            weight = _stack([lin.weight.t() for lin in lins])
            bias = None if lins[0].bias is None else _stack([lin.bias[None] for lin in lins])
            return weight, bias

        def norm(mods):
            return _stack([m.weight[None] for m in mods])

        n_layers = len(ws[0].qkv)
        self.qkv = [linear([w.qkv[li] for w in ws]) for li in range(n_layers)]
        self.o = [linear([w.o[li] for w in ws]) for li in range(n_layers)]
        self.gate_up = [linear([w.gate_up[li] for w in ws]) for li in range(n_layers)]
        self.down = [linear([w.down[li] for w in ws]) for li in range(n_layers)]
        self.head = linear([w.head for w in ws])
        self.norm_in = [norm([w.norms[li][0] for w in ws]) for li in range(n_layers)]
        self.norm_post = [norm([w.norms[li][1] for w in ws]) for li in range(n_layers)]
        self.final_norm = norm([w.final_norm for w in ws])
        # Qwen3's per-head q/k norms: [drafters, 1, 1, 1, head_dim] against q/k [drafters, rows, tokens, heads, dim]
        self.qk_norms = None if ws[0].qk_norms is None else [
            tuple(norm([w.qk_norms[li][j] for w in ws])[:, :, None, None] for j in range(2))
            for li in range(n_layers)]


def _mm(x: torch.Tensor, wb: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
    w, b = wb
    return torch.bmm(x, w) if b is None else torch.baddbmm(b, x, w)


class DrafterPool:
    """Same-shape `DrafterEngine`s (`pool_shape` equal; ValueError otherwise) stepping together. Not re-entrant,
    and the engines must not step alone while a pooled step runs: one thread drives them all."""

    def __init__(self, engines: list[DrafterEngine]):
        shapes = {pool_shape(e) for e in engines}
        if len(engines) < 2 or None in shapes or len(shapes) != 1:
            raise ValueError("a drafter pool takes two or more drafters of one shape (pool_shape), each a "
                             "DrafterEngine on the fast runner without CUDA graphs")
        self.engines = {e.name: e for e in engines}
        if len(self.engines) != len(engines):
            raise ValueError("the pooled drafters need distinct names")
        self.index = {name: i for i, name in enumerate(self.engines)}
        runners = [e.runner for e in engines]
        r0 = runners[0]
        for r in runners[1:]:
            if not (torch.equal(r.w.cos, r0.w.cos) and torch.equal(r.w.sin, r0.w.sin)):
                raise ValueError("pooled drafters must share their rotary embedding")
        self.n_layers, self.n_heads, self.n_kv, self.head_dim = r0.n_layers, r0.n_heads, r0.n_kv, r0.head_dim
        self.vocab, self.device, self.w0 = r0.vocab_size, r0.device, r0.w
        self.eps = engines[0].model.config.rms_norm_eps
        # one cache for all: each runner's keys/values become its drafter's view of it (contents kept)
        self.k = torch.stack([r.k for r in runners], dim=1)
        self.v = torch.stack([r.v for r in runners], dim=1)
        for i, r in enumerate(runners):
            r.k, r.v = self.k[:, i], self.v[:, i]
        self.embed = torch.cat([r.w.embed_tokens.weight.detach() for r in runners])  # [drafters * vocab, hidden]
        self.subsets: OrderedDict[tuple[int, ...], _Stacked] = OrderedDict()
        self.forward_passes = 0
        self.forward_seconds = 0.0

    def _weights(self, members: tuple[int, ...]) -> _Stacked:
        got = self.subsets.get(members)
        if got is None:
            runners = [e.runner for e in self.engines.values()]
            got = self.subsets[members] = _Stacked([runners[i].w for i in members])
            while len(self.subsets) > SUBSETS_KEPT:
                self.subsets.popitem(last=False)
        self.subsets.move_to_end(members)
        return got

    # ------------------------------------------------------------------ steps
    @torch.no_grad()
    def step(self, rids: dict[str, list[str]], want_loglik: Collection[str] = ()) -> dict[str, dict[str, Proposal]]:
        """`DrafterEngine.step` of every named drafter over its `rids`, in one forward where more than one drafter
        takes part; `want_loglik`: the drafters whose step wants the context's log-likelihood."""
        out: dict[str, dict[str, Proposal]] = {n: {} for n in rids}
        short: dict[str, list[str]] = {}
        for name, group in rids.items():
            engine = self.engines[name]
            long = [r for r in group if len(engine.states[r].pending) > LONG_PENDING]
            rest = [r for r in group if len(engine.states[r].pending) <= LONG_PENDING]
            for r in long:  # prompts: prefilled alone, as the engine does
                out[name] |= engine.step([r], want_loglik=name in want_loglik)
            if rest:
                short[name] = rest
        if len(short) == 1:
            (name, group), = short.items()
            out[name] |= self.engines[name].step(group, want_loglik=name in want_loglik)
        elif short:
            self._pooled(short, want_loglik, out)
        return out

    def draft(self, rids: dict[str, list[str]], k: dict[str, dict[str, int]]) -> dict[str, dict[str, list[Proposal]]]:
        """`DrafterEngine.draft` of every named drafter, each depth one pooled step: chains of up to k[name][rid]
        proposals, each fed back as that drafter's next input."""
        chains = {n: {r: [] for r in group} for n, group in rids.items()}
        active = {n: [r for r in group if k[n].get(r, 0) > 0] for n, group in rids.items()}
        for _ in range(max((x for ks in k.values() for x in ks.values()), default=0)):
            for n in list(active):
                e = self.engines[n]
                active[n] = [r for r in active[n] if len(chains[n][r]) < k[n][r]
                             and e.runner.length(r) + len(e.states[r].pending) + 1 < e.runner.max_len]
                if not active[n]:
                    del active[n]
            if not active:
                break
            for n, props in self.step(active).items():
                for r, p in props.items():
                    chains[n][r].append(p)
                    if len(chains[n][r]) < k[n][r]:
                        self.engines[n].feed(r, [p.token])
        return chains

    def _pooled(self, groups: dict[str, list[str]], want_loglik: Collection[str],
                out: dict[str, dict[str, Proposal]]) -> None:
        t_start = time.perf_counter()
        names = sorted(groups, key=self.index.get)
        members = tuple(self.index[n] for n in names)
        P, B = len(names), max(len(groups[n]) for n in names)
        inputs = {n: [self.engines[n].states[r].pending for r in groups[n]] for n in names}
        N = max(len(x) for n in names for x in inputs[n])
        full = [n in want_loglik and any(len(x) > 1 for x in inputs[n]) for n in names]
        # one row per (drafter, request slot): token ids | pool index | slot | cached length | new tokens
        rows = []
        for n in names:
            runner = self.engines[n].runner
            for r, x in zip(groups[n], inputs[n]):
                s = runner.requests[r]
                rows.append(x + [0] * (N - len(x)) + [self.index[n], s.slot, s.length, len(x)])
            rows += [[0] * N + [self.index[n], 0, 0, 0]] * (B - len(groups[n]))
        host = torch.tensor(rows).view(P, B, N + 4)
        h = self._forward(self._weights(members), host.to(self.device), N, hidden_only_last=not any(full))
        logits = h.cpu() if self.device.type != "cpu" else h  # [P, B, N or 1, vocab]
        self.forward_passes += 1
        props = self.engines[names[0]]._propose(logits[torch.arange(P)[:, None], torch.arange(B),
                                                       (host[..., N + 3] - 1).clamp(min=0) if any(full) else 0]
                                                .view(P * B, -1))
        for i, n in enumerate(names):
            engine = self.engines[n]
            engine.forward_passes += 1
            for b, (r, x) in enumerate(zip(groups[n], inputs[n])):
                engine.runner.requests[r].pending = len(x)
                engine.runner.commit_all(r, x)
                engine.states[r].pending = []
                p = out[n][r] = props[i * B + b]
                if full[i] and len(x) > 1:
                    p.context_loglik = context_loglik(logits[i, b, :len(x)], x)
        self.forward_seconds += time.perf_counter() - t_start

    def _forward(self, w: _Stacked, host: torch.Tensor, N: int, hidden_only_last: bool) -> torch.Tensor:
        """The drafters' layers over host [P, B, N + 4] (see `_pooled`): logits [P, B, N or 1, vocab]. As
        `LlamaRunner._step` for chains, each drafter's rows against its own weights and cache slots."""
        P, B = host.shape[:2]
        ids, pidx, slot, lens, n_new = host[..., :N], host[..., N], host[..., N + 1], host[..., N + 2], host[..., N + 3]
        steps = torch.arange(N, device=host.device)
        pos = lens[..., None] + steps  # [P, B, N]
        valid = steps < n_new[..., None]
        total = int((lens + n_new).max())
        # query j sees its request's prefix and new tokens 0..j; padding sees key 0 only (a finite softmax)
        limit = torch.where(valid, pos + 1, 1).view(P * B, N)
        mask = (torch.arange(total, device=host.device) < limit[..., None])[:, None]
        pv, bv, tv = valid.nonzero(as_tuple=True)  # the real new tokens: where their keys/values go
        w_pool, w_slot, w_pos, w_row = pidx[pv, bv], slot[pv, bv], pos[pv, bv, tv], pv * B + bv
        r_pool, r_slot = pidx.reshape(-1), slot.reshape(-1)
        cos, sin = self.w0.cos[pos.view(P * B, N)], self.w0.sin[pos.view(P * B, N)]

        h = F.embedding(ids + pidx[..., None] * self.vocab, self.embed).view(P, B * N, -1)
        H, KV, D = self.n_heads, self.n_kv, self.head_dim
        sizes = self.w0.qkv_sizes
        for li in range(self.n_layers):
            x = F.rms_norm(h, h.shape[-1:], eps=self.eps) * w.norm_in[li]
            q, k, v = _mm(x, w.qkv[li]).split(sizes, dim=-1)
            q, k = q.reshape(P, B * N, H, D), k.reshape(P, B * N, KV, D)
            if w.qk_norms is not None:
                qn, kn = w.qk_norms[li]
                q = F.rms_norm(q, (D,), eps=self.eps) * qn[:, 0]
                k = F.rms_norm(k, (D,), eps=self.eps) * kn[:, 0]
            q = q.view(P * B, N, H, D).transpose(1, 2)
            k = k.view(P * B, N, KV, D).transpose(1, 2)
            v = v.reshape(P * B, N, KV, D).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            self.k[li, w_pool, w_slot, :, w_pos] = k[w_row, :, tv]
            self.v[li, w_pool, w_slot, :, w_pos] = v[w_row, :, tv]
            keys, values = self.k[li, r_pool, r_slot, :, :total], self.v[li, r_pool, r_slot, :, :total]
            att = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.w0.scaling,
                                                 enable_gqa=KV != H)
            h = h + _mm(att.transpose(1, 2).reshape(P, B * N, -1), w.o[li])
            gate, up = _mm(F.rms_norm(h, h.shape[-1:], eps=self.eps) * w.norm_post[li], w.gate_up[li]).split(
                self.w0.inter, dim=-1)
            h = h + _mm(self.w0.act(gate) * up, w.down[li])
        h = F.rms_norm(h, h.shape[-1:], eps=self.eps) * w.final_norm
        h = h.view(P, B, N, -1)
        if hidden_only_last:
            h = h[torch.arange(P, device=h.device)[:, None], torch.arange(B, device=h.device),
                  (n_new - 1).clamp(min=0)][:, :, None]
        return _mm(h.reshape(P, -1, h.shape[-1]), w.head).view(P, B, h.shape[2], -1)
