"""CUDA graphs of the runner's chain steps: one launch per step instead of one per kernel.

The models this project trains are small; on a GPU every forward pass of them is bound by kernel launches and the
Python that issues them (on an H200 a 2-layer drafter's step cost 2.3 ms, the 4-layer bench target's 2.5-4.5 ms,
whatever the token count), so a drafter step cost most of a target step and speculation could not pay. Replaying a
captured graph removes that cost, as vLLM does for its own steps. A graph has fixed shapes and addresses, so steps
run as `LlamaRunner.padded_step`: batch and new-token counts rounded up to buckets, padding rows and tokens
masked and their keys/values sent to a scratch slot, attention over the whole cache length. One graph per
(batch bucket, token bucket, last position only, contiguous slots), captured on first use; a runner's graphs
share one memory pool (each replay's logits are copied to the host before the next replay). Trees and long
prefills run eagerly.
On a CPU there are no graphs; the padded step runs directly, which is how the tests check its arithmetic.

A capture fails if another thread issues work to the legacy default stream meanwhile (it synchronises with every
stream), and drafters step on threads of their own: so on a GPU every runner's device work (steps, captures, the
cache moves of commits and releases) runs under one process-wide lock, `DEVICE_LOCK`.
"""

from __future__ import annotations

import threading

import torch

from engines.device_work import count

DEVICE_LOCK = threading.RLock()
GRAPH_MAX_NEW = 16  # new tokens per request a graphed step takes (draft chains and verify steps, not prefills)


def bucket(n: int, cap: int) -> int:
    """The next power of two from n, at most cap (and at least n)."""
    b = 1
    while b < n:
        b *= 2
    return max(n, min(b, cap))


def buckets(cap: int) -> list[int]:
    """Every bucket `bucket` rounds up to, below `cap`: 1, 2, 4, ... and cap."""
    out = [1]
    while out[-1] < cap:
        out.append(bucket(out[-1] + 1, cap))
    return out


class CapturedGraphs:
    """CUDA graphs of a step function of one int64 host tensor, one per shape key: `run` copies the host tensor into
    the key's static input and replays (capturing on first use, counted); on a CPU it calls the function directly.
    The graphs share one memory pool, so each replay's output must be read before the next replay."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.cuda else None

    def run(self, key: tuple, host: torch.Tensor, fn) -> torch.Tensor:
        if not self.cuda:
            return fn(host.to(self.device))
        if key not in self.graphs:
            self.capture(key, host, fn)
        graph, inputs, out = self.graphs[key]
        inputs.copy_(host, non_blocking=True)
        graph.replay()
        return out

    def capture(self, key: tuple, host: torch.Tensor, fn) -> None:
        """Capture `fn` at `host`'s shape (its values: a step that only writes where padding goes)."""
        if not self.cuda or key in self.graphs:
            return
        buf = host.to(self.device)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn(buf)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread-local: drafters capture on their own threads while others step
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = fn(buf)
        self.graphs[key] = (graph, buf, out)
        count(graph_captures=1)


class StepGraphs:
    """A runner's chain steps at bucketed shapes (`LlamaRunner.padded_step`), one graph per (batch bucket, token
    bucket, last position only, contiguous slots)."""

    def __init__(self, runner):
        self.runner = runner
        self.graphs = CapturedGraphs(runner.device)
        self.cuda = self.graphs.cuda

    def step(self, slot_idx: list[int], lens: list[int], inputs: list[list[int]],
             hidden_only_last: bool) -> torch.Tensor:
        """Logits [B', N' or 1, vocab] on the runner's device for the padded batch; rows beyond len(inputs) and
        positions beyond each input's length are padding."""
        r = self.runner
        B, N = len(inputs), max(map(len, inputs))
        Bb, Nb = bucket(B, r.max_slots), bucket(N, GRAPH_MAX_NEW)
        contiguous = slot_idx == list(range(B))
        rows = [x + [0] * (Nb - len(x)) + [s, n, len(x)] for x, s, n in zip(inputs, slot_idx, lens)]
        rows += [[0] * Nb + [r.scratch, 0, 0]] * (Bb - B)
        host = torch.tensor(rows)  # [Bb, Nb + 3]: token ids | slot | cached length | new tokens
        return self.graphs.run((Bb, Nb, hidden_only_last, contiguous), host,
                               self._fn(Nb, hidden_only_last, contiguous))

    def capture(self, hidden_only_last: bool) -> int:
        """Capture every (batch, tokens, contiguous) bucket a step can meet (none on a CPU): later steps never
        capture. Returns the graphs captured."""
        if not self.cuda:
            return 0
        r, before = self.runner, len(self.graphs.graphs)
        for b in buckets(r.max_slots):
            for n in buckets(GRAPH_MAX_NEW):
                host = torch.zeros(b, n + 3, dtype=torch.long)
                host[:, n] = r.scratch  # every row padding, writing to the scratch slot only
                for contiguous in (True, False):
                    self.graphs.capture((b, n, hidden_only_last, contiguous), host,
                                        self._fn(n, hidden_only_last, contiguous))
        return len(self.graphs.graphs) - before

    def _fn(self, n: int, hidden_only_last: bool, contiguous: bool):
        r = self.runner
        return lambda t: r.padded_step(t[:, :n], t[:, n], t[:, n + 1], t[:, n + 2], hidden_only_last, contiguous)
