"""OpenAI-compatible request schemas, error bodies and the OpenAPI description of both (the response pieces:
serve_app/responses.py)."""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from config import RequestMode


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _same(value, allowed) -> bool:
    """Equal, and both bools or both not (False == 0 and True == 1 in Python)."""
    return value == allowed and isinstance(value, bool) == isinstance(allowed, bool)


class _Fields(BaseModel):
    """A request object. Types are strict (`true` is not an integer, `"1"` not a number). A field this server does not
    know is ignored with a warning, as vLLM does (`ignored_fields`); a known one it does not implement
    (`UNSUPPORTED`: name -> (the values that change nothing, why not)) is a 400 saying why at any other value."""

    model_config = ConfigDict(extra="allow", strict=True)
    UNSUPPORTED: ClassVar[dict[str, tuple[tuple, str]]] = {}

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data):
        if not cls.UNSUPPORTED or not isinstance(data, dict):
            return data
        for name in sorted(cls.UNSUPPORTED.keys() & data.keys()):
            no_ops, why = cls.UNSUPPORTED[name]
            if not any(_same(data[name], v) for v in no_ops):
                shown = json.dumps(data[name])
                shown = shown if len(shown) <= 60 else shown[:57] + "..."
                raise APIError(400, f"{name}={shown} is not supported: {why}", param=name)
        return {k: v for k, v in data.items() if k not in cls.UNSUPPORTED}


def ignored_fields(obj: BaseModel, prefix: str = "") -> list[str]:
    """The dotted paths of the fields a parsed request carried that this server does not know."""
    out = [prefix + k for k in obj.model_extra or {}]
    for name in type(obj).model_fields:
        value = getattr(obj, name)
        items = [(name, value)] if isinstance(value, BaseModel) else \
            [(f"{name}.{i}", v) for i, v in enumerate(value)] if isinstance(value, list) else []
        out += [f for path, v in items if isinstance(v, BaseModel) for f in ignored_fields(v, f"{prefix}{path}.")]
    return out


FUNCTIONS = "OpenAI's deprecated function calling: use tools and tool_choice"
NOT_WITH_SPECULATION = "vLLM does not apply it with speculative decoding (vLLM refuses it with speculation on)"
CHAT_TEMPLATE = "the model's own chat template is always used"
# what the server itself passes to the chat template: a request's chat_template_kwargs may not set them
TEMPLATE_ARGUMENTS = ("messages", "conversation", "tools", "documents", "add_generation_prompt",
                      "continue_final_message", "tokenize", "chat_template", "return_dict", "tokenizer")


def _check_template_kwargs(kwargs: dict | None) -> None:
    if kwargs and (taken := sorted(set(kwargs) & set(TEMPLATE_ARGUMENTS))):
        raise APIError(400, f"chat_template_kwargs may not set {', '.join(taken)}: the request's own fields do",
                       param="chat_template_kwargs")


class TextPart(_Fields):
    type: Literal["text"]
    text: str


class ChatMessage(_Fields):
    UNSUPPORTED = {"function_call": ((None,), FUNCTIONS)}

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = Field(None, description="an assistant's tool calls, passed to the chat template")
    tool_call_id: str | None = Field(None, description="a tool message's call")

    @model_validator(mode="after")
    def _has_content(self):
        if self.content is None and not self.tool_calls:
            raise APIError(400, "a message needs content (or, from the assistant, tool_calls)", param="messages")
        return self

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(p.text for p in self.content)

    def template_dict(self) -> dict:
        """The message as chat templates take it."""
        out = {"role": self.role, "content": self.text()}
        out.update({k: getattr(self, k) for k in ("name", "tool_calls", "tool_call_id") if getattr(self, k)})
        return out


class StreamOptions(_Fields):
    include_usage: bool = False


class SpeculationOverride(_Fields):
    """Per-request control of speculation (an extension field `speculation` of both endpoints)."""

    enabled: bool = True
    max_draft_tokens: int | None = Field(None, ge=0, le=32)
    drafters: list[str] | None = None  # fixed drafters: bypass routing
    routing: Literal["router", "random"] = "router"
    lockstep: bool | None = Field(None, description="with several drafters: true fuses them in lockstep, false "
                                  "one-shot (each drafts its own chain in one call); default: the controller's choice")
    drafters_per_request: int | None = Field(None, ge=1, le=8, description="routed drafters every round "
                                             "(overrides the controller's adaptive participation)")
    mode: RequestMode | None = Field(None, description="vote: Minions' majority vote of the voters "
                                                   "(speculation.vote.drafters, or `drafters`); cosine: routing and "
                                                   "fusion; default: the server's speculation.mode. Both are "
                                                   "lossless, so a request may pick either")

    def fields(self) -> dict:
        return self.model_dump(include=set(type(self).model_fields))


MAX_LOGPROBS = 20  # vLLM's default max_logprobs

