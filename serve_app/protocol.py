"""OpenAI-compatible request schemas, error bodies and response builders."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.get("text", "") for p in self.content if p.get("type") == "text")


class StreamOptions(BaseModel):
    include_usage: bool = False


class SpeculationOverride(BaseModel):
    """Per-request control of speculation (an extension field `speculation` of both endpoints)."""

    model_config = ConfigDict(extra="forbid")
    enabled: bool = True
    max_draft_tokens: int | None = Field(None, ge=0, le=32)
    drafters: list[str] | None = None  # fixed drafters: bypass routing
    routing: Literal["router", "random"] = "router"
    lockstep: bool | None = Field(None, description="with several drafters: true fuses them in lockstep, false "
                                  "one-shot (each drafts its own chain in one call); default: the controller's choice")
    drafters_per_request: int | None = Field(None, ge=1, le=8, description="routed drafters every round "
                                             "(overrides the controller's adaptive participation)")


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown OpenAI fields are ignored, as OpenAI-compatible servers do
    model: str
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    n: int = 1
    speculation: SpeculationOverride | None = None
    ignore_eos: bool = False  # as in vLLM: keep generating past EOS (benchmarks with fixed lengths)

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if len(stops) > 4 or any(not s for s in stops):
            raise APIError(400, "stop must be up to 4 non-empty strings", param="stop")
        return stops


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]


class CompletionRequest(_Common):
    prompt: str | list[int]


def parse(model_cls, body: Any):
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    try:
        req = model_cls.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        raise APIError(400, f"{loc}: {err['msg']}", param=loc) from None
    if req.n != 1:
        raise APIError(400, "only n=1 is supported", param="n")
    return req


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int, spec: dict | None) -> dict:
    u = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
         "total_tokens": prompt_tokens + completion_tokens}
    if spec is not None:
        u.update(spec)
    return u


def chat_chunk(rid: str, model: str, created: int, delta: dict, finish_reason: str | None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}


def completion_chunk(rid: str, model: str, created: int, text: str, finish_reason: str | None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]}


def now() -> int:
    return int(time.time())


def spec_usage(stats: dict | None) -> dict:
    """The request's speculation statistics under vLLM's names (from the verifier's last chunk)."""
    s = stats or {}
    return {"mean_acceptance_length": round(s.get("mean_acceptance_length", 1.0), 4),
            "draft_acceptance_rate": round(s.get("draft_acceptance_rate", 0.0), 4),
            "num_draft_tokens": s.get("num_draft_tokens", 0),
            "num_accepted_tokens": s.get("num_accepted_tokens", 0),
            "num_drafts": s.get("num_drafts", 0),
            "verify_steps": s.get("verify_steps", 0),
            "drafters_used": s.get("drafters_used", [])}


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"
