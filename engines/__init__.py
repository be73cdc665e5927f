"""Model execution: the engines the drafter and verifier deployments run, plain torch, no Ray.

- `runner.LlamaRunner`: batched forward of a Llama model over many requests, each with its own KV cache,
  for ragged chains and token trees (4D attention mask + depth-based positions), with rollback.
- `drafter.DrafterEngine`: per-request drafting steps returning the proposal, its probability and alternatives.
- `verifier.TorchVerifierEngine`: continuous batching and lossless verification of chains and trees.
- `build`: the verifier engine a configuration names.
"""
