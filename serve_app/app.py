"""The FastAPI application of one OpenAI server (`openai_app`): its routes bound to the server's methods, the API
key check, OpenAI's error shape for every failure, and the OpenAPI document with the request bodies the routes
parse themselves. The ingress deployment (serve_app/ingress.py) builds it in its replica; tests build it around a
server directly."""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from urllib.parse import quote

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from serve_app import protocol as P

logger = logging.getLogger("ray.serve")
OPEN_PATHS = {"/health", "/metrics"}  # what load balancers and Prometheus reach without the API key
IGNORED_HEADER = "x-cosine-ignored-fields"  # the request's fields this server does not know, ignored
ROUTES = {  # the server's method -> its route (Ray Serve LLM's endpoint map)
    "health": lambda a: a.get("/health", responses={503: {"model": P.ErrorResponse, "description": P.ERRORS[503]}}),
    "metrics": lambda a: a.get("/metrics", response_class=PlainTextResponse),
    "speculation_stats": lambda a: a.get("/v1/internal/speculation_stats", responses=P.openapi_responses(401)),
    "models": lambda a: a.get("/v1/models", responses=P.openapi_responses(401)),
    "version": lambda a: a.get("/version", responses=P.openapi_responses(401, model=P.VersionResponse)),
    "tokenize": lambda a: a.post(
        "/tokenize", openapi_extra=P.openapi_body(P.TokenizeCompletionRequest, P.TokenizeChatRequest),
        responses=P.openapi_responses(400, 401, 404, 413, model=P.TokenizeResponse)),
    "detokenize": lambda a: a.post("/detokenize", openapi_extra=P.openapi_body(P.DetokenizeRequest),
                                   responses=P.openapi_responses(400, 401, 404, 413, model=P.DetokenizeResponse)),
    "chat": lambda a: a.post("/v1/chat/completions", openapi_extra=P.openapi_body(P.ChatCompletionRequest),
                             responses=P.openapi_responses(400, 401, 404, 413, 429, 500, stream=True)),
    "completions": lambda a: a.post("/v1/completions", openapi_extra=P.openapi_body(P.CompletionRequest),
                                    responses=P.openapi_responses(400, 401, 404, 413, 429, 500, stream=True)),
}


def configured_api_key(cfg) -> str | None:
    """The key clients must send to the application of `cfg` (an AppConfig)."""
    return required_api_key(cfg.ingress.api_key)


def required_api_key(config_key: str | None) -> str | None:
    """The key clients must send: the ingress replicas' COSINE_API_KEY, else the configuration's `config_key`."""
    return os.environ.get("COSINE_API_KEY") or config_key


def tenant_of(api_key: str | None) -> str | None:
    """The tenant of the requests authenticated by `api_key` (a digest of it, never the key itself), by which
    drafting across requests is scoped (the suffix drafter's tree of recent outputs); None without a key."""
    return "key-" + hashlib.sha256(api_key.encode()).hexdigest()[:16] if api_key else None


def openai_app(server, api_key: str | None = None) -> FastAPI:
    """The HTTP application of `server` (an OpenAIServer): each route calls its method; with `api_key`, every
    path but OPEN_PATHS needs `Authorization: Bearer <api_key>`."""
    app = FastAPI(title="CoSine Serve", description="OpenAI-compatible collaborative speculative inference")
    app.state.api_key, app.state.model_name = api_key, server.model_name
    app.middleware("http")(_authenticate)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
    for method, route in ROUTES.items():
        route(app)(getattr(server, method))
    app.openapi = lambda: _openapi(app)
    return app


def error_response(e: P.APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def ignored_headers(req, what: str) -> dict:
    """The response headers for the fields of `req` this server does not know (ignored, as vLLM does), logged."""
    fields = P.ignored_fields(req)
    if not fields:
        return {}
    logger.warning("%s: ignored fields this server does not know: %s", what, fields[:32])
    names = [quote(f, safe="._-") for f in fields[:32]] + (["..."] if len(fields) > 32 else [])
    return {IGNORED_HEADER: ",".join(names)}


async def _authenticate(request: Request, call_next):
    key = request.app.state.api_key
    if key and request.url.path not in OPEN_PATHS and not hmac.compare_digest(
            request.headers.get("authorization", "").encode(), f"Bearer {key}".encode()):
        return error_response(P.APIError(401, "a valid API key is required (Authorization: Bearer <key>)",
                                         type_="authentication_error", code="invalid_api_key"))
    return await call_next(request)


def _openapi(app: FastAPI) -> dict:
    """FastAPI's document, plus the schemas of the request bodies the routes parse themselves."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version="1", description=app.description, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in (P.ChatCompletionRequest, P.CompletionRequest, P.TokenizeCompletionRequest, P.TokenizeChatRequest,
                      P.DetokenizeRequest):
            js = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(js.pop("$defs", {}))
            if app.state.model_name and model.model_fields["model"].is_required():
                js["properties"]["model"]["enum"] = [app.state.model_name]  # the one model this server serves
            components[model.__name__] = js
        app.openapi_schema = schema
    return app.openapi_schema


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Unknown paths and methods in OpenAI's error shape too."""
    return error_response(P.APIError(exc.status_code, str(exc.detail),
                                     code="not_found" if exc.status_code == 404 else None))


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unexpected error on %s", request.url.path)
    return error_response(P.APIError(500, "internal server error", type_="server_error"))
