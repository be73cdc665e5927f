"""A prepared request through the verifier and back to the client: its choices (vLLM's n), whole or streamed as
Server-Sent Events chunk by chunk as the verifier commits tokens, detokenized, with the request's speculation in
`usage` (vLLM's names: mean_acceptance_length, draft_acceptance_rate); and the requests in flight, bounded (429
with Retry-After beyond ingress.max_queued_requests)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, replace

from fastapi.responses import JSONResponse, StreamingResponse

from config import AppConfig
from engines.sampling import SamplingParams
from serve_app import protocol as P
from serve_app import responses as R
from serve_app.app import configured_api_key, error_response, ignored_headers, tenant_of
from serve_app.choices import ChatReply, CompletionChoice, Prompt
from serve_app.detokenize import Detokenizer, TokenNames, token_id_name
from speculation.messages import SpeculationOverrides

logger = logging.getLogger("ray.serve")


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


def _failure(e: BaseException, rid: str, req) -> P.APIError:
    """A failed request's error: a 400 where the verifier refused it (vLLM's validation of its constraint: a
    ValueError), a 500 otherwise (details in the log)."""
    cause = getattr(e, "cause", e)  # Ray's RayTaskError carries the verifier's exception
    if isinstance(cause, ValueError):
        fields = ("tool_choice", "structured_outputs", "response_format", "bad_words")
        return P.APIError(400, str(cause), param=next((f for f in fields if getattr(req, f, None)), None))
    logger.error("request %s failed (%s)", rid, type(e).__name__, exc_info=e)
    return P.APIError(500, f"generation failed (request {rid})", type_="server_error")


@dataclass
class _Choices:
    """One request's choices: vLLM's n requests of each prompt, choice j seeded seed + j; choice index =
    prompt * n + j; with what shows each of them to the client."""

    req: object
    items: list[Prompt]
    chat: bool
    rid: str
    created: int
    picks: list[tuple[Prompt, SamplingParams]]
    ids: list[str]
    detoks: list[Detokenizer]
    name: object  # a token's string in logprobs
    replies: list[ChatReply] | None
    shown: list[CompletionChoice] | None

    def chat_logprobs(self, chunk) -> dict | None:
        top = self.items[0].params.logprobs  # None: no logprobs
        return None if top is None or not chunk.token_ids else \
            R.chat_logprobs(chunk.token_ids, chunk.logprobs or [], top, self.name)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(it.ids) for it in self.items)  # each prompt counted once, whatever n


class Responder:
    def __init__(self, config: AppConfig, tokenizer, verifier, vllm_api):
        self.cfg, self.tokenizer, self.vllm_api = config, tokenizer, vllm_api
        self.verifier_calls = verifier
        self.verifier = verifier.options(stream=True)
        self.model_name = config.ingress.model_name
        self.token_names = TokenNames(tokenizer)
        self.in_flight = 0
        # every request past the API key check carried the one configured key: they are one tenant (none without)
        self.tenant = tenant_of(configured_api_key(config))

    def admit(self, n: int) -> None:
        """Room for n more requests in flight, or a 429."""
        if self.in_flight + n > self.cfg.ingress.max_queued_requests:
            raise P.APIError(429, "the server is at capacity; retry shortly", type_="rate_limit_error",
                             code="overloaded", headers={"Retry-After": str(self.cfg.ingress.retry_after_s)})

    def _choices(self, req, items: list[Prompt], chat: bool, vreq) -> _Choices:
        rid = R.new_id("chatcmpl" if chat else "cmpl")
        picks = [(it, it.params if it.params.seed is None else replace(it.params, seed=it.params.seed + j))
                 for it in items for j in range(req.n)]
        detoks = [Detokenizer(self.tokenizer, p.stop, p.min_tokens, req.include_stop_str_in_output,
                              req.skip_special_tokens) for _, p in picks]
        name = token_id_name if req.return_tokens_as_token_ids else self.token_names
        ids = [rid] if len(picks) == 1 else [f"{rid}-{i}" for i in range(len(picks))]
        return _Choices(req, items, chat, rid, R.now(), picks, ids, detoks, name,
                        [ChatReply(self.vllm_api, vreq, it.ids) for it, _ in picks] if chat else None,
                        [CompletionChoice(it, req, name) for it, _ in picks] if not chat else None)

    async def respond(self, req, items: list[Prompt], chat: bool, vreq=None):
        """`items`: each prompt of the request (chat: one; completions: its batch)."""
        c = self._choices(req, items, chat, vreq)
        headers = ignored_headers(req, c.rid)
        self.in_flight += len(c.picks)
        overrides = SpeculationOverrides(**(req.speculation.fields() if req.speculation else {}), tenant=self.tenant)
        if req.stream:
            return await self._streamed(c, overrides, headers)
        try:  # one reply per choice (a client hanging up cancels the calls, and the requests with them)
            wholes = await _all([self.verifier_calls.complete.remote(it.ids, p, cid, overrides)
                                 for (it, p), cid in zip(c.picks, c.ids)])
        except Exception as e:  # noqa: BLE001 - details stay in the log, not in the response
            return error_response(_failure(e, c.rid, req))
        finally:
            self.in_flight -= len(c.picks)
        return JSONResponse(self._whole(c, wholes), headers=headers)

    def _whole(self, c: _Choices, wholes: list) -> dict:
        """The response body of a request not streamed, from each choice's whole reply."""
        req, out = c.req, []
        for i, whole in enumerate(wholes):
            text = c.detoks[i].push(whole.token_ids, True)
            if c.chat:
                message = c.replies[i].whole(text, whole.token_ids)
                if c.items[0].echo:
                    message["content"] = c.items[0].echo + (message["content"] or "")
                out.append({"index": i, "message": message, "logprobs": c.chat_logprobs(whole),
                            "finish_reason": c.replies[i].finish_reason(whole.finish_reason)})
                if req.return_token_ids:
                    out[-1]["token_ids"] = whole.token_ids
            else:
                out.append({"index": i, **c.shown[i].choice(whole, text, whole.finish_reason, whole=True)})
        u = R.usage(c.prompt_tokens, sum(len(w.token_ids) for w in wholes), R.spec_usage([w.usage for w in wholes]))
        body = {"id": c.rid, "object": "chat.completion" if c.chat else "text_completion", "created": c.created,
                "model": self.model_name, "choices": out, "usage": u}
        if c.chat and req.prompt_logprobs is not None:  # vLLM's chat response carries the prompt's once
            body["prompt_logprobs"] = R.prompt_logprobs(wholes[0].prompt_logprobs or [], c.name)
        if c.chat and req.return_token_ids:
            body["prompt_token_ids"] = c.items[0].ids
        return body

    async def _streamed(self, c: _Choices, overrides, headers: dict):
        req, n = c.req, len(c.picks)
        gens = [self.verifier.generate.remote(it.ids, p, cid, overrides) for (it, p), cid in zip(c.picks, c.ids)]
        if c.items[0].params.structured_outputs is not None or c.items[0].params.bad_words:
            try:  # what vLLM's validation refuses (a constraint, bad words) is a 400, before the stream
                gens = [_Primed(g, first) for g, first in zip(gens, await asyncio.gather(*map(anext, gens)))]
            except Exception as e:  # noqa: BLE001 - what vLLM refused, or a failure
                self.in_flight -= n
                for g in gens:
                    g.cancel()
                return error_response(_failure(e, c.rid, req))
        events = self._chat_events(c, gens) if c.chat else self._completion_events(c, gens)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(self._with_usage(c, gens, events, include_usage), media_type="text/event-stream",
                                 headers=headers)

    async def _chat_events(self, c: _Choices, gens: list):
        """A streamed chat's chunks: the role of each choice (the first with the prompt's ids where asked), the
        echoed last message, then a chunk per choice and verify step that committed tokens."""
        req, prompt = c.req, c.items[0]
        for i in range(len(gens)):
            first = R.chat_chunk(c.rid, self.model_name, c.created, {"role": "assistant", "content": ""}, None, i)
            if req.return_token_ids and i == 0:
                first["prompt_token_ids"] = prompt.ids
            yield i, first, None
        if prompt.echo:
            for i in range(len(gens)):
                yield i, R.chat_chunk(c.rid, self.model_name, c.created, {"content": prompt.echo}, None, i), None
        async for i, chunk in _merged(gens):
            text = c.detoks[i].push(chunk.token_ids, chunk.finished)
            reason = chunk.finish_reason if chunk.finished else None
            lp = c.chat_logprobs(chunk)
            delta = c.replies[i].delta(text, chunk.token_ids, chunk.finished)
            if delta or reason or lp or (req.return_token_ids and chunk.token_ids):
                ids = {"token_ids": chunk.token_ids} if req.return_token_ids else {}
                yield i, R.chat_chunk(c.rid, self.model_name, c.created, delta, c.replies[i].finish_reason(reason), i,
                                      lp, **ids), chunk
            else:
                yield i, None, chunk

    async def _completion_events(self, c: _Choices, gens: list):
        """A streamed completion's chunks: one per choice and verify step that committed tokens (the echoed
        prompt with the first)."""
        async for i, chunk in _merged(gens):
            text = c.detoks[i].push(chunk.token_ids, chunk.finished)
            choice = c.shown[i].choice(chunk, text, chunk.finish_reason if chunk.finished else None)
            if choice["text"] or choice["finish_reason"] or choice["logprobs"] or choice.get("token_ids") \
                    or "prompt_token_ids" in choice:
                yield i, R.completion_chunk(c.rid, self.model_name, c.created, index=i, **choice), chunk
            else:
                yield i, None, chunk

    async def _with_usage(self, c: _Choices, gens: list, events, include_usage: bool):
        """The Server-Sent Events of a streamed request: its chunks, the usage where asked, [DONE]; an error event
        where generation fails."""
        n, rid = len(gens), c.rid
        counts, stats = [0] * n, [None] * n
        try:
            async for i, event, chunk in events:
                if chunk is not None:
                    counts[i] += len(chunk.token_ids)
                    if chunk.finished:
                        stats[i] = chunk.usage
                if event is not None:
                    yield R.sse(event)
            if include_usage:
                u = R.usage(c.prompt_tokens, sum(counts), R.spec_usage(stats))
                yield R.sse({"id": rid, "object": "chat.completion.chunk" if c.chat else "text_completion",
                             "created": c.created, "model": self.model_name, "choices": [], "usage": u})
            yield "data: [DONE]\n\n"
        except Exception:  # noqa: BLE001 - the client gets an error event, a finish_reason and [DONE]
            logger.exception("request %s failed", rid)
            yield R.sse(P.APIError(500, f"generation failed (request {rid})", type_="server_error").body())
            for i in range(n):
                yield R.sse(R.chat_chunk(rid, self.model_name, c.created, {}, "error", i) if c.chat
                            else R.completion_chunk(rid, self.model_name, c.created, "", "error", i))
            yield "data: [DONE]\n\n"
        finally:
            self.in_flight -= n
            for g in gens:
                g.cancel()
