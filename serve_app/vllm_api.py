"""vLLM's own OpenAI-server pieces behind the ingress: structured outputs from `response_format` /
`structured_outputs`, the JSON schema a `tool_choice` forces, and its tool-call and reasoning parsers
(`ToolParserManager`, `ReasoningParserManager`, as `--tool-call-parser` and `--reasoning-parser`), composed per reply
as vLLM's server composes them (`ParserManager`): reasoning first, then tool calls, whole or streamed as deltas.

Requests are validated and converted by vLLM's protocol models, so a constraint means here what it means to vLLM's
server; the constraint itself is applied in the verifier by vLLM's structured-output backend (engines/vllm_hooks.py).
"""

from __future__ import annotations

import dataclasses
import uuid

from pydantic import ValidationError

from serve_app.protocol import APIError

# the request fields vLLM's protocol models read here
CONSTRAINT_FIELDS = ("response_format", "structured_outputs", "tools", "tool_choice", "parallel_tool_calls",
                     "include_reasoning")


def _vllm_error(e: Exception, default_param: str) -> APIError:
    if isinstance(e, ValidationError):
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"]) or default_param
        return APIError(400, f"{loc}: {err['msg']}", param=loc.split(".")[0])
    return APIError(400, str(e), param=getattr(e, "parameter", None) or default_param)


class VllmAPI:
    """The parsers the configuration names (refused at construction if vLLM has none by that name, or the
    tokenizer lacks the tokens it needs), and the conversions of a request's constraint fields."""

    def __init__(self, tokenizer, tool_call_parser: str | None, reasoning_parser: str | None):
        from vllm.entrypoints.openai.chat_completion.protocol import (
            ChatCompletionRequest,
        )
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest
        from vllm.reasoning import ReasoningParserManager
        from vllm.tool_parsers import ToolParserManager

        self.chat_cls, self.completion_cls = ChatCompletionRequest, CompletionRequest
        self.tokenizer = tokenizer
        self.tool_parser_cls = None if tool_call_parser is None else _parser(
            "tool_call_parser", tool_call_parser, ToolParserManager.get_tool_parser, tokenizer, None)
        self.reasoning_parser_cls = None if reasoning_parser is None else _parser(
            "reasoning_parser", reasoning_parser, ReasoningParserManager.get_reasoning_parser, tokenizer)
        self.reply_parser_cls = _reply_parser(tool_call_parser, reasoning_parser, tokenizer)

    def request(self, body: dict, chat: bool):
        """vLLM's request model of the constraint fields (and the messages' place held): vLLM's validation."""
        fields = {k: body[k] for k in CONSTRAINT_FIELDS if body.get(k) is not None}
        if chat:
            fields["messages"] = []
        else:
            fields["prompt"] = [0]
            fields.pop("tools", None)
        try:
            vreq = (self.chat_cls if chat else self.completion_cls).model_validate(fields)
        except Exception as e:  # noqa: BLE001 - vLLM's validation errors are the client's
            raise _vllm_error(e, next(k for k in ("tool_choice", "tools", "structured_outputs", "response_format",
                                                  "parallel_tool_calls") if k in fields)) from None
        if chat and vreq.tools and vreq.tool_choice == "auto" and self.tool_parser_cls is None:
            raise APIError(400, 'tool_choice "auto" needs a tool-call parser: the server sets ingress.tool_call_parser '
                           "(vLLM's --tool-call-parser); name a tool in tool_choice, or use \"required\"",
                           param="tool_choice")
        return vreq

    def structured_outputs(self, vreq) -> dict | None:
        """vLLM's StructuredOutputsParams of the request as keyword arguments: a named or required tool_choice forces
        its tools' JSON schema (as vLLM does), otherwise response_format / structured_outputs."""
        try:
            from vllm.sampling_params import StructuredOutputsParams
            from vllm.tool_parsers.utils import get_json_schema_from_tools

            schema = get_json_schema_from_tools(vreq.tool_choice, vreq.tools, vreq.parallel_tool_calls) \
                if getattr(vreq, "tools", None) else None
            so = StructuredOutputsParams(json=schema) if schema is not None else vreq.extract_structured_outputs()
        except Exception as e:  # noqa: BLE001 - vLLM's validation errors are the client's
            raise _vllm_error(e, "tool_choice" if getattr(vreq, "tools", None) else "response_format") from None
        if so is None:
            return None
        return {f.name: getattr(so, f.name) for f in dataclasses.fields(so) if f.init}

    @staticmethod
    def tool_mode(vreq) -> str | None:
        """How tool calls come back: "named", "required", "auto" (the parser's), or None (no tools)."""
        choice = getattr(vreq, "tool_choice", None)
        if not getattr(vreq, "tools", None) or choice == "none":
            return None
        if choice == "required":
            return "required"
        return "auto" if choice in ("auto", None) else "named"

    def reply_parser(self):
        """A parser for one reply (they keep stream state): vLLM's `Parser` interface, `parse` and `parse_delta`."""
        return self.reply_parser_cls(self.tokenizer, None)


