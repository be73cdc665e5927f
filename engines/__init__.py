"""Engines shared by the drafter and verifier deployments, plain torch, driven by tests without Ray.

- `runner.LlamaRunner`: batched forward of a Llama model over many requests, each with its own KV cache,
  for ragged chains and token trees (4D attention mask + depth-based positions), with rollback.
- `drafter.DrafterEngine`: per-request drafting steps returning the proposal, its probability and alternatives.
- `verifier.TorchVerifierEngine`: continuous batching and lossless verification of chains and trees.
- `speculative.SpeculativeGenerator`: one verifier wired to one or more drafters in a single process.
"""
