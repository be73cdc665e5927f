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

DEVICE_LOCK = threading.RLock()
GRAPH_MAX_NEW = 16  # new tokens per request a graphed step takes (draft chains and verify steps, not prefills)


def bucket(n: int, cap: int) -> int:
    """The next power of two from n, at most cap (and at least n)."""
    b = 1
    while b < n:
        b *= 2
    return max(n, min(b, cap))


class StepGraphs:
    def __init__(self, runner):
        self.runner = runner
        self.cuda = runner.device.type == "cuda"
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.cuda else None

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
        key = (Bb, Nb, hidden_only_last, contiguous)
        if not self.cuda:
            return r.padded_step(*self._args(host, Nb), hidden_only_last, contiguous)
        if key not in self.graphs:
            self._capture(key)
        graph, inputs_buf, out = self.graphs[key]
        inputs_buf.copy_(host, non_blocking=True)
        graph.replay()
        return out

    @staticmethod
    def _args(t: torch.Tensor, n: int):
        return t[:, :n], t[:, n], t[:, n + 1], t[:, n + 2]

    def _capture(self, key: tuple) -> None:
        Bb, Nb, hidden_only_last, contiguous = key
        r = self.runner
        buf = torch.zeros(Bb, Nb + 3, dtype=torch.long, device=r.device)
        buf[:, Nb] = r.scratch  # the warm-up runs: every row padding, writing to the scratch slot only
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                r.padded_step(*self._args(buf, Nb), hidden_only_last, contiguous)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread-local: drafters capture on their own threads while others step
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = r.padded_step(*self._args(buf, Nb), hidden_only_last, contiguous)
        self.graphs[key] = (graph, buf, out)
