"""Ray Serve deployments, one per node of the graph below the ingress, each a thin wrapper around an algorithm
class of `speculation` or an engine of `engines`: Verifier, Speculation (the central node), Drafter-<domain>."""
