"""The one configuration schema of the application, passed as Serve application `args` and validated at deploy.

Model references are a directory, the name of a shipped model (`target`, `drafter-code`, ...), or a Hugging Face
model id (resolved by transformers/vLLM on the machine that loads it).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DeploymentOptions(_Strict):
    """What Ray Serve needs to place and scale one deployment."""

    num_replicas: int | Literal["auto"] = 1
    max_ongoing_requests: int = Field(256, ge=1)
    ray_actor_options: dict[str, Any] = Field(default_factory=lambda: {"num_cpus": 0})
    autoscaling_config: dict[str, Any] | None = None

    def serve_options(self) -> dict[str, Any]:
        opts: dict[str, Any] = {"max_ongoing_requests": self.max_ongoing_requests,
                                "ray_actor_options": dict(self.ray_actor_options)}
        if self.autoscaling_config is not None:
            opts["autoscaling_config"] = dict(self.autoscaling_config)
        else:
            opts["num_replicas"] = self.num_replicas
        return opts


class DrafterSpec(_Strict):
    name: str = Field(..., pattern=r"^[a-z0-9][a-z0-9_-]*$", description="domain name, e.g. code")
    model: str
    generalist: bool = Field(False, description="trained on every domain (a fallback drafter), not one: routing's "
                             "cold start ranks it first only where no domain drafter explains the prompt")
    max_requests: int = Field(64, ge=1)
    max_len: int = Field(2048, ge=64)
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="where the model runs; auto: a GPU if the "
                                                  "replica sees one (ray_actor_options.num_gpus), else the CPU")
    deployment: DeploymentOptions = Field(default_factory=DeploymentOptions)


class VerifierSpec(_Strict):
    engine: Literal["torch", "vllm"] = "torch"
    model: str
    max_batch: int = Field(16, ge=1)
    max_len: int = Field(2048, ge=64)
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="where the torch engine runs; auto: a GPU "
                                                  "if the replica sees one (ray_actor_options.num_gpus), else the CPU")
    deployment: DeploymentOptions = Field(default_factory=DeploymentOptions)
    engine_kwargs: dict[str, Any] = Field(default_factory=dict, description="passed to the vLLM engine")


class SpeculationSpec(_Strict):
    mode: Literal["cosine", "chain", "off"] = "cosine"
    k: int = Field(4, ge=0, le=32, description="draft steps per round (the maximum when adaptive)")
    gamma_max: int = Field(64, ge=1, description="total draft tokens verified per step (CoSine's Gamma_max)")
    tree_budget: int = Field(8, ge=1, description="draft nodes per request and round")
    fusion: bool = True
    adaptive: bool = True
    adaptive_drafters: bool = Field(True, description="with adaptive speculation, the goodput controller also "
                                    "picks 1..routing.drafters_per_request drafters per request each round: fewer "
                                    "when the verifier is loaded (CoSine Alg. 2)")
    fixed_drafters: list[str] | None = Field(None, description="bypass routing: always use these drafters")
    draft_timeout_ms: float = Field(100.0, gt=0, description="decode without drafts when they are later")
    # the speculation cluster's central node keeps per-request state (routing scores, last round, which drafters
    # hold a cache), so it runs as one replica; place it next to the verifier
    deployment: DeploymentOptions = Field(default_factory=DeploymentOptions)

    @model_validator(mode="after")
    def _one_central_node(self):
        if self.deployment.num_replicas != 1 or self.deployment.autoscaling_config is not None:
            raise ValueError("speculation.deployment must have num_replicas: 1 (it holds per-request routing "
                             "state); scale the verifier and the drafters instead")
        return self


class RoutingSpec(_Strict):
    drafters_per_request: int = Field(2, ge=1, le=8)
    tau: float = Field(2.0, ge=1.0)
    alpha: float = Field(0.3, ge=0, le=1)
    beta: float = Field(0.05, ge=0, le=1)
    ema: float = Field(0.1, gt=0, le=1, description="weight of the newest round in a request's routing scores")
    cold_start_temperature: float = Field(0.5, gt=0)
    generalist_margin: float = Field(0.5, ge=0, description="nats per prompt token by which a generalist drafter "
                                     "must out-explain every domain drafter to lead a new request's ranking")
    seed: int = 0

    @model_validator(mode="after")
    def _alpha_above_beta(self):
        if self.alpha < self.beta:
            raise ValueError("routing.alpha (exploration) must be >= routing.beta (exploitation)")
        return self


class IngressSpec(_Strict):
    model_name: str = "cosine-target"
    max_queued_requests: int = Field(256, ge=1, description="beyond this, 429 with Retry-After")
    retry_after_s: int = Field(1, ge=1)
    deployment: DeploymentOptions = Field(default_factory=DeploymentOptions)


class AppConfig(_Strict):
    tokenizer: str = "tokenizer"
    ingress: IngressSpec = Field(default_factory=IngressSpec)
    verifier: VerifierSpec
    drafters: list[DrafterSpec] = Field(default_factory=list)
    speculation: SpeculationSpec = Field(default_factory=SpeculationSpec)
    routing: RoutingSpec = Field(default_factory=RoutingSpec)

    @field_validator("drafters")
    @classmethod
    def _unique_names(cls, v: list[DrafterSpec]) -> list[DrafterSpec]:
        names = [d.name for d in v]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"drafter names must be unique, repeated: {dupes}")
        return v

    @model_validator(mode="after")
    def _consistent(self):
        names = {d.name for d in self.drafters}
        if self.speculation.mode != "off" and not self.drafters:
            raise ValueError("speculation is on but no drafters are configured (set speculation.mode: off)")
        for n in self.speculation.fixed_drafters or []:
            if n not in names:
                raise ValueError(f"speculation.fixed_drafters names unknown drafter {n!r}; known: {sorted(names)}")
        if self.routing.drafters_per_request > max(1, len(self.drafters)):
            self.routing.drafters_per_request = max(1, len(self.drafters))
        return self
