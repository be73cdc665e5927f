"""`ingress`: the OpenAI-compatible HTTP front."""

from __future__ import annotations

from pydantic import Field

from config.base import Strict
from config.deployment import DeploymentOptions


class IngressSpec(Strict):
    model_name: str = Field("cosine-target", description="the model name clients send (OpenAI `model`)")
    max_queued_requests: int = Field(256, ge=1, description="beyond this, 429 with Retry-After")
    max_body_bytes: int = Field(1 << 20, ge=1024, description="larger request bodies get 413 before they are read "
                                "whole")
    api_key: str | None = Field(None, min_length=1, description="clients must send `Authorization: Bearer <key>` "
                                "(401 otherwise) on every path but /health and /metrics. Prefer the environment "
                                "variable COSINE_API_KEY of the ingress replicas (`cosine serve --api-key`): the "
                                "dashboard shows application args. Neither set: no authentication")
    retry_after_s: int = Field(1, ge=1, description="Retry-After of a 429")
    tool_call_parser: str | None = Field(None, min_length=1, description="vLLM's tool-call parser of the target's "
                                         "family (its --tool-call-parser: hermes, llama3_json, mistral, ...), for "
                                         "tool_choice auto; null: auto is refused (named and required need none). "
                                         "Checked at startup against vLLM and the tokenizer")
    reasoning_parser: str | None = Field(None, min_length=1, description="vLLM's reasoning parser (its "
                                         "--reasoning-parser: qwen3, deepseek_r1, ...): the reply's reasoning comes "
                                         "back as reasoning_content. Checked at startup against vLLM and the "
                                         "tokenizer")
    in_verifier: bool = Field(False, description="the OpenAI server runs in each verifier replica instead of "
                              "replicas of its own: Serve's proxy routes HTTP to the verifier's replicas, and a "
                              "streamed token crosses one replica boundary less (`deployment` is then unused)")
    deployment: DeploymentOptions = Field(default_factory=DeploymentOptions, description="Ray Serve options")
