"""`drafters`: one drafter model and its deployment."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from config.base import Strict
from config.deployment import DeploymentOptions


class DrafterSpec(Strict):
    name: str = Field(..., pattern=r"^[a-z0-9][a-z0-9_-]*$", description="domain name, e.g. code")
    model: str = Field(..., description="the drafter model")
    generalist: bool = Field(False, description="trained on every domain (a fallback drafter), not one: routing's "
                             "cold start ranks it first only where no domain drafter explains the prompt")
    assistant: str | None = Field(None, description="a smaller model that drafts this drafter's own chains for it "
                                  "(SpecRouter's multi-level chain: assistant -> this drafter -> target; the chains "
                                  "are this drafter's, in fewer of its forward passes). Pays for a drafter close to "
                                  "the target but slow, e.g. the target's small original as drafter of the bench "
                                  "target, assisted by a domain drafter")
    assistant_k: int = Field(4, ge=1, le=16, description="the assistant's tokens checked per forward pass of this "
                             "drafter")
    max_requests: int = Field(64, ge=1, description="requests holding a KV cache in one replica (fewer where "
                              "kv_cache_gib does not hold that many at max_len)")
    max_len: int | None = Field(None, ge=64, description="longest context (tokens) a replica drafts for; null: the "
                                "verifier's max_len (capped at the drafter's max_position_embeddings, said at "
                                "startup)")
    kv_cache_gib: float = Field(2.0, gt=0, description="KV cache memory of a replica: its request slots are "
                                "min(max_requests, what fits at max_len), reported at startup; not even one "
                                "request fitting is a startup error")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("auto", description="weights and KV cache; "
                                                                    "auto: bfloat16 (float16 where the GPU lacks "
                                                                    "it) on a GPU, float32 on a CPU")
    runner: Literal["auto", "fast", "transformers"] = Field("auto", description="the drafter's engine. fast: this "
                                                            "project's batched runner, for the architectures proven "
                                                            "equal to transformers (llama, mistral, qwen2, qwen3); "
                                                            "transformers: any other causal LM transformers loads, "
                                                            "stepped through its own forward; auto: fast where it is "
                                                            "proven, else transformers")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="where the model runs; auto: a GPU if the "
                                                  "replica sees one (ray_actor_options.num_gpus), else the CPU")
    threads: int | None = Field(1, ge=1, description="torch CPU threads of a replica (a drafter step is too small "
                                "to gain from more, and drafters sharing cores with the verifier must not crowd it); "
                                "null: as for the verifier")
    deployment: DeploymentOptions = Field(default_factory=DeploymentOptions, description="Ray Serve options")
