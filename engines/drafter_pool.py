"""Drafters of one shape stepping together: one batched forward per depth for every drafter and request.

Several drafters of the same shape (same config apart from the weights, the fast runner) each cost a forward pass
per depth when they step alone; a small drafter's step is mostly fixed cost (its ~60 ops on a CPU, their kernel
launches on a GPU), so a round that used three drafters cost three steps per depth. `DrafterPool` runs them as one:
each layer's weights stacked on a leading drafter axis, each drafter's requests padded to the largest drafter's
count, the projections as batched matmuls over that axis, attention over each request's own KV slots. The ops per
depth do not grow with the drafters or the requests, and the proposals (token, probability, top alternatives,
context log-likelihood) are computed on the device and read on the host once per forward.

The pooled drafters stay `DrafterEngine`s: their requests, pending tokens and caches are theirs, and each can
still step alone (its own runner, prepacked weights). Their KV caches become views of one stacked cache
[layers, drafter, slot, kv heads, max_len, head_dim] (one slot more than any runner's: the padding's, `scratch`),
so that a pooled step reads and writes every drafter's slots with one indexing op per layer. A runner re-pointed so
drops the CUDA graphs it had (they address its old cache, freed then); a pool over engines that already share one
(a pool before it over the same engines) keeps that cache, and their graphs (tests/test_graphs.py). A pooled step
gives each request what its drafter's own step gives, up to float rounding: tests/test_drafter_pool.py.

Two ways to step:
- eager (the CPU default): the drafters with requests at this depth, at the exact shapes of their inputs; the
  last few subsets' stacked weights are kept (`SUBSETS_KEPT`), since routing keeps using the same drafters. A step
  of one drafter runs as that drafter's own step.
- padded (`padded`, the default where the runners step at padded shapes: on a GPU): every pool drafter at fixed
  shapes, requests per drafter and new tokens rounded up to buckets, padding rows writing to the scratch slot,
  attention over the whole cache under a mask: one CUDA graph per (requests, tokens) bucket, all captured by
  `capture` at startup, so a depth is one replay whatever drafters and requests the round uses. On a CPU the same
  arithmetic runs directly (how the tests check it).
Prompts (more than `LONG_PENDING` tokens pending: routing's cold start scores every drafter on each new prompt) are
prefilled together in one eager forward per step, with their context log-likelihoods.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Collection

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from engines.device_work import count
from engines.drafter import LOGLIK_FLOOR, LONG_PENDING, DrafterEngine
from engines.graphs import GRAPH_MAX_NEW, CapturedGraphs, bucket, buckets, on_stream
from engines.interface import Proposal
from engines.runner import LlamaRunner

SUBSETS_KEPT = 8

# config fields that differ between same-shape models without changing the computation
_NOT_SHAPE = {"_name_or_path", "name_or_path", "transformers_version", "architectures", "dtype", "torch_dtype"}


def pool_shape(engine) -> tuple | None:
    """What must agree for drafters to step together (None: this engine steps alone): a `DrafterEngine` on the
    fast runner, its config apart from names, its dtype, device, slots, context and what it proposes."""
    if type(engine) is not DrafterEngine or type(engine.runner) is not LlamaRunner:
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


def _choose(logits: torch.Tensor, vocab_limit: int | None, top: int) -> torch.Tensor:
    """`DrafterEngine._propose`'s choice over rows of `logits` [..., vocab], on the logits' device, packed for one
    host read: [..., 2 + 2 top] = token, its probability, the top ids, their probabilities (float64: ids exact;
    `top` 0: no top-k over the vocabulary)."""
    logits = logits[..., :vocab_limit]
    q = torch.softmax(logits.float(), dim=-1)
    probs, tokens = q.max(-1, keepdim=True)
    chosen = [tokens.double(), probs.double()]
    if top:
        top_p, top_i = q.topk(top, dim=-1)
        chosen += [top_i.double(), top_p.double()]
    return torch.cat(chosen, dim=-1)


def _proposal(row: list[float], top: int, loglik: float | None, alternatives: bool) -> Proposal:
    """The proposal in a `_choose` row; without `alternatives`, its token alone as its top (`DrafterEngine.step`)."""
    token = int(row[0])
    if not alternatives:
        return Proposal(token, row[1], [token], [row[1]], loglik)
    return Proposal(token, row[1], [int(t) for t in row[2:2 + top]], row[2 + top:2 + 2 * top], loglik)


def _pooled_cache(runners: list[LlamaRunner]) -> tuple[torch.Tensor, torch.Tensor]:
    """One cache for all [layers, drafter, slot, ...], one slot more (the padding's): each runner's keys/values
    copied there and the runner re-pointed to its drafter's view of it (`LlamaRunner.use_cache`, dropping the CUDA
    graphs that addressed the old cache)."""
    r0, n = runners[0], len(runners)
    k = torch.cat([torch.stack([r.k for r in runners], dim=1),
                   torch.zeros_like(r0.k[:, None, :1]).expand(-1, n, -1, -1, -1, -1)], dim=2).contiguous()
    v = torch.cat([torch.stack([r.v for r in runners], dim=1),
                   torch.zeros_like(r0.v[:, None, :1]).expand(-1, n, -1, -1, -1, -1)], dim=2).contiguous()
    slots = r0.k.shape[1]
    for i, r in enumerate(runners):
        r.use_cache(k[:, i, :slots], v[:, i, :slots])
    return k, v


def _shared_cache(runners: list[LlamaRunner]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The cache the runners already share as pool drafters 0..n-1 in this order (a pool before this one over the
    same engines: benchmarks keep engines across loops), so that they are not re-pointed and keep their CUDA
    graphs; None if they do not."""
    k, v = runners[0].k._base, runners[0].v._base
    slots = runners[0].k.shape[1]
    if k is None or v is None or k.dim() != 6 or k.shape[1:3] != (len(runners), slots + 1):
        return None
    same = all(r.k._base is k and r.v._base is v and r.k.data_ptr() == k[:, i, :slots].data_ptr()
               and r.v.data_ptr() == v[:, i, :slots].data_ptr() for i, r in enumerate(runners))
    return (k, v) if same else None