def _parser(field: str, name: str, get, *args):
    """vLLM's parser class by that name, refused where vLLM has none or it cannot parse this tokenizer's output (it
    looks its tokens up as it is built, as vLLM checks at startup)."""
    try:
        cls = get(name)
        cls(*args)
    except Exception as e:  # noqa: BLE001 - unknown, or this tokenizer lacks its tokens
        raise ValueError(f"ingress.{field}: {name!r} cannot serve this target: {e}") from None
    return cls


def tool_call(name: str, arguments: str, call_id: str | None = None) -> dict:
    """A whole reply's tool call as the API returns it."""
    return {"id": call_id or f"chatcmpl-tool-{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _reply_parser(tool_call_parser: str | None, reasoning_parser: str | None, tokenizer):
    """vLLM's composed parser class for the configured names, its tool parser made to read a named or required
    tool choice as vLLM's JSON path does: this server constrains those to their tools' JSON schema (structured_outputs
    above), where vLLM 0.32 lets a parser with a structural tag constrain them to its own markup instead. Without a
    tool parser, named and required still return their calls (auto is refused at the request)."""
    from vllm.entrypoints.generate.base.protocol import DeltaMessage, ExtractedToolCallInformation
    from vllm.parser.abstract_parser import DelegatingParser
    from vllm.parser.parser_manager import ParserManager
    from vllm.tool_parsers.abstract_tool_parser import ToolParser

    class NoAutoTools(ToolParser):
        def extract_tool_calls(self, model_output, request):
            return ExtractedToolCallInformation(tools_called=False, tool_calls=[], content=model_output)

        def extract_tool_calls_streaming(self, previous_text, current_text, delta_text, *args):
            return DeltaMessage(content=delta_text) if delta_text else None

    base = ParserManager.get_parser(tool_parser_name=tool_call_parser, reasoning_parser_name=reasoning_parser,
                                    enable_auto_tools=True, tokenizer=tokenizer) or DelegatingParser
    tools = type("JsonToolChoice", (base.tool_parser_cls or NoAutoTools,), {})
    tools.supports_required_and_named = True  # after the class exists: ToolParser.__init_subclass__ may unset it

    class ReplyParser(base):
        """Streamed, the tool-call phase starts where the reasoning ends, which vLLM detects by token ids; a reasoning
        parser whose markers are text (granite's) never reports that, and vLLM would stream a tool call as content.
        Here the first content the reasoning parser passes on ends the reasoning too (content comes only after it,
        or without any)."""

        tool_parser_cls = tools
        _content_seen = False

        def extract_reasoning_streaming(self, *args, **kwargs):
            d = super().extract_reasoning_streaming(*args, **kwargs)
            self._content_seen = self._content_seen or bool(d is not None and d.content)
            return d

        def _is_reasoning_end_streaming(self, input_ids, delta_ids):
            return super()._is_reasoning_end_streaming(input_ids, delta_ids) or self._content_seen

        def _extract_content_ids(self, input_ids):
            ids = super()._extract_content_ids(input_ids)  # None from a parser without end-token ids
            return list(input_ids) if ids is None else ids

    return ReplyParser
