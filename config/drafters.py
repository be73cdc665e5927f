"""`drafters`: one drafter (a model, or a model-free n-gram or suffix drafter) and its deployment."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from config.base import Strict
from config.deployment import DeploymentOptions


class NgramSpec(Strict):
    """`kind: ngram` (prompt lookup, engines/ngram_drafter.py): the token that followed the context's last n tokens
    earlier in the request, for the longest n in [min_n, max_n] that occurred before."""

    min_n: int = Field(2, ge=1, le=32, description="the shortest n-gram matched")
    max_n: int = Field(5, ge=1, le=32, description="the longest n-gram matched")
    min_prob: float = Field(0.0, ge=0, lt=1, description="a token whose confidence (its frequency after the "
                            "match, engines/model_free.py) is below this ends the chain")

    @model_validator(mode="after")
    def _ordered(self):
        if self.min_n > self.max_n:
            raise ValueError(f"ngram.min_n ({self.min_n}) is above ngram.max_n ({self.max_n}): set min_n <= max_n")
        return self


class SuffixSpec(Strict):
    """`kind: suffix` (suffix decoding, engines/suffix_drafter.py): the longest match of the context's end in a
    suffix tree over the request's own context and, with `cross_request`, over its tenant's recent outputs."""

    max_depth: int = Field(24, ge=2, le=256, description="the longest substring the trees index (a match is at "
                           "most max_depth - 1 tokens)")
    min_prob: float = Field(0.1, ge=0, lt=1, description="a token whose confidence (its frequency after the "
                            "match, engines/model_free.py) is below this ends the chain")
    cross_request: bool = Field(True, description="also match the tenant's recent outputs (tenant: the API key a "
                                "request came with; requests without one use their own context only)")
    cached_outputs: int = Field(64, ge=1, description="outputs kept per tenant for cross-request matching")
    max_tenants: int = Field(256, ge=1, description="tenants whose outputs are kept (the least recently served "
                             "forgotten first)")


# settings a model-free drafter has no use for: refused when set, rather than ignored
_MODEL_ONLY = ("model", "assistant", "assistant_k", "generalist", "kv_cache_gib", "dtype", "runner", "device",
               "threads")


class DrafterSpec(Strict):
    name: str = Field(..., pattern=r"^[a-z0-9][a-z0-9_-]*$", description="domain name, e.g. code")
    kind: Literal["model", "ngram", "suffix"] = Field("model", description="model: a drafter model (`model`); "
                                                     "ngram: prompt lookup in the request's own context (`ngram`); "
                                                     "suffix: suffix decoding over the request's context and its "
                                                     "tenant's recent outputs (`suffix`). The model-free kinds need "
                                                     "no weights and no GPU; routed requests consult them every "
                                                     "round beside their routed models")
    model: str | None = Field(None, description="the drafter model (kind model)")
    ngram: NgramSpec | None = Field(None, description="kind ngram's settings (defaults when omitted)")
    suffix: SuffixSpec | None = Field(None, description="kind suffix's settings (defaults when omitted)")
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
                                "null: as for the verifier. Drafters in the verifier's process that take turns with "
                                "verification on a CPU (colocated_overlap) step on the verifier's thread, with its "
                                "threads")
    deployment: DeploymentOptions = Field(default_factory=DeploymentOptions, description="Ray Serve options")

    @model_validator(mode="after")
    def _kind(self):
        if self.kind == "model":
            if self.model is None:
                raise ValueError(f"drafter {self.name}: kind model needs `model` (or set kind: ngram or suffix)")
            wrong = [k for k in ("ngram", "suffix") if getattr(self, k) is not None]
        else:
            wrong = [k for k in _MODEL_ONLY if k in self.model_fields_set]
            wrong += [k for k in ("ngram", "suffix") if k != self.kind and getattr(self, k) is not None]
            if self.kind == "ngram" and self.ngram is None:
                self.ngram = NgramSpec()
            if self.kind == "suffix" and self.suffix is None:
                self.suffix = SuffixSpec()
        if wrong:
            raise ValueError(f"drafter {self.name} (kind {self.kind}) has no use for {wrong}: remove them")
        return self

    @property
    def model_free(self) -> bool:
        return self.kind != "model"
