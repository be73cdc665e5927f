"""Model execution: the engines the drafter and verifier deployments run, plain torch, no Ray.

- `interface`: the written contracts: the `DrafterRunner` and `DraftingEngine` protocols and the types both
  verifier engines and every drafter engine share (`Proposal`, `StepOutput`, `CacheFull`, ...).
- `runner.LlamaRunner`: the fast runner: batched forward passes of Llama-architecture models (llama, mistral,
  qwen2, qwen3) over many requests, each with its own KV cache, for ragged chains and token trees, with rollback;
  `weights` lays its layers out, `graphs` replays its steps from CUDA graphs, `cpu_kernels` prepacks its matmuls.
- `transformers_runner.TransformersRunner`: any other causal LM through its own transformers forward.
- `drafter_runners`: which runner a drafter gets (by model_type, with an override) and how many requests its KV
  budget holds; refuses what neither runner can run.
- `drafter.DrafterEngine`: per-request drafting steps returning the proposal, its probability and alternatives;
  `cascade.CascadeDrafterEngine`: a drafter whose chains a smaller assistant drafts (SpecRouter's chains).
- `model_free`: what the model-free drafters share (per-request indexes, their confidence, chains);
  `ngram_drafter.NgramDrafterEngine` (prompt lookup) and `suffix_drafter.SuffixDrafterEngine` (suffix decoding,
  with its tenant-scoped tree of recent outputs): drafters without a model behind the same `DraftingEngine`.
- `drafter_pool.DrafterPool`: drafters of one shape stepping together, one batched forward per depth.
- `draft_tree.Draft`: a chain or token tree sent to a verifier; `rules`: greedy and rejection-sampling verification;
  `sampling`, `stopping`: request parameters and stop conditions.
- `verifier.TorchVerifierEngine`: continuous batching and lossless verification of chains and trees;
  `collaborative.CollaborativeEngine`: CoS collaborative decoding; `vllm_engine.VllmVerifierEngine`: our drafts
  verified inside vLLM, through `vllm_hooks` (every vLLM internal we touch, pinned).
- `build`: the verifier engine a configuration names, and the startup checks of its models.
"""
