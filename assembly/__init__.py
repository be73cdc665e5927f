"""Assembly in one process: the configured engines and the speculation algorithms put together, without Ray.

Where the concrete engines are chosen (the layers below speak through their protocols): what a drafter replica
serves (`drafter_server.DrafterServer`, which deployments/drafter.py wraps), the drafting tier of a loop whose
drafters live in its own process (`drafting_tier.InProcessDraftingTier`: `cosine generate`, the engine benchmark,
tests, the verifier replica of a `speculation.drafting_tier: colocated` graph), and the whole loop
(`loop.build_loop`). Between the algorithms (speculation/) and the Serve graph (deployments/): both the deployments
and the benchmarks build on it, and a machine without Ray (the GPU image) can run it.
"""