# known OpenAI and vLLM fields of both endpoints this server does not implement (docs/api.md)
COMMON_UNSUPPORTED = {
    "logit_bias": (({}, None), NOT_WITH_SPECULATION),
    "min_p": ((0, 0.0, None), NOT_WITH_SPECULATION),
    "use_beam_search": ((False, None), "beam search is not served (speculation verifies one sequence)"),
    "length_penalty": ((1, 1.0, None), "beam search is not served"),
    "logprob_token_ids": ((None, []), "log-probabilities of chosen ids are not returned: use the top ones"),
    "spaces_between_special_tokens": ((True, None), "a slow tokenizer's option; the fast tokenizers decode without it"),
    "repetition_detection": ((None,), "not passed to the verifier"),
}


class _Common(_Fields):
    model: str
    max_tokens: int | None = Field(None, ge=1, description="deprecated by OpenAI for max_completion_tokens")
    max_completion_tokens: int | None = Field(None, ge=1, description="tokens to generate at most (wins over "
                                              "max_tokens); default: up to the context length")
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1, description="0 or -1 (vLLM's spelling): off")
    seed: int | None = Field(None, ge=0, le=2**63 - 1, description="with n > 1, choice i is seeded seed + i")
    stop: str | list[str] | None = Field(None, description="up to 4 non-empty strings")
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    n: int = Field(1, ge=1, le=128, description="choices, each sampled on its own (temperature > 0; at most "
                                                "ingress.max_queued_requests)")
    speculation: SpeculationOverride | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2, description="applied by vLLM's sampler")
    frequency_penalty: float | None = Field(None, ge=-2, le=2, description="applied by vLLM's sampler")
    repetition_penalty: float | None = Field(None, gt=0, allow_inf_nan=False,
                                             description="vLLM's extension, applied by its sampler; 1: off")
    # vLLM's extensions
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, description="EOS and stop_token_ids are held back until this many tokens")
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    return_tokens_as_token_ids: bool | None = Field(None, description="logprobs name tokens `token_id:<id>`")
    return_token_ids: bool | None = Field(None, description="vLLM's: the prompt's token ids (`prompt_token_ids`, "
                                          "streamed once) and each choice's (`token_ids`, streamed as deltas)")
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="vLLM's: the target's log-"
                                        "probability of each prompt token and of this many top tokens (not streamed)")
    allowed_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(
        None, min_length=1, description="vLLM's: the target samples among these tokens only (vLLM's sampler)")
    bad_words: list[str] | None = Field(None, description="vLLM's: words never generated (vLLM's sampler, over its "
                                        "tokenization of each word with and without a leading space)")
    include_stop_str_in_output: bool = Field(False, description="vLLM's: the stop string that ended the text is kept")
    skip_special_tokens: bool = Field(True, description="vLLM's: false keeps special tokens in the text")
    truncate_prompt_tokens: int | None = Field(None, ge=-1, description="vLLM's: keep this many of the prompt's "
                                               "tokens (-1: the context length), from truncation_side")
    truncation_side: Literal["left", "right"] | None = Field(None, description="vLLM's: where tokens are cut "
                                                             "(default left: the prompt's end is kept)")
    # structured output, validated and converted by vLLM's protocol models (serve_app/vllm_api.py)
    response_format: dict | None = Field(None, description="OpenAI's: text, json_object, json_schema (vLLM's "
                                         "structural_tag too); applied by vLLM's structured-output backend")
    structured_outputs: dict | None = Field(None, description="vLLM's: one of json, regex, choice, grammar, "
                                            "json_object, structural_tag")

    def constraint_fields(self) -> dict:
        """The fields vLLM's protocol models read (serve_app/vllm_api.py), as sent."""
        fields = {k: getattr(self, k, None) for k in ("response_format", "structured_outputs", "tools", "tool_choice",
                                                      "parallel_tool_calls")}
        return fields | {"include_reasoning": None if getattr(self, "include_reasoning", True) else False}

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if len(stops) > 4 or any(not s for s in stops):
            raise APIError(400, "stop must be up to 4 non-empty strings", param="stop")
        return stops

    def completion_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def _check_prompt_logprobs(req) -> None:
    if req.prompt_logprobs is not None and req.stream:
        raise APIError(400, "prompt_logprobs are not available when stream is true (as in vLLM)",
                       param="prompt_logprobs")


