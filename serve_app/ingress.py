"""The ingress deployment: OpenAI-compatible HTTP API (FastAPI) in front of the verifier.

It formats chat requests with the tokenizer's chat template, validates everything it can before any work is
queued (OpenAI-style error bodies with the right 4xx status), bounds the number of requests in flight (429 with
Retry-After beyond it), streams Server-Sent Events chunk by chunk as the verifier commits tokens, and reports the
request's speculation in `usage` (vLLM's names: mean_acceptance_length, draft_acceptance_rate).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from ray import serve

from config import AppConfig
from engines.build import load_tokenizer
from engines.sampling import SamplingParams
from serve_app import protocol as P
from speculation.messages import SpeculationOverrides

logger = logging.getLogger("ray.serve")
app = FastAPI(title="CoSine Serve", description="OpenAI-compatible collaborative speculative inference")
OPEN_PATHS = {"/health", "/metrics"}  # what load balancers and Prometheus reach without the API key


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
        for model in (P.ChatCompletionRequest, P.CompletionRequest):
            js = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(js.pop("$defs", {}))
            if getattr(app.state, "model_name", None):  # the one model this server serves
                js["properties"]["model"]["enum"] = [app.state.model_name]
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
    """Incremental text from token ids: holds back a trailing partial UTF-8 character, and the stop strings."""

    def __init__(self, tokenizer, stops: list[str]):
        self.tok, self.stops = tokenizer, stops
        self.ids: list[int] = []
        self.sent = 0
        self.hold = max((len(s) for s in stops), default=1) - 1

    def push(self, ids: list[int], final: bool) -> str:
        self.ids.extend(ids)
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            text, final = text[:cut], True
        if not final:
            end = len(text) - self.hold
            while end > self.sent and text[end - 1] == "\ufffd":
                end -= 1
            text = text[:max(end, self.sent)]
        out, self.sent = text[self.sent:], max(self.sent, len(text))
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

    def _prepare(self, req, prompt_ids: list[int]) -> SamplingParams:
        if req.model != self.model_name:
            raise P.APIError(404, f"the model {req.model!r} does not exist; this server serves {self.model_name!r}",
                             param="model", code="model_not_found")
        if not prompt_ids:
            raise P.APIError(400, "the prompt is empty", param="prompt")
        if len(prompt_ids) >= self.max_len:
            raise P.APIError(400, f"the prompt has {len(prompt_ids)} tokens; this model's context is {self.max_len}",
                             param="messages", code="context_length_exceeded")
        max_tokens = req.completion_limit()
        room = self.max_len - len(prompt_ids)
        if max_tokens is None:
            max_tokens = room
        elif max_tokens > room:
            raise P.APIError(400, f"max_tokens={max_tokens} plus the prompt's {len(prompt_ids)} tokens exceeds the "
                             f"context of {self.max_len}", param="max_tokens", code="context_length_exceeded")
        if req.speculation and req.speculation.drafters:
            unknown = sorted(set(req.speculation.drafters) - self.drafter_names)
            if unknown:
                raise P.APIError(400, f"unknown drafters {unknown}; known: {sorted(self.drafter_names)}",
                                 param="speculation.drafters")
        return SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=max(0, req.top_k),
                              seed=req.seed, stop=req.stops(), ignore_eos=req.ignore_eos)

    def _chat_ids(self, messages: list[dict]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self._text_ids(text)

    def _text_ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def _admit(self) -> None:
        if self.in_flight >= self.cfg.ingress.max_queued_requests:
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

    @app.post("/v1/chat/completions", openapi_extra=P.openapi_body(P.ChatCompletionRequest),
              responses=P.openapi_responses(400, 401, 404, 413, 429, 500, stream=True))
    async def chat(self, request: Request):
        try:
            req = P.parse(P.ChatCompletionRequest, await self._body(request))
            prompt_ids = await self._tokenize(self._chat_ids, [{"role": m.role, "content": m.text()}
                                                               for m in req.messages])
            params = self._prepare(req, prompt_ids)
            self._admit()
        except P.APIError as e:
            return _error(e)
        return await self._respond(req, prompt_ids, params, chat=True)

    @app.post("/v1/completions", openapi_extra=P.openapi_body(P.CompletionRequest),
              responses=P.openapi_responses(400, 401, 404, 413, 429, 500, stream=True))
    async def completions(self, request: Request):
        try:
            req = P.parse(P.CompletionRequest, await self._body(request))
            prompt_ids = list(req.prompt) if isinstance(req.prompt, list) else \
                await self._tokenize(self._text_ids, req.prompt)
            if isinstance(req.prompt, list) and any(not 0 <= t < len(self.tokenizer) for t in prompt_ids):
                raise P.APIError(400, "prompt token ids out of the vocabulary", param="prompt")
            params = self._prepare(req, prompt_ids)
            self._admit()
        except P.APIError as e:
            return _error(e)
        return await self._respond(req, prompt_ids, params, chat=False)

    # ------------------------------------------------------------------ generation
    async def _respond(self, req, prompt_ids: list[int], params: SamplingParams, chat: bool):
        rid = P.new_id("chatcmpl" if chat else "cmpl")
        created = P.now()
        self.in_flight += 1
        overrides = SpeculationOverrides(**req.speculation.model_dump()) if req.speculation else None
        detok = _Detokenizer(self.tokenizer, params.stop)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def events():
            try:
                if chat:
                    yield P.sse(P.chat_chunk(rid, self.model_name, created, {"role": "assistant", "content": ""}, None))
                n = 0
                async for chunk in gen:  # a chunk per verify step that committed tokens
                    n += len(chunk.token_ids)
                    text = detok.push(chunk.token_ids, chunk.finished)
                    reason = chunk.finish_reason if chunk.finished else None
                    if text or reason:
                        body = (P.chat_chunk(rid, self.model_name, created, {"content": text} if text else {}, reason)
                                if chat else P.completion_chunk(rid, self.model_name, created, text, reason))
                        yield P.sse(body)
                    if chunk.finished:
                        if include_usage:
                            u = P.usage(len(prompt_ids), n, P.spec_usage(chunk.usage))
                            obj = "chat.completion.chunk" if chat else "text_completion"
                            yield P.sse({"id": rid, "object": obj, "created": created, "model": self.model_name,
                                        "choices": [], "usage": u})
                        break
                yield "data: [DONE]\n\n"
            except Exception:  # noqa: BLE001 - the client gets an error event, a finish_reason and [DONE]
                logger.exception("request %s failed", rid)
                yield P.sse(P.APIError(500, f"generation failed (request {rid})", type_="server_error").body())
                end = (P.chat_chunk(rid, self.model_name, created, {}, "error") if chat
                       else P.completion_chunk(rid, self.model_name, created, "", "error"))
                yield P.sse(end)
                yield "data: [DONE]\n\n"
            finally:
                self.in_flight -= 1
                gen.cancel()

        if req.stream:
            gen = self.verifier.generate.remote(prompt_ids, params, rid, overrides)
            return StreamingResponse(events(), media_type="text/event-stream")
        try:  # one reply for the whole request (a client hanging up cancels the call, and the request with it)
            whole = await self.verifier_calls.complete.remote(prompt_ids, params, rid, overrides)
            ids, reason, stats = whole.token_ids, whole.finish_reason, whole.usage
            text = detok.push(ids, True)
        except Exception:  # noqa: BLE001 - details stay in the log, not in the response
            logger.exception("request %s failed", rid)
            return _error(P.APIError(500, f"generation failed (request {rid})", type_="server_error"))
        finally:
            self.in_flight -= 1
        u = P.usage(len(prompt_ids), len(ids), P.spec_usage(stats))
        if chat:
            return {"id": rid, "object": "chat.completion", "created": created, "model": self.model_name,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                 "logprobs": None, "finish_reason": reason}], "usage": u}
        return {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": reason}], "usage": u}
