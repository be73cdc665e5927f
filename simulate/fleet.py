"""The drafting side of the simulated cluster: drafter replicas on GPUs behind network hops, a drafting round's calls
replayed on them (or on the verifier's GPUs, colocated), the GPU-seconds they hold, and the drafter autoscaler that
adds and removes replicas from the signals they and the verifier report."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import simpy

from autoscale.policy import DrafterLoad, ReplicaPlanner, VerifierLoad
from config import AutoscalerSpec
from simulate.hardware import Hardware


@dataclass
class Autoscaling:
    spec: AutoscalerSpec = field(default_factory=AutoscalerSpec)
    min_replicas: int = 1
    max_replicas: int = 4
    period_s: float = 2.0  # Serve's metrics interval / policy period, as look-back
    upscale_delay_s: float = 10.0
    downscale_delay_s: float = 60.0


class _Replica:
    """A drafter replica on a GPU: the requests homed on it, and what it reports to the autoscaler."""

    def __init__(self, gpu: simpy.Resource, ready_at: float):
        self.gpu, self.ready_at = gpu, ready_at
        self.homes: set[str] = set()
        self.busy_s = 0.0
        self.queued_s = 0.0
        self.scalable_s = 0.0


class DrafterFleet:
    """Every drafter deployment's replicas and the GPUs they hold, on the simulation's clock."""

    def __init__(self, env: simpy.Environment, hw: Hardware, verifier: simpy.Resource, names: list[str],
                 replicas: int, drafter_gpus: int | None, metered: bool):
        """`replicas` per drafter at the start, placed round-robin on `drafter_gpus` GPUs (default: one GPU each);
        `verifier`: the verifier's GPUs, where colocated rounds draft; `metered`: whether the drafter GPUs count
        toward the run's cost (they hold replicas that are called)."""
        self.env, self.hw, self.verifier = env, hw, verifier
        n_gpus = drafter_gpus or replicas * len(names)
        self.gpus = [simpy.Resource(env, 1) for _ in range(n_gpus)]
        self.replicas: dict[str, list[_Replica]] = {
            n: [_Replica(self.gpus[(i * replicas + j) % n_gpus], 0.0) for j in range(replicas)]
            for i, n in enumerate(names)}
        self.gpu_seconds, self.metered_at, self.metered = 0.0, 0.0, metered
        self.log: list[tuple[float, int]] = [(0.0, self.count())]  # (time, drafter replicas running)

    def count(self) -> int:
        return sum(len(rs) for rs in self.replicas.values())

    def release(self, rid: str) -> None:
        """A finished request leaves the replicas it was homed on."""
        for reps in self.replicas.values():
            for r in reps:
                r.homes.discard(rid)

    def drafting(self, batch, scored: int, calls: list[tuple[str, str, int, int]], colocated: bool):
        """A drafting round replayed in simulated time: its calls, wave by wave (the coordinator's depths), on the
        verifier's GPUs (`colocated`) or the drafters'."""
        if self.hw.draft_round is not None:  # fitted as a whole: drafters share the verifier's hardware
            yield self.env.timeout(self.hw.draft_round(max(d.k for d in batch), len(batch), scored))
            return
        waves: dict[int, dict[str, list[tuple[str, int]]]] = defaultdict(lambda: defaultdict(list))
        for name, rid, depth, steps in calls:
            waves[depth][name].append((rid, steps))
        for depth in sorted(waves):
            calls = []
            for name, items in waves[depth].items():
                if colocated:
                    calls.append(self.env.process(self._colocated(items)))
                    continue
                by_replica: dict[int, list] = defaultdict(list)
                for rid, steps in items:
                    by_replica[self._home(name, rid)].append(steps)
                for i, steps in by_replica.items():
                    calls.append(self.env.process(self._call(self.replicas[name][i], steps)))
            yield self.env.all_of(calls)

    def _colocated(self, items):
        with self.verifier.request() as turn:
            yield turn
            yield self.env.timeout(max(s for _, s in items) * self.hw.colocated_draft(len(items)))

    def _home(self, name: str, rid: str) -> int:
        reps = self.replicas[name]
        ready = [i for i, r in enumerate(reps) if r.ready_at <= self.env.now] or [0]
        for i in ready:
            if rid in reps[i].homes:
                return i
        i = min(ready, key=lambda j: len(reps[j].homes))
        reps[i].homes.add(rid)
        return i

    def _call(self, rep: _Replica, steps: list[int]):
        yield self.env.timeout(self.hw.hop_ms / 2000)
        asked = self.env.now
        with rep.gpu.request() as turn:
            yield turn
            rep.queued_s += self.env.now - asked
            busy = max(steps) * self.hw.draft(len(steps))
            yield self.env.timeout(busy)
            rep.busy_s += busy
            rep.scalable_s += busy - max(steps) * self.hw.draft(0)  # all but the steps' fixed cost
        yield self.env.timeout(self.hw.hop_ms / 2000)

    def autoscaler(self, a: Autoscaling, verifier_load: Callable[[float], VerifierLoad]):
        """Serve's autoscaling loop: every period, the project's `ReplicaPlanner` decides each drafter's replicas
        from what its replicas and the verifier (`verifier_load`: over the last `period_s`) report, applied once it
        was wanted for the up- or downscale delay."""
        planner = ReplicaPlanner(a.spec)
        demand: dict[str, float | None] = {n: None for n in self.replicas}
        wanted_since: dict[str, tuple[int, float]] = {}
        while True:
            yield self.env.timeout(a.period_s)
            verifier = verifier_load(a.period_s)
            for name, reps in self.replicas.items():
                live = [r for r in reps if r.ready_at <= self.env.now]
                load = DrafterLoad(sum(r.busy_s for r in live) / a.period_s,
                                   sum(r.queued_s for r in live) / a.period_s,
                                   sum(r.scalable_s for r in live) / a.period_s)
                for r in live:
                    r.busy_s = r.queued_s = r.scalable_s = 0.0
                d = planner.decide(load, verifier, len(reps), a.min_replicas, a.max_replicas, demand[name])
                demand[name] = d.demand
                if d.replicas == len(reps):
                    wanted_since.pop(name, None)
                    continue
                since = wanted_since.setdefault(name, (d.replicas, self.env.now))
                if since[0] != d.replicas:
                    wanted_since[name] = (d.replicas, self.env.now)
                    continue
                delay = a.upscale_delay_s if d.replicas > len(reps) else a.downscale_delay_s
                if self.env.now - since[1] < delay:
                    continue
                wanted_since.pop(name, None)
                self.meter()
                while len(reps) < d.replicas:  # a new replica on a GPU of its own, ready once its model loads
                    gpu = simpy.Resource(self.env, 1)
                    self.gpus.append(gpu)
                    reps.append(_Replica(gpu, self.env.now + self.hw.replica_start_s))
                while len(reps) > d.replicas:  # the one with fewest requests goes; they rehome on their next call
                    gone = min(reps, key=lambda r: len(r.homes))
                    reps.remove(gone)
                    self.gpus.remove(gone.gpu)
            self.log.append((self.env.now, self.count()))

    def meter(self) -> None:
        """Drafter GPU-seconds so far: the GPUs holding drafter replicas, integrated over time (call before the
        count changes)."""
        if self.metered:
            self.gpu_seconds += (self.env.now - self.metered_at) * len(self.gpus)
        self.metered_at = self.env.now

