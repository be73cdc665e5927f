"""vLLM's own OpenAI-server pieces behind the ingress: structured outputs from `response_format` /
`structured_outputs`, the JSON schema a `tool_choice` forces, and its tool-call and reasoning parsers
(`ToolParserManager`, `ReasoningParserManager`, as `--tool-call-parser` and `--reasoning-parser`).

Requests are validated and converted by vLLM's protocol models, so a constraint means here what it means to vLLM's
server; the constraint itself is applied in the verifier by vLLM's structured-output backend (engines/vllm_hooks.py).
"""

from __future__ import annotations

import dataclasses
import json
import uuid

from pydantic import ValidationError

from serve_app.protocol import APIError

# the request fields vLLM's protocol models read here
CONSTRAINT_FIELDS = ("response_format", "structured_outputs", "tools", "tool_choice", "parallel_tool_calls")


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

    def reasoning_parser(self):
        return None if self.reasoning_parser_cls is None else self.reasoning_parser_cls(self.tokenizer)

    def split(self, text: str, vreq) -> tuple[str | None, str | None, list[dict]]:
        """(reasoning_content, content, tool_calls) of a whole reply, as vLLM's server splits it."""
        reasoning, content = None, text
        if self.reasoning_parser_cls is not None:
            reasoning, content = self.reasoning_parser().extract_reasoning(text, vreq)
        mode = self.tool_mode(vreq)
        if mode == "named":
            return reasoning, "", [_call(vreq.tool_choice.function.name, content or "")]
        if mode == "required":
            try:
                calls = json.loads(content or "")
            except json.JSONDecodeError:  # cut short (max_tokens): what there is stays content
                return reasoning, content, []
            return reasoning, "", [_call(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in calls]
        if mode == "auto":
            info = self.tool_parser_cls(self.tokenizer, vreq.tools).extract_tool_calls(content or "", vreq)
            if info.tools_called:
                return reasoning, info.content or None, [
                    _call(tc.function.name, tc.function.arguments, tc.id) for tc in info.tool_calls]
        return reasoning, content, []


def _parser(field: str, name: str, get, *args):
    """vLLM's parser class by that name, refused where vLLM has none or it cannot parse this tokenizer's output (it
    looks its tokens up as it is built, as vLLM checks at startup)."""
    try:
        cls = get(name)
        cls(*args)
    except Exception as e:  # noqa: BLE001 - unknown, or this tokenizer lacks its tokens
        raise ValueError(f"ingress.{field}: {name!r} cannot serve this target: {e}") from None
    return cls


def _call(name: str, arguments: str, call_id: str | None = None) -> dict:
    return {"id": call_id or f"chatcmpl-tool-{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}
