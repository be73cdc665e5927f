"""Drafter autoscaling (SmartSpec's goodput model applied to replicas).

- `decisions`: a drafter deployment's replica count from its signals (`ReplicaPlanner`), pure, without Ray: the
  simulator and the tests run it as the policy does.
- `policy`: `DrafterAutoscaler`, the application-level Ray Serve autoscaling policy that reads the replicas' and the
  verifier's signals from Serve's context and applies the decisions.

The step-latency profiles that seed the goodput model: speculation/profiling.py.
"""