class ChatCompletionRequest(_Common):
    UNSUPPORTED = COMMON_UNSUPPORTED | {
        "functions": (([], None), FUNCTIONS), "function_call": (("none", "auto", None), FUNCTIONS),
        "audio": ((None,), "audio output is not served"), "modalities": ((["text"], None), "text only"),
        "prediction": ((None,), "predicted outputs are not served"),
        "web_search_options": ((None,), "web search is not served"),
        "chat_template": ((None,), CHAT_TEMPLATE), "documents": ((None,), CHAT_TEMPLATE),
    }

    messages: list[ChatMessage] = Field(..., min_length=1)
    echo: bool = Field(False, description="vLLM's: the reply is prefixed with the last message where that is the "
                       "assistant's (the reply continues it)")
    logprobs: bool | None = Field(None, description="the target's log-probability of each token (vLLM's logprobs)")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="and of this many top tokens")
    tools: list[dict] | None = Field(None, description="function tools, passed to the chat template")
    tool_choice: str | dict | None = Field(None, description="none, auto (the server's tool-call parser), required, "
                                           "or a named function: required and named are constrained decoding of the "
                                           "tools' JSON schema, as vLLM does")
    parallel_tool_calls: bool | None = Field(None, description="false: one tool call at most (required)")
    add_generation_prompt: bool = Field(True, description="vLLM's extension, passed to the chat template")
    continue_final_message: bool = Field(False, description="vLLM's extension: the reply continues the last message")
    add_special_tokens: bool = Field(False, description="vLLM's extension: the tokenizer's own special tokens too")
    chat_template_kwargs: dict | None = Field(None, description="vLLM's extension: more variables for the chat "
                                              "template (e.g. enable_thinking)")
    include_reasoning: bool = Field(True, description="vLLM's extension: false leaves the reasoning out of the reply")

    @model_validator(mode="after")
    def _consistent(self):
        _check_template_kwargs(self.chat_template_kwargs)
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        if self.add_generation_prompt and self.continue_final_message:
            raise APIError(400, "continue_final_message needs add_generation_prompt: false",
                           param="continue_final_message")
        _check_prompt_logprobs(self)
        return self

    def logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def prompt_logprobs_asked(self) -> int | None:
        return self.prompt_logprobs


class CompletionRequest(_Common):
    UNSUPPORTED = COMMON_UNSUPPORTED | {
        "best_of": ((1, None), "one sequence per choice: use n"),
        "suffix": ((None, ""), "fill-in-the-middle is not served"),
        "prompt_embeds": ((None,), "prompt embeddings are not accepted"),
    }

    prompt: (str | list[Annotated[int, Field(ge=0)]] | list[str] | list[list[Annotated[int, Field(ge=0)]]]) = Field(
        ..., description="a text, token ids, or a batch of either (one choice per prompt and n, indexed prompt * n + "
        "choice, as OpenAI and vLLM index them)")
    max_tokens: int | None = Field(None, ge=0, description="0 with echo: the prompt alone (and its logprobs)")
    echo: bool = Field(False, description="the prompt before each choice's text (and its tokens' logprobs, the first "
                       "None, with logprobs)")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="the target's log-probability of each "
                                 "token, and of this many top tokens")
    add_special_tokens: bool = Field(False, description="vLLM's extension (its default there: true): the tokenizer's "
                                     "special tokens around a text prompt")

    @model_validator(mode="after")
    def _consistent(self):
        if self.max_tokens == 0 and not self.echo:
            raise APIError(400, "max_tokens=0 needs echo: true (it returns the prompt alone)", param="max_tokens")
        _check_prompt_logprobs(self)
        return self

    def logprobs_asked(self) -> int | None:
        return self.logprobs

    def prompt_logprobs_asked(self) -> int | None:
        """vLLM's rule: prompt_logprobs where given, else the logprobs of an echoed prompt."""
        return self.prompt_logprobs if self.prompt_logprobs is not None else self.logprobs if self.echo else None

    def echo_only(self) -> bool:
        """echo with max_tokens 0: one token is generated (vLLM's way) and only the prompt is returned."""
        return self.echo and self.max_tokens == 0

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one, or the batch it sends (a list of texts or of token-id lists)."""
        if self.prompt == []:
            raise APIError(400, "the prompt is empty", param="prompt")
        return list(self.prompt) if isinstance(self.prompt, list) and not isinstance(self.prompt[0], int) \
            else [self.prompt]


class TokenizeCompletionRequest(_Fields):
    """vLLM's /tokenize of a prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(_Fields):
    """vLLM's /tokenize of chat messages: the ids /v1/chat/completions feeds the model."""

    UNSUPPORTED = {"chat_template": ((None,), CHAT_TEMPLATE)}

    model: str | None = None
    messages: list[ChatMessage] = Field(..., min_length=1)
    tools: list[dict] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool | None = False
    chat_template_kwargs: dict | None = None

    @model_validator(mode="after")
    def _consistent(self):
        _check_template_kwargs(self.chat_template_kwargs)
        if self.add_generation_prompt and self.continue_final_message:
            raise APIError(400, "continue_final_message needs add_generation_prompt: false",
                           param="continue_final_message")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Fields):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str = Field(description="this server's (cosine-serve)")
    vllm_version: str | None = Field(None, description="the vLLM installed beside the ingress")


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


def openapi_body(*model_classes) -> dict:
    """`openapi_extra` of a route that parses its body itself (size limit, strict errors): the body's schema."""
    refs = [{"$ref": f"#/components/schemas/{m.__name__}"} for m in model_classes]
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": refs[0] if len(refs) == 1 else {"anyOf": refs}}}}}


def openapi_responses(*statuses: int, stream: bool = False, model=None) -> dict:
    ok: dict = {"description": "the completion"}
    if model is not None:
        ok = {"model": model, "description": "the result"}
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
        raise APIError(400, f"{loc}: {err['msg']}", param=loc) from None
