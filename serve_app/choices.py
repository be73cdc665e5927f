"""One choice of a response as the OpenAI server shows it: a chat choice's assistant message (`ChatReply`), a
completion choice's text and logprobs (`CompletionChoice`), each from the `Prompt` it continues."""

from __future__ import annotations

from dataclasses import dataclass

from engines.sampling import SamplingParams
from serve_app import responses as R
from serve_app.vllm_api import tool_call


@dataclass
class Prompt:
    """One prompt of a request: its token ids (truncated as asked), its sampling parameters, and the text an echo
    shows before each choice's ("" without echo)."""

    ids: list[int]
    params: SamplingParams
    echo: str = ""


class ChatReply:
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


class CompletionChoice:
    """What one completion choice shows of its chunks, as vLLM's server shows it: with echo, the prompt's text and
    tokens before the first (their logprobs from the prompt's, the first None); echo with max_tokens 0 shows only
    the prompt; text_offset runs on across chunks; token ids and prompt_logprobs where asked."""

    def __init__(self, prompt: Prompt, req, name):
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
            logprobs = R.completion_logprobs(ids, lps, self.top, self.name, self.offset)
            self.offset += sum(len(t) for t in logprobs["tokens"])
        out = {"text": text, "logprobs": logprobs, "finish_reason": "length" if echo_only and reason else reason,
               **out}
        if req.return_token_ids:
            out["token_ids"] = chunk.token_ids
        if whole and req.prompt_logprobs is not None:
            out["prompt_logprobs"] = R.prompt_logprobs(chunk.prompt_logprobs or [], self.name)
        return out
