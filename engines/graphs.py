"""CUDA graphs of the runner's chain steps: one launch per step instead of one per kernel; the streams and the lock
of the runners' device work.

The models this project trains are small; on a GPU every forward pass of them is bound by kernel launches and the
Python that issues them (on an H200 a 2-layer drafter's step cost 2.3 ms, the 4-layer bench target's 2.5-4.5 ms,
whatever the token count), so a drafter step cost most of a target step and speculation could not pay. Replaying a
captured graph removes that cost, as vLLM does for its own steps. A graph has fixed shapes and addresses, so steps
run as `LlamaRunner.padded_step`: batch and new-token counts rounded up to buckets, padding rows and tokens
masked and their keys/values sent to a scratch slot, attention over the whole cache length. One graph per
(batch bucket, token bucket, last position only, contiguous slots), all captured at startup (`StepGraphs.capture`;
a shape met later is captured on first use, counted as a capture after warm-up); a runner's graphs share one memory
pool (each replay's logits are copied to the host before the next replay) and address its cache as it was when
they were captured: a runner whose cache is re-pointed (`LlamaRunner.use_cache`) drops them.
On a CPU there are no graphs; the padded step runs directly, which is how the tests check its arithmetic, and the
shapes a GPU would capture are recorded and counted all the same.

Device work without a global lock. On a GPU every runner's device work (steps, the cache moves of commits and
releases, captures, the host reads of results) is issued to its role's stream (`role_stream`): one for the
verifier, one shared by every drafter's runner and the drafter pool (which steps over the drafters' caches). That is
correct by construction: PyTorch's streams are non-blocking, so the verifier's kernels and the drafters' neither
wait for each other nor for the legacy default stream; a cache is only ever touched on its role's stream, so work
from several threads of one role (drafters on threads of their own, the pool's thread) is ordered there; a runner
allocates its cache on that stream, after the work its creating thread queued before (the weights' upload), so the
allocator reuses a freed cache block only on the stream that used it; a host read waits for its own stream only.
What still must not overlap is a capture with another capture: `torch.cuda.graph` captures on one stream shared by
the process and, entering, synchronises the device and empties the allocator's cache. So `CAPTURE_LOCK` is held
around each capture (startup's, or a late shape's), and steps never take it; the captures themselves are
thread-local (`capture_error_mode`), so other threads' steps on their streams go on meanwhile.
"""

from __future__ import annotations

import contextlib
import threading

import torch

from engines.device_work import count

CAPTURE_LOCK = threading.Lock()
GRAPH_MAX_NEW = 16  # new tokens per request a graphed step takes (draft chains and verify steps, not prefills)
VERIFIER, DRAFTERS = "verifier", "drafters"  # the roles of device work, a stream each

_streams: dict[tuple[int, str], torch.cuda.Stream] = {}
_streams_lock = threading.Lock()


def role_stream(device: torch.device, role: str) -> torch.cuda.Stream | None:
    """The stream every device work of `role` (VERIFIER or DRAFTERS) on `device` is issued to, one per role and GPU
    (made on first use); None on a CPU, where work runs as it is called."""
    if role not in (VERIFIER, DRAFTERS):
        raise ValueError(f"role {role!r}: {VERIFIER} or {DRAFTERS}")
    if device.type != "cuda":
        return None
    index = torch.cuda.current_device() if device.index is None else device.index
    with _streams_lock:
        if (index, role) not in _streams:
            _streams[(index, role)] = torch.cuda.Stream(index)
        return _streams[(index, role)]


def on_stream(stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager:
    """Device work issued to `stream` (None: nothing to switch, a CPU)."""
    return contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)


def join_stream(stream: torch.cuda.Stream | None) -> None:
    """`stream` ordered after the work this thread queued so far (a model's upload, a cache it built elsewhere)."""
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream(stream.device))


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
    the key's static input and replays (capturing on first use, counted); on a CPU it calls the function directly,
    a new key recorded and counted as a GPU would capture it. The graphs share one memory pool, so each replay's
    output must be read before the next replay. Captures run on `stream` (their owner's role's, `role_stream`)."""

    def __init__(self, device: torch.device, stream: torch.cuda.Stream | None = None):
        self.cuda = device.type == "cuda"
        self.device, self.stream = device, stream
        # key -> (graph, static input, static output); None on a CPU (the shape only)
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor] | None] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.cuda else None

    def run(self, key: tuple, host: torch.Tensor, fn) -> torch.Tensor:
        self.capture(key, host, fn)
        if not self.cuda:
            return fn(host.to(self.device))
        graph, inputs, out = self.graphs[key]
        inputs.copy_(host, non_blocking=True)
        graph.replay()
        return out

    def capture(self, key: tuple, host: torch.Tensor, fn) -> None:
        """Capture `fn` at `host`'s shape (its values: a step that only writes where padding goes), under
        `CAPTURE_LOCK`; on a CPU record the key."""
        if key in self.graphs:
            return
        if self.cuda:
            with CAPTURE_LOCK, on_stream(self.stream):
                self.graphs[key] = self._capture(host, fn)
        else:
            self.graphs[key] = None
        count(graph_captures=1)

    def _capture(self, host: torch.Tensor, fn) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]:
        buf = host.to(self.device)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn(buf)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread-local: other threads step on their streams while this one captures
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = fn(buf)
        return graph, buf, out


def cache_addresses(runner) -> tuple[int, int]:
    """Where a runner's keys and values live: what its CUDA graphs were captured to address."""
    return runner.k.data_ptr(), runner.v.data_ptr()


class StepGraphs:
    """A runner's chain steps at bucketed shapes (`LlamaRunner.padded_step`), one graph per (batch bucket, token
    bucket, last position only, contiguous slots), bound to the runner's cache as it was when they were made."""

    def __init__(self, runner):
        self.runner = runner
        self.graphs = CapturedGraphs(runner.device, runner.stream)
        self.cuda = self.graphs.cuda
        self.cache = cache_addresses(runner)

    def step(self, slot_idx: list[int], lens: list[int], inputs: list[list[int]],
             hidden_only_last: bool) -> torch.Tensor:
        """Logits [B', N' or 1, vocab] on the runner's device for the padded batch; rows beyond len(inputs) and
        positions beyond each input's length are padding."""
        r = self.runner
        if cache_addresses(r) != self.cache:  # a replay would write where the old cache was (freed memory)
            raise RuntimeError("the runner's cache moved after its CUDA graphs were made: re-point it with "
                               "LlamaRunner.use_cache, which drops them")
        B, N = len(inputs), max(map(len, inputs))
        Bb, Nb = bucket(B, r.max_slots), bucket(N, GRAPH_MAX_NEW)
        contiguous = slot_idx == list(range(B))
        rows = [x + [0] * (Nb - len(x)) + [s, n, len(x)] for x, s, n in zip(inputs, slot_idx, lens)]
        rows += [[0] * Nb + [r.scratch, 0, 0]] * (Bb - B)
        host = torch.tensor(rows)  # [Bb, Nb + 3]: token ids | slot | cached length | new tokens
        return self.graphs.run((Bb, Nb, hidden_only_last, contiguous), host,
                               self._fn(Nb, hidden_only_last, contiguous))

    def capture(self, hidden_only_last: bool) -> int:
        """Capture every (batch, tokens, contiguous) bucket a step can meet (on a CPU: record them), so that later
        steps never capture. Returns the graphs captured."""
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
