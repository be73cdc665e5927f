"""Speculation algorithms, plain Python classes with no Ray: what the deployments wrap and tests drive directly.

The loop and its messages:
- `loop.VerifyLoop`: the one draft/verify loop (the service, `cosine generate`, the engine bench);
  `stepping.StepGrouping`: which requests each step takes and what is drafted beside it (the loop's pipeline
  halves and drafting ahead, which the simulator runs too);
  `planner.DraftPlanner`: what each request drafts this round; `messages`: the typed messages between the
  verifier, the speculation cluster and the drafters; `trace`: run traces for `cosine simulate`.
- `tiers`: choosing between the colocated and the deployed drafting tier each round.

Drafting (speculation/strategies/: one module per strategy behind `strategies.base.DraftingStrategy`):
- `coordinator.SpeculationCoordinator`: the speculation cluster's central node: drives the rounds (depths, drafter
  calls, deadlines), `health.DrafterHealth` keeps failed drafters out for a while;
- `routing.Router`: per-request drafter scores (CoSine Eq. 1-3), cold start from the prompt's likelihood;
  `fusion`: confidence-based token fusion (Eq. 4) into a token tree, lockstep or one-shot; `voting.MajorityVote`:
  Minions' weighted majority; `chains.ChainCosts`: SpecRouter's time per accepted token of each chain.

Control (behind `controller.DraftLengthController`):
- `goodput.GoodputController`: per-step draft lengths and participation from the goodput model (SmartSpec);
  `hill_climb.HillClimbController`: one draft length hill-climbed on measured goodput (Minions);
  `planner.make_controller` builds the one the configuration names; `latency`: the goodput model's fitted step
  and round models; `profiling`: those step models fitted offline.
- `retirement`: retiring the domain drafters while rounds draft on the generalist; `signals`: what the
  deployments tell the drafter autoscaler.
"""
