"""Ray Serve deployments, one per node of the graph below the ingress, each a thin wrapper around an algorithm
class of `speculation` or an engine of `engines`:

- `verifier.VerifierDeployment`: the verify loop (`speculation.loop.VerifyLoop`) with its engine and drafting tier
  (`HandleDraftingTier`: the Speculation deployment as the loop's tier), and its Prometheus metrics; the undecorated
  `VerifierServer` it wraps is also what serve_app/ingress.py's `VerifierIngress` extends (`ingress.in_verifier`);
- `speculation.SpeculationDeployment`: the central node (`speculation.coordinator.SpeculationCoordinator`), holding
  the drafter deployments' handles; `DrafterFailures` counts failed drafter calls;
- `drafter.DrafterDeployment`: one per drafter (`assembly.drafter_server.DrafterServer`);
- `replica_affinity.HomeReplicaRouter`: the request router that sends a drafter call to the replica holding its
  requests' caches.
"""
