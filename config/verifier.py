"""`verifier`: the target model's engine and deployment, and CoS collaborative decoding with a partner model."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from config.base import Strict
from config.deployment import DeploymentOptions


class CollaborationSpec(Strict):
    """CoS collaborative decoding (engines/collaborative.py): every output token follows a combination of the
    target's next-token distribution and a partner model's, computed with speculation (the partner drafts inside the
    verifier's replica, the target verifies against the combination). For operators who serve the combination
    itself, e.g. a general model steered by a domain model (ensemble), or a large model's output sharpened against a
    small one's (contrastive). It changes what the deployment outputs, so it is a deployment's choice, not a
    request's."""

    partner: str = Field(..., description="the partner model (the same vocabulary as the target); it runs beside "
                         "the target, in the verifier's replica")
    combine: Literal["ensemble", "contrastive"] = Field("ensemble", description="ensemble: weight * partner + "
                                                        "(1 - weight) * target, each processed by temperature/top-k/"
                                                        "top-p first; contrastive: softmax((target logits - mu * "
                                                        "partner logits) / temperature), the partner the amateur")
    weight: float = Field(0.5, ge=0, le=1, description="ensemble: the partner's weight")
    mu: float = Field(0.1, ge=0, description="contrastive: the partner's logits' coefficient")
    k: int = Field(4, ge=0, le=16, description="tokens the partner drafts per cycle; 0: token-by-token "
                   "collaborative decoding (a pass of each model per token, no speculation)")
    alternate: bool = Field(True, description="CoS's alternate proposal framework: after a full accept the target "
                            "proposes the next token and the partner checks it in its next pass (up to k + 1 tokens "
                            "per cycle); false: naive CoS")


class VerifierSpec(Strict):
    engine: Literal["torch", "vllm"] = Field("torch", description="the target's engine. vllm: the drafts are "
                                            "verified inside a vLLM engine (its paged KV cache, continuous batching, "
                                            "tensor parallelism, rejection sampler; chains only: a fused tree is "
                                            "sent as its most confident chain); torch: this project's engine "
                                            "(verifies whole token trees)")
    model: str = Field(..., description="the target model")
    max_batch: int = Field(16, ge=1, description="requests verified together (continuous batching); more wait")
    max_len: int = Field(2048, ge=64, description="context length (prompt + generated tokens)")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="where the torch engine runs; auto: a GPU "
                                                  "if the replica sees one (ray_actor_options.num_gpus), else the CPU")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("auto", description="the target's weights; "
                                                                    "auto: torch engine as drafters' dtype, vllm: "
                                                                    "vLLM's own choice (its `dtype: auto`)")
    threads: int | None = Field(None, ge=1, description="torch CPU threads of a replica; null: the replica's "
                                "num_cpus if it reserves any, else every core of its machine (Ray would give a "
                                "replica without num_cpus one thread)")
    tensor_parallel_size: int = Field(1, ge=1, description="vllm: GPUs the target is split over (give the "
                                      "replica as many in deployment.ray_actor_options.num_gpus)")
    kv_cache_gib: int | None = Field(None, ge=1, description="vllm on CPU: GiB of KV cache "
                                       "(VLLM_CPU_KVCACHE_SPACE); null: vLLM's default. On GPUs vLLM sizes it from "
                                       "gpu_memory_utilization (engine_kwargs)")
    seed: int = Field(0, description="vllm: the engine's seed (requests with their own seed use it instead)")
    deployment: DeploymentOptions = Field(default_factory=DeploymentOptions, description="Ray Serve options")
    engine_kwargs: dict[str, Any] = Field(default_factory=dict, description="vllm: more vLLM engine arguments "
                                          "(e.g. gpu_memory_utilization, enable_prefix_caching)")
    collaboration: CollaborationSpec | None = Field(None, description="torch engine: serve CoS collaborative "
                                                    "decoding of the target and a partner model instead of the "
                                                    "target alone (needs speculation.mode: off: the partner drafts)")
