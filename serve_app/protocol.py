"""OpenAI-compatible request schemas, error bodies and response builders."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    # strict: `true` is not an integer, `"1"` not a number; unknown fields are an error, not silently ignored
    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class StreamOptions(_Strict):
    include_usage: bool = False


class SpeculationOverride(_Strict):
    """Per-request control of speculation (an extension field `speculation` of both endpoints)."""

    enabled: bool = True
    max_draft_tokens: int | None = Field(None, ge=0, le=32)
    drafters: list[str] | None = None  # fixed drafters: bypass routing
    routing: Literal["router", "random"] = "router"
    lockstep: bool | None = Field(None, description="with several drafters: true fuses them in lockstep, false "
                                  "one-shot (each drafts its own chain in one call); default: the controller's choice")
    drafters_per_request: int | None = Field(None, ge=1, le=8, description="routed drafters every round "
                                             "(overrides the controller's adaptive participation)")
    mode: Literal["cosine", "vote"] | None = Field(None, description="vote: Minions' majority vote of the voters "
                                                   "(speculation.vote.drafters, or `drafters`); cosine: routing and "
                                                   "fusion; default: the server's speculation.mode. Both are "
                                                   "lossless, so a request may pick either")


# OpenAI fields this server accepts only at the value that changes nothing (anything else is a 400, never ignored)
NO_OP_VALUES = {"frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0), "logprobs": (False,),
                "logit_bias": ({},), "tools": ([],), "response_format": ({"type": "text"},), "echo": (False,),
                "best_of": (1,), "parallel_tool_calls": (True, False), "store": (False,),
                "repetition_penalty": (1, 1.0), "min_p": (0, 0.0)}  # the last two: vLLM's extensions


class _Common(_Strict):
    model: str
    max_tokens: int | None = Field(None, ge=1, description="deprecated by OpenAI for max_completion_tokens")
    max_completion_tokens: int | None = Field(None, ge=1, description="tokens to generate at most (wins over "
                                              "max_tokens); default: up to the context length")
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1, description="0 or -1 (vLLM's spelling): off")
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = Field(None, description="up to 4 non-empty strings")
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    n: int = Field(1, ge=1, le=1, description="only 1 is supported")
    speculation: SpeculationOverride | None = None
    ignore_eos: bool = False  # as in vLLM: keep generating past EOS (benchmarks with fixed lengths)
    frequency_penalty: float | None = Field(None, description="only 0 (no penalty) is supported")
    presence_penalty: float | None = Field(None, description="only 0 (no penalty) is supported")
    logprobs: bool | int | None = Field(None, description="not supported: only false")
    logit_bias: dict[str, float] | None = Field(None, description="not supported: only {}")
    response_format: dict[str, Any] | None = Field(None, description="only {\"type\": \"text\"}")
    tools: list[dict[str, Any]] | None = Field(None, description="not supported: only []")
    parallel_tool_calls: bool | None = None
    store: bool | None = Field(None, description="not supported: only false")
    repetition_penalty: float | None = Field(None, description="vLLM's extension; only 1 (no penalty)")
    min_p: float | None = Field(None, description="vLLM's extension; only 0 (off)")

    @model_validator(mode="after")
    def _no_ops_only(self):
        for name, allowed in NO_OP_VALUES.items():
            value = getattr(self, name, None)
            # equal and both bools or both not (False == 0 and True == 1 in Python)
            if value is not None and not any(value == a and isinstance(value, bool) == isinstance(a, bool)
                                             for a in allowed):
                raise APIError(400, f"{name}={json.dumps(value)} is not supported by this server", param=name)
        return self

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if len(stops) > 4 or any(not s for s in stops):
            raise APIError(400, "stop must be up to 4 non-empty strings", param="stop")
        return stops

    def completion_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(..., min_length=1)


class CompletionRequest(_Common):
    prompt: str | list[int]
    echo: bool | None = Field(None, description="not supported: only false")
    best_of: int | None = Field(None, description="not supported: only 1")


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error this server returns, with its HTTP status (OpenAI's shape)."""

    error: ErrorDetail


ERRORS = {400: "invalid request (the message names the field)", 401: "missing or wrong API key",
          404: "unknown model or path", 413: "request body too large", 429: "server at capacity (Retry-After)",
          500: "generation failed", 503: "the verifier is not answering"}


def openapi_body(model_cls) -> dict:
    """`openapi_extra` of a route that parses its body itself (size limit, strict errors): the body's schema."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model_cls.__name__}"}}}}}


def openapi_responses(*statuses: int, stream: bool = False) -> dict:
    ok: dict = {"description": "the completion"}
    if stream:
        ok["content"] = {"application/json": {}, "text/event-stream": {"schema": {"type": "string"}}}
    return {200: ok, **{s: {"model": ErrorResponse, "description": ERRORS[s]} for s in statuses}}


def parse(model_cls, body: Any):
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    try:
        return model_cls.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        if err["type"] == "extra_forbidden":
            raise APIError(400, f"unsupported field {loc!r}", param=loc) from None
        raise APIError(400, f"{loc}: {err['msg']}", param=loc) from None


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


def spec_decode_metrics(totals: dict, model: str) -> str:
    """The verifier's counters in Prometheus text under vLLM's names, so that clients made for vLLM
    (`vllm bench serve` reads `{base_url}/metrics`) report acceptance for this server."""
    label = f'model_name="{model}"'
    lines = []
    for name, doc in (("num_drafts", "drafts verified"), ("num_draft_tokens", "draft tokens verified"),
                      ("num_accepted_tokens", "draft tokens accepted"),
                      ("num_accepted_tokens_per_pos", "draft tokens accepted, by position in the draft")):
        metric = f"vllm:spec_decode_{name}_total"
        lines += [f"# HELP {metric} {doc}", f"# TYPE {metric} counter"]
        if name == "num_accepted_tokens_per_pos":
            lines += [f'{metric}{{{label},position="{i}"}} {n}' for i, n in enumerate(totals.get(name, []))]
        else:
            lines.append(f"{metric}{{{label}}} {totals.get(name, 0)}")
    return "\n".join(lines) + "\n"

