"""Speculation algorithms, plain Python classes with no Ray: what the deployments wrap and tests drive directly.

- `messages`: the typed messages between the verifier, the speculation cluster and the drafters.
- `routing.Router`: per-request drafter scores (CoSine Eq. 1-3), cold start from the prompt's likelihood.
- `fusion`: confidence-based token fusion (Eq. 4) into a token tree, lockstep or one-shot.
- `coordinator.SpeculationCoordinator`: the speculation cluster's central node: route, drive drafters, fuse.
- `goodput.SpeculationController`: per-step draft lengths and participation from the goodput model (SmartSpec).
- `hill_climb.HillClimbController`: the model-free alternative, one draft length hill-climbed on measured goodput
  (Minions); `planner.make_controller` builds the one the configuration names.
"""
