"""Drafter calls go to the replica that holds their requests' KV caches.

A drafter replica keeps a KV cache per request, so a request's calls should keep going to one replica (its home).
The Speculation deployment groups each round's calls by home and names it in the call (`step(calls, home=...)`);
this request router, set on every drafter deployment, sends such a call to that replica. A call without a home
(new requests), or whose home has gone (scaled down, failed), goes to the replica given the fewest requests lately;
the reply names the replica that served it, which becomes the requests' home. A moved request is rebuilt there
from the full context every call carries: never wrong, one re-prefill slower.

FIFOMixin: fulfilled by Serve's base path, concurrent calls hung (Ray 2.60: the routing task that fulfils its own
call cancels itself, and the calls still pending wait for a new one). In FIFO order a replica chosen for one call
may serve an older pending call instead; drafter calls rarely wait, and such a call is only rebuilt elsewhere.
"""

from __future__ import annotations

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

LOAD_DECAY = 0.98  # per routed call: how fast old assignments stop counting when balancing new requests


class HomeReplicaRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, **kwargs) -> None:
        self.load: dict[str, float] = {}  # replica -> decayed number of requests sent to it

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        home = None
        if pending_request is not None:
            home = pending_request.kwargs.get("home")
            # no other choice follows ours: retries must back off (without it Serve retries in a busy loop)
            pending_request.routing_context.should_backoff = True
        for r in candidate_replicas:
            if r.replica_id.unique_id == home:
                return [[r]]
        # one rank per replica, least loaded first: Serve takes the first that has room
        ranked = sorted(candidate_replicas, key=lambda r: self.load.get(r.replica_id.unique_id, 0.0))
        return [[r] for r in ranked]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        calls = pending_request.args[0] if pending_request.args else []
        for k in self.load:
            self.load[k] *= LOAD_DECAY
        uid = replica_id.unique_id
        self.load[uid] = self.load.get(uid, 0.0) + max(1, len(calls) if isinstance(calls, list) else 1)