class DrafterPool:
    """Same-shape `DrafterEngine`s (`pool_shape` equal; ValueError otherwise) stepping together. Not re-entrant,
    and the engines must not step alone while a pooled step runs: one thread drives them all. `padded`: chain steps
    at bucketed fixed shapes over every drafter (None: where the runners step so, on a GPU: CUDA graph replays)."""

    def __init__(self, engines: list[DrafterEngine], padded: bool | None = None):
        shapes = {pool_shape(e) for e in engines}
        if len(engines) < 2 or None in shapes or len(shapes) != 1:
            raise ValueError("a drafter pool takes two or more drafters of one shape (pool_shape), each a "
                             "DrafterEngine on the fast runner")
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
        self.vocab, self.device, self.w0, self.max_len = r0.vocab_size, r0.device, r0.w, r0.max_len
        self.eps = engines[0].model.config.rms_norm_eps
        self.vocab_limit, self.top = engines[0].vocab_limit, engines[0].top_alternatives
        self.stream = r0.stream  # the drafters' (engines/graphs.py): their caches are touched on it only
        slots = r0.k.shape[1]
        self.scratch = slots
        with on_stream(self.stream):
            self.k, self.v = _shared_cache(runners) or _pooled_cache(runners)
            self.embed = torch.cat([r.w.embed_tokens.weight.detach() for r in runners])  # [drafters * vocab, hidden]
            self.padded = r0.graphs is not None if padded is None else padded
            self.all = _Stacked([r.w for r in runners]) if self.padded else None
        self.subsets: OrderedDict[tuple[int, ...], _Stacked] = OrderedDict()
        self.max_rows = max(r.max_slots for r in runners)
        self.graphs = CapturedGraphs(self.device, self.stream) if self.padded else None
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
    def step(self, rids: dict[str, list[str]], want_loglik: Collection[str] = (),
             alternatives: bool = False) -> dict[str, dict[str, Proposal]]:
        """`DrafterEngine.step` of every named drafter over its `rids`: the prompts among them (long pending runs)
        in one forward, the rest in another (one drafter alone, eager: its own step)."""
        out: dict[str, dict[str, Proposal]] = {n: {} for n in rids}
        long: dict[str, list[str]] = {}
        short: dict[str, list[str]] = {}
        for name, group in rids.items():
            engine = self.engines[name]
            for r in group:
                (long if len(engine.states[r].pending) > LONG_PENDING else short).setdefault(name, []).append(r)
        with on_stream(self.stream):  # the pooled forwards (a drafter stepping alone enters it itself)
            for groups in (long, short):
                if not groups:
                    continue
                if groups is short and self.padded and not any(
                        n in want_loglik and any(len(self.engines[n].states[r].pending) > 1 for r in g)
                        for n, g in groups.items()):
                    self._padded_step(groups, out, alternatives)
                elif len(groups) == 1 and sum(map(len, groups.values())) == 1 or (groups is short and len(groups) == 1):
                    (name, group), = groups.items()
                    out[name] |= self.engines[name].step(group, want_loglik=name in want_loglik,
                                                         alternatives=alternatives)
                else:
                    self._pooled(groups, want_loglik, out, alternatives)
        return out

    def draft(self, rids: dict[str, list[str]], k: dict[str, dict[str, int]],
              alternatives: bool = False) -> dict[str, dict[str, list[Proposal]]]:
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
            for n, props in self.step(active, alternatives=alternatives).items():
                for r, p in props.items():
                    chains[n][r].append(p)
                    if len(chains[n][r]) < k[n][r]:
                        self.engines[n].feed(r, [p.token])
        return chains

    def _rows(self, groups: dict[str, list[str]], names: list[str], B: int, N: int, pad_slot: int) -> torch.Tensor:
        """[drafters, B, N + 4] on the host, one row per (drafter, request slot): token ids | pool index | slot |
        cached length | new tokens; padding rows write to `pad_slot` and feed nothing."""
        rows = []
        for n in names:
            runner = self.engines[n].runner
            group = groups.get(n, [])
            for r in group:
                x, s = self.engines[n].states[r].pending, runner.requests[r]
                rows.append(x + [0] * (N - len(x)) + [self.index[n], s.slot, s.length, len(x)])
            rows += [[0] * N + [self.index[n], pad_slot, 0, 0]] * (B - len(group))
        return torch.tensor(rows).view(len(names), B, N + 4)

    def _commit(self, groups: dict[str, list[str]], names: list[str], B: int, packed: torch.Tensor,
                out: dict[str, dict[str, Proposal]], alternatives: bool, logliks: dict | None = None) -> None:
        """The forward's tokens committed to each request's cache, its proposal from `packed` [drafters, B, ...]
        (already on the host)."""
        table = packed.tolist()
        for i, n in enumerate(names):
            engine = self.engines[n]
            if not groups.get(n):
                continue
            engine.forward_passes += 1
            for b, r in enumerate(groups[n]):
                x = engine.states[r].pending
                engine.runner.requests[r].pending = len(x)
                engine.runner.commit_all(r, x)
                engine.states[r].pending = []
                out[n][r] = _proposal(table[i][b], self.top, (logliks or {}).get((i, b)), alternatives)

    def _pooled(self, groups: dict[str, list[str]], want_loglik: Collection[str],
                out: dict[str, dict[str, Proposal]], alternatives: bool) -> None:
        """One eager forward over the drafters in `groups` at their inputs' exact shapes."""
        t_start = time.perf_counter()
        names = sorted(groups, key=self.index.get)
        members = tuple(self.index[n] for n in names)
        P, B = len(names), max(len(groups[n]) for n in names)
        N = max(len(self.engines[n].states[r].pending) for n in names for r in groups[n])
        full = [n in want_loglik and any(len(self.engines[n].states[r].pending) > 1 for r in groups[n])
                for n in names]
        host = self._rows(groups, names, B, N, 0)
        w = self._weights(members)
        h = self._forward(w, host.to(self.device), N)  # [P, B, N, hidden]
        n_new = host[..., N + 3].to(self.device)
        last = h[torch.arange(P, device=h.device)[:, None], torch.arange(B, device=h.device), (n_new - 1).clamp(min=0)]
        top = self.top if alternatives else 0
        # each drafter's own LM head (prepacked on a CPU): a batched matmul over the stacked vocabularies made the
        # pooled round slower than the drafters' own steps on a 2-core CPU
        logits = torch.stack([self.engines[n].runner.w.lm_head(last[p]) for p, n in enumerate(names)])
        packed = _choose(logits, self.vocab_limit, top)  # [P, B, 2 + 2 top]
        lls = {}
        for i in (i for i, f in enumerate(full) if f):  # routing's cold start: a drafter at a time, [B, N, vocab]
            head = (w.head[0][i:i + 1], None if w.head[1] is None else w.head[1][i:i + 1])
            logits = _mm(h[i].reshape(1, B * N, -1), head).view(B, N, -1)
            logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
            ids = host[i, :, 1:N].to(self.device)
            lp = logp.gather(-1, ids[..., None])[..., 0].clamp(min=LOGLIK_FLOOR)
            n_fed = host[i, :, N + 3].to(self.device)
            keep = torch.arange(N - 1, device=self.device) < (n_fed - 1)[:, None]
            lls[i] = (lp * keep).sum(-1) / (n_fed - 1).clamp(min=1)
        if lls:
            packed = torch.cat([packed, torch.stack([lls.get(i, torch.zeros(B, device=self.device))
                                                     for i in range(P)])[..., None].double()], dim=-1)
        packed = packed.cpu()
        count(drafter_forwards=1, host_reads=1)
        self.forward_passes += 1
        logliks = {(i, b): float(packed[i, b, -1]) for i in lls for b, r in enumerate(groups[names[i]])
                   if len(self.engines[names[i]].states[r].pending) > 1}
        self._commit(groups, names, B, packed, out, alternatives, logliks)
        self.forward_seconds += time.perf_counter() - t_start

    def _padded_step(self, groups: dict[str, list[str]], out: dict[str, dict[str, Proposal]],
                     alternatives: bool) -> None:
        """One forward over every pool drafter at bucketed shapes (a CUDA graph replay on a GPU)."""
        t_start = time.perf_counter()
        names = list(self.engines)
        B = bucket(max(len(g) for g in groups.values()), self.max_rows)
        N = bucket(max(len(self.engines[n].states[r].pending) for n, g in groups.items() for r in g), GRAPH_MAX_NEW)
        host = self._rows(groups, names, B, N, self.scratch)
        packed = self.graphs.run((B, N), host, self._padded_forward).cpu()
        count(drafter_forwards=1, host_reads=1)
        self.forward_passes += 1
        self._commit(groups, names, B, packed, out, alternatives)
        self.forward_seconds += time.perf_counter() - t_start

    def capture(self) -> int:
        """Capture the padded step's CUDA graph of every (requests, tokens) bucket a round can meet (on a CPU: record
        them): steps after it never capture. Returns the graphs captured."""
        if not self.padded:
            return 0
        before = len(self.graphs.graphs)
        for b in buckets(self.max_rows):
            for n in buckets(GRAPH_MAX_NEW):
                host = torch.zeros(len(self.engines), b, n + 4, dtype=torch.long)
                host[..., n] = torch.arange(len(self.engines))[:, None]
                host[..., n + 1] = self.scratch
                self.graphs.capture((b, n), host, self._padded_forward)
        return len(self.graphs.graphs) - before

    def _padded_forward(self, host: torch.Tensor) -> torch.Tensor:
        """The padded step over host [P, B, N + 4] (every pool drafter; see `_rows`) on the device, at fixed shapes:
        attention over the whole cache under a mask, the padding's keys/values to the scratch slot. The proposals
        packed ([P, B, 2 + 2 top], `_choose`)."""
        P, B, width = host.shape
        N = width - 4
        ids, pidx, slot, lens, n_new = host[..., :N], host[..., N], host[..., N + 1], host[..., N + 2], host[..., N + 3]
        steps = torch.arange(N, device=host.device)
        pos = lens[..., None] + steps  # [P, B, N]
        valid = steps < n_new[..., None]
        write_slot = torch.where(valid, slot[..., None], self.scratch)
        write_pos = torch.where(valid, pos, 0)
        limit = torch.where(valid, pos + 1, 1).view(P * B, N)
        mask = (torch.arange(self.max_len, device=host.device) < limit[..., None])[:, None]
        clamped = pos.clamp(max=self.max_len - 1).view(P * B, N)
        cos, sin = self.w0.cos[clamped], self.w0.sin[clamped]
        r_pool, r_slot = pidx.reshape(-1), slot.reshape(-1)
        pool_idx = pidx[..., None].expand(P, B, N)

        def store(li: int, k: torch.Tensor, v: torch.Tensor) -> None:  # k, v [P * B, KV, N, D]
            k = k.view(P, B, self.n_kv, N, self.head_dim).transpose(2, 3)
            v = v.view(P, B, self.n_kv, N, self.head_dim).transpose(2, 3)
            self.k[li, pool_idx, write_slot, :, write_pos] = k
            self.v[li, pool_idx, write_slot, :, write_pos] = v

        def attended(li: int) -> tuple[torch.Tensor, torch.Tensor]:
            return self.k[li, r_pool, r_slot], self.v[li, r_pool, r_slot]

        h = self._layers(self.all, ids, pidx, mask, cos, sin, store, attended)
        h = h.view(P, B, N, -1)[torch.arange(P, device=h.device)[:, None], torch.arange(B, device=h.device),
                                (n_new - 1).clamp(min=0)]
        return _choose(_mm(h, self.all.head), self.vocab_limit, self.top)

    def _forward(self, w: _Stacked, host: torch.Tensor, N: int) -> torch.Tensor:
        """The drafters' layers over host [P, B, N + 4] (see `_rows`) at its exact shapes: hidden states
        [P, B, N, hidden] after the final norm. As `LlamaRunner._step` for chains, each drafter's rows against its
        own weights and cache slots."""
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
        clamped = pos.clamp(max=self.max_len - 1).view(P * B, N)  # padding may run past the cache's end: masked
        cos, sin = self.w0.cos[clamped], self.w0.sin[clamped]

        def store(li: int, k: torch.Tensor, v: torch.Tensor) -> None:
            self.k[li, w_pool, w_slot, :, w_pos] = k[w_row, :, tv]
            self.v[li, w_pool, w_slot, :, w_pos] = v[w_row, :, tv]

        def attended(li: int) -> tuple[torch.Tensor, torch.Tensor]:
            return self.k[li, r_pool, r_slot, :, :total], self.v[li, r_pool, r_slot, :, :total]

        return self._layers(w, ids, pidx, mask, cos, sin, store, attended).view(P, B, N, -1)

    def _layers(self, w: _Stacked, ids, pidx, mask, cos, sin, store, attended) -> torch.Tensor:
        """The decoder layers and the final norm, each drafter's rows against its own weights: hidden states
        [P, B * N, hidden]; `store(layer, k, v)` writes the new keys/values ([P * B, kv heads, N, head_dim]),
        `attended(layer)` gives the cached ones the queries attend over (under `mask`)."""
        P, B, N = ids.shape
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
            store(li, k, v)
            keys, values = attended(li)
            att = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.w0.scaling,
                                                 enable_gqa=KV != H)
            h = h + _mm(att.transpose(1, 2).reshape(P, B * N, -1), w.o[li])
            gate, up = _mm(F.rms_norm(h, h.shape[-1:], eps=self.eps) * w.norm_post[li], w.gate_up[li]).split(
                self.w0.inter, dim=-1)
            h = h + _mm(self.w0.act(gate) * up, w.down[li])
        return F.rms_norm(h, h.shape[-1:], eps=self.eps) * w.final_norm
