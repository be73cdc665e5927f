"""A request of the OpenAI API from its body to what the verifier runs: the body read within its size limit, the
prompt tokenized (chat messages through the model's chat template) and truncated as asked, every field checked
against this server (OpenAI-style errors with the right 4xx status), and the sampling parameters of each prompt."""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor

from fastapi import Request
from jinja2 import TemplateError

from config import AppConfig
from engines.sampling import SamplingParams
from serve_app import protocol as P
from serve_app.choices import Prompt


class RequestPreparer:
    def __init__(self, config: AppConfig, tokenizer, vllm_api):
        self.cfg, self.tokenizer, self.vllm_api = config, tokenizer, vllm_api
        self.model_name = config.ingress.model_name
        self.max_len = config.verifier.max_len
        self.drafter_names = {d.name for d in config.drafters}
        self.tokenize_pool = ThreadPoolExecutor(1, thread_name_prefix="tokenize")

    # ------------------------------------------------------------------ whole requests
    async def chat(self, request: Request):
        """A chat request, its constraint (vLLM's request model, or None) and its one prompt."""
        req = P.parse(P.ChatCompletionRequest, await self.body(request))
        vreq = self.constraints(req, chat=True)
        prompt_ids = self.truncated(req, await self.tokenized(
            self.chat_ids, self.messages(req), req.add_generation_prompt, req.continue_final_message,
            req.add_special_tokens, req.tools, req.chat_template_kwargs))
        params = self.prepare(req, prompt_ids, vreq)
        # vLLM's echo: the reply continues the last message where it is the assistant's
        last = req.messages[-1]
        echo = last.text() if req.echo and last.role == "assistant" else ""
        return req, vreq, Prompt(prompt_ids, params, echo)

    async def completions(self, request: Request):
        """A completions request and its prompts (a batch of texts or token-id lists)."""
        req = P.parse(P.CompletionRequest, await self.body(request))
        prompts = req.prompts()
        if len(prompts) * req.n > self.cfg.ingress.max_queued_requests:
            raise P.APIError(400, f"{len(prompts)} prompts x n={req.n} exceed the requests this server queues "
                             f"({self.cfg.ingress.max_queued_requests})", param="prompt")
        vreq = self.constraints(req, chat=False)
        items = []
        for prompt in prompts:
            given = list(prompt) if isinstance(prompt, list) else \
                await self.tokenized(self.text_ids, prompt, req.add_special_tokens)
            if isinstance(prompt, list) and any(t >= len(self.tokenizer) for t in given):
                raise P.APIError(400, "prompt token ids out of the vocabulary", param="prompt")
            prompt_ids = self.truncated(req, given)
            # the echoed text: the prompt as sent, or the text of its token ids (truncated: of what is kept)
            echo = "" if not req.echo or req.return_token_ids else \
                prompt if isinstance(prompt, str) and prompt_ids == given else self.tokenizer.decode(prompt_ids)
            items.append(Prompt(prompt_ids, self.prepare(req, prompt_ids, vreq), echo))
        return req, items

    async def tokenize(self, request: Request):
        """vLLM's /tokenize request and the token ids of its prompt, or of its chat messages as /v1/chat/completions
        feeds them to the model."""
        body = await self.body(request)
        chat = isinstance(body, dict) and "messages" in body
        req = P.parse(P.TokenizeChatRequest if chat else P.TokenizeCompletionRequest, body)
        self.check_model(req.model)
        if chat:
            return req, await self.tokenized(self.chat_ids, self.messages(req), req.add_generation_prompt,
                                             req.continue_final_message, req.add_special_tokens, req.tools,
                                             req.chat_template_kwargs)
        return req, await self.tokenized(self.text_ids, req.prompt, req.add_special_tokens)

    async def detokenize(self, request: Request):
        req = P.parse(P.DetokenizeRequest, await self.body(request))
        self.check_model(req.model)
        if any(t >= len(self.tokenizer) for t in req.tokens):
            raise P.APIError(400, "token ids out of the vocabulary", param="tokens")
        return req

    # ------------------------------------------------------------------ their parts
    async def body(self, request: Request):
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

    async def tokenized(self, fn, *args):
        """Tokenization on the ingress's own thread: a long prompt must not stall the event loop (and every other
        request with it); one thread, because a fast tokenizer is not safe to share between threads."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenize_pool, fn, *args)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise P.APIError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                             param="model", code="model_not_found")

    def constraints(self, req, chat: bool):
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

    def prepare(self, req, prompt_ids: list[int], vreq=None) -> SamplingParams:
        """The sampling parameters of one prompt of `req` (vreq: its constraint), or the request's 4xx."""
        self.check_model(req.model)
        max_tokens = self._max_tokens(req, prompt_ids)
        self._check_fields(req)
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
                param = next(k for k in ("response_format", "tool_choice", "structured_outputs")
                             if getattr(req, k, None))
            elif param == "prompt_logprobs" and req.prompt_logprobs is None:
                param = "echo"  # an echoed prompt's logprobs
            raise P.APIError(400, f"{param} is applied by vLLM's sampler, and this server's verifier is the torch "
                             f"engine (verifier.engine: torch), which does not", param=param)
        return params

    def _max_tokens(self, req, prompt_ids: list[int]) -> int:
        """The tokens the prompt leaves room for, or the request's own limit where it fits."""
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
        return max_tokens

    def _check_fields(self, req) -> None:
        """The fields checked against this server: the vocabulary, the queue, the drafters it has."""
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

    def chat_ids(self, messages: list[dict], add_generation_prompt: bool = True, continue_final_message: bool = False,
                 add_special_tokens: bool = False, tools: list[dict] | None = None,
                 template_kwargs: dict | None = None) -> list[int]:
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, tools=tools,
                                                      add_generation_prompt=add_generation_prompt,
                                                      continue_final_message=continue_final_message,
                                                      **(template_kwargs or {}))
        except TemplateError as e:  # the template's own checks (raise_exception), e.g. on a chat_template_kwargs value
            raise P.APIError(400, f"the chat template refused these messages: {e}", param="messages") from None
        return self.text_ids(text, add_special_tokens)

    def text_ids(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids

    def truncated(self, req, ids: list[int]) -> list[int]:
        """vLLM's truncate_prompt_tokens: the prompt's last (truncation_side left, the default) or first tokens."""
        keep = req.truncate_prompt_tokens
        if keep is None:
            return ids
        keep = self.max_len if keep == -1 else keep
        if keep == 0:
            raise P.APIError(400, "truncate_prompt_tokens=0 leaves no prompt", param="truncate_prompt_tokens")
        return ids[:keep] if req.truncation_side == "right" else ids[-keep:]

    @staticmethod
    def messages(req) -> list[dict]:
        return [m.template_dict() for m in req.messages]
