"""The request fields of the OpenAI API as this server parses and checks them (fast: no Serve, no vLLM engine):
unknown fields ignored and reported, known ones it does not serve refused saying why, the new sampling fields
validated and turned into SamplingParams, logprobs written as vLLM's server writes them, min_tokens in the stop
checks, and the torch verifier refusing what only vLLM's sampler applies. docs/api.md has the field table; the
served behaviour is tests/served/test_api_fields.py."""

from __future__ import annotations

import json
import math

import pytest

from engines.sampling import SamplingParams
from engines.stopping import StopChecker
from serve_app import protocol as P
from serve_app import responses as R
from serve_app.choices import ChatReply, CompletionChoice, Prompt
from serve_app.detokenize import Detokenizer, TokenNames
from speculation.messages import SpeculationOverrides, TokenChunk
from tests.helpers.openai_server import openai_server

MSG = [{"role": "user", "content": "hi"}]


def _chat(**fields):
    return P.parse(P.ChatCompletionRequest, {"model": "m", "messages": MSG, **fields})


def _completion(**fields):
    return P.parse(P.CompletionRequest, {"model": "m", "prompt": "hi", **fields})


def _refusal(parse, **fields) -> P.APIError:
    with pytest.raises(P.APIError) as e:
        parse(**fields)
    assert e.value.status == 400
    return e.value


def test_unknown_fields_at_any_depth_are_ignored_and_named():
    req = _chat(verbosity="low", messages=[{"role": "user", "content": "hi", "cache_control": {}}],
                stream_options={"include_usage": True, "continuous_usage_stats": True},
                speculation={"enabled": False, "future_knob": 1})
    assert P.ignored_fields(req) == ["verbosity", "stream_options.continuous_usage_stats", "speculation.future_knob",
                                     "messages.0.cache_control"]
    assert SpeculationOverrides(**req.speculation.fields()).enabled is False
    assert P.ignored_fields(_chat(max_tokens=3)) == []
    assert "additionalProperties" not in P.ChatCompletionRequest.model_json_schema() or \
        P.ChatCompletionRequest.model_json_schema()["additionalProperties"] is True


@pytest.mark.parametrize("fields,param", [({"max_tokens": True}, "max_tokens"), ({"temperature": "0"}, "temperature"),
                                          ({"n": 0}, "n"), ({"seed": 2**70}, "seed")])
def test_known_fields_keep_strict_types(fields, param):
    assert _refusal(_chat, **fields).param == param


@pytest.mark.parametrize("parse,field,value,needle", [
    (_chat, "logit_bias", {"5": 1.0}, "speculative decoding"), (_chat, "min_p", 0.05, "speculative decoding"),
    (_chat, "functions", [{"name": "f"}], "use tools"), (_chat, "use_beam_search", True, "beam search"),
    (_chat, "chat_template", "{{x}}", "chat template"), (_completion, "best_of", 2, "use n"),
    (_completion, "suffix", "}", "middle"), (_completion, "spaces_between_special_tokens", False, "slow tokenizer")])
def test_known_fields_not_served_are_refused_saying_why(parse, field, value, needle):
    e = _refusal(parse, **{field: value})
    assert e.param == field and field in e.message and needle in e.message


def test_their_no_op_values_pass_and_are_not_reported():
    req = _chat(logit_bias={}, min_p=0, functions=[], function_call="none", use_beam_search=False,
                spaces_between_special_tokens=True)
    assert P.ignored_fields(req) == []
    assert P.ignored_fields(_completion(echo=False, best_of=1, suffix=None)) == []
    assert _refusal(_chat, logit_bias={"5": 0}).param == "logit_bias"  # any bias, even 0: vLLM refuses it


@pytest.mark.parametrize("fields,param", [
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"repetition_penalty": math.inf}, "repetition_penalty"),
    ({"min_tokens": -1}, "min_tokens"), ({"stop_token_ids": [-1]}, "stop_token_ids.0"),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"), ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": 1}, "logprobs"), ({"add_generation_prompt": True, "continue_final_message": True},
                                    "continue_final_message"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"), ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"allowed_token_ids": []}, "allowed_token_ids"), ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ({"truncation_side": "middle"}, "truncation_side"), ({"bad_words": "x"}, "bad_words")])
def test_new_chat_fields_are_validated(fields, param):
    assert _refusal(_chat, **fields).param == param


def test_echo_and_prompt_logprobs_as_vllm_reads_them():
    """vLLM's rules: an echoed prompt gets the logprobs' count of prompt logprobs unless prompt_logprobs is given;
    max_tokens 0 is the prompt alone, with echo only."""
    assert _completion(echo=True, logprobs=2).prompt_logprobs_asked() == 2
    assert _completion(echo=True, logprobs=2, prompt_logprobs=0).prompt_logprobs_asked() == 0
    assert _completion(logprobs=2).prompt_logprobs_asked() is None
    assert _completion(echo=True, max_tokens=0).echo_only() and not _completion(echo=True).echo_only()
    e = _refusal(_completion, max_tokens=0)
    assert e.param == "max_tokens" and "echo" in e.message
    assert _refusal(_chat, max_tokens=0).param == "max_tokens"
    assert _chat(prompt_logprobs=3).prompt_logprobs_asked() == 3 and _chat(echo=True).prompt_logprobs_asked() is None


def test_logprobs_asked_as_vllm_reads_them():
    assert _chat(logprobs=True, top_logprobs=3).logprobs_asked() == 3
    assert _chat(logprobs=True).logprobs_asked() == 0  # the token's own only
    assert _chat(logprobs=False, top_logprobs=0).logprobs_asked() is None
    assert _completion(logprobs=5).logprobs_asked() == 5 and _completion().logprobs_asked() is None
    assert _refusal(_completion, logprobs=True).param == "logprobs"  # an integer there


def test_a_completions_prompt_is_one_or_a_batch_of_texts_or_token_ids():
    """OpenAI's completions take a batch of prompts in `prompt`: texts or token-id lists, never mixed."""
    assert _completion(prompt="hi").prompts() == ["hi"]
    assert _completion(prompt=[5, 6]).prompts() == [[5, 6]]
    assert _completion(prompt=["a", "b"]).prompts() == ["a", "b"]
    assert _completion(prompt=[[5], [6, 7]]).prompts() == [[5], [6, 7]]
    assert _refusal(_completion, prompt=["a", 3]).param.startswith("prompt")
    assert _refusal(_completion, prompt=[[5], "a"]).param.startswith("prompt")
    with pytest.raises(P.APIError, match="empty"):
        _completion(prompt=[]).prompts()


def test_the_ingress_turns_the_fields_into_sampling_params():
    ingress = openai_server("vllm")
    req = _chat(model="cosine-target", max_tokens=8, presence_penalty=0.5, frequency_penalty=-0.5,
                repetition_penalty=1.2, min_tokens=3, stop_token_ids=[7], ignore_eos=True, logprobs=True,
                top_logprobs=2, seed=5)
    p = ingress.preparer.prepare(req, [1, 2, 3])
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_tokens, p.stop_token_ids,
            p.ignore_eos, p.logprobs, p.seed) == (0.5, -0.5, 1.2, 3, [7], True, 2, 5)
    assert p.sampler_only() == ["min_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty",
                                "logprobs"]
    p = ingress.preparer.prepare(_chat(model="cosine-target"), [1, 2, 3])
    assert (p.presence_penalty, p.repetition_penalty, p.logprobs, p.sampler_only()) == (0.0, 1.0, None, [])


@pytest.mark.parametrize("fields,param,needle", [
    ({"min_tokens": 9, "max_tokens": 8}, "min_tokens", "exceeds max_tokens"),
    ({"stop_token_ids": [10**6]}, "stop_token_ids", "vocabulary"),
    ({"allowed_token_ids": [3, 10**6]}, "allowed_token_ids", "vocabulary"),
    ({"n": 2, "temperature": 0}, "n", "temperature > 0"), ({"n": 5}, "n", "queues")])
def test_the_ingress_refuses_what_cannot_be_served(fields, param, needle):
    with pytest.raises(P.APIError) as e:
        openai_server("vllm").preparer.prepare(_chat(model="cosine-target", **fields), [1, 2, 3])
    assert (e.value.status, e.value.param) == (400, param) and needle in e.value.message


@pytest.mark.parametrize("parse,fields,param", [
    (_chat, {"presence_penalty": 0.1}, "presence_penalty"), (_chat, {"min_tokens": 1}, "min_tokens"),
    (_chat, {"logprobs": True}, "logprobs"), (_chat, {"prompt_logprobs": 0}, "prompt_logprobs"),
    (_chat, {"allowed_token_ids": [5]}, "allowed_token_ids"), (_chat, {"bad_words": ["x"]}, "bad_words"),
    (_completion, {"echo": True, "logprobs": 1}, "logprobs"), (_completion, {"echo": True, "prompt_logprobs": 1,
                                                                              "logprobs": None}, "prompt_logprobs")])
def test_behind_the_torch_verifier_what_only_vllm_applies_is_refused(parse, fields, param):
    with pytest.raises(P.APIError) as e:
        openai_server("torch").preparer.prepare(parse(model="cosine-target", **fields), [1, 2, 3])
    assert e.value.param == param and "verifier.engine: torch" in e.value.message
    openai_server("torch").preparer.prepare(_chat(model="cosine-target", stop_token_ids=[5], ignore_eos=True), [1, 2, 3])


def test_the_torch_verifier_refuses_them_itself(target, tokenizer):
    from engines.verifier import TorchVerifierEngine

    engine = TorchVerifierEngine(target, max_batch=1, max_len=64, tokenizer=tokenizer, eos_token_ids=(0, 2))
    with pytest.raises(ValueError, match="repetition_penalty"):
        engine.add_request([1, 2], SamplingParams(repetition_penalty=1.1))
    engine.add_request([1, 2], SamplingParams(stop_token_ids=[5], ignore_eos=True))


def test_sampling_params_check_the_new_fields():
    for bad in ({"min_tokens": 5, "max_tokens": 4}, {"presence_penalty": 2.1}, {"repetition_penalty": 0.0},
                {"logprobs": -1}, {"prompt_logprobs": -1}, {"allowed_token_ids": []}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_min_tokens_holds_back_eos_stop_ids_and_stop_strings(tokenizer):
    params = SamplingParams(max_tokens=10, min_tokens=3, stop_token_ids=[9])
    stop = StopChecker(params, eos_token_ids=(0,))
    assert stop.feed([5, 0, 9, 6, 9, 7]) == [5, 0, 9, 6] and stop.finish_reason == "stop"
    ids = tokenizer("ab ab ab ab", add_special_tokens=False).input_ids
    first = len(tokenizer(" ab", add_special_tokens=False).input_ids)
    assert len(ids) == 1 + 3 * first  # "ab" then three " ab"
    # " ab" as a stop string: its first two matches end within the first min_tokens tokens' text
    params = SamplingParams(max_tokens=20, min_tokens=1 + 2 * first, stop=[" ab"])
    stop = StopChecker(params, tokenizer=tokenizer)
    assert stop.feed(ids) == ids and stop.text == "ab ab ab"
    detok = Detokenizer(tokenizer, [" ab"], params.min_tokens)
    assert detok.push(ids[:2], False) + detok.push(ids[2:], True) == "ab ab ab"
    assert Detokenizer(tokenizer, [" ab"]).push(ids, True) == "ab"  # without min_tokens


def test_token_names_are_vllms(tokenizer):
    from vllm.tokenizers.detokenizer_utils import convert_ids_list_to_tokens

    ids = list(range(0, len(tokenizer), 37))
    names = TokenNames(tokenizer)
    assert [names(t) for t in ids] == convert_ids_list_to_tokens(tokenizer, ids)


def test_logprobs_written_as_vllms_server_writes_them():
    lps = [{7: -0.1, 3: -2.0, 4: -3.0}, {5: -float("inf"), 6: -0.01, 7: -5.0}]  # vLLM's order: the token's own first
    name = {3: "c", 4: "d", 5: "e", 6: "f", 7: "g"}.get
    chat = R.chat_logprobs([7, 5], lps, 2, name)["content"]
    assert chat[0] == {"token": "g", "logprob": -0.1, "bytes": [103], "top_logprobs": [
        {"token": "g", "logprob": -0.1, "bytes": [103]}, {"token": "c", "logprob": -2.0, "bytes": [99]}]}
    assert chat[1]["logprob"] == -9999.0 and [x["token"] for x in chat[1]["top_logprobs"]] == ["e", "f"]
    comp = R.completion_logprobs([7, 5], lps, 1, name, offset=4)
    assert comp == {"tokens": ["g", "e"], "token_logprobs": [-0.1, -9999.0], "text_offset": [4, 5],
                    "top_logprobs": [{"g": -0.1, "c": -2.0}, {"e": -9999.0, "f": -0.01}]}
    whole = TokenChunk([7], False, logprobs=lps[:1], prompt_logprobs=[None, {3: (-1.0, 1)}])
    whole.extend(TokenChunk([5], True, logprobs=lps[1:]))
    assert whole.token_ids == [7, 5] and whole.logprobs == lps and whole.prompt_logprobs == [None, {3: (-1.0, 1)}]
    echoed = R.completion_logprobs([3, 7], [None, lps[0]], 1, name)  # an echoed prompt's first token has none
    assert echoed["token_logprobs"] == [None, -0.1] and echoed["top_logprobs"] == [None, {"g": -0.1, "c": -2.0}]
    assert echoed["text_offset"] == [0, 1]
    assert R.prompt_logprobs([None, {4: (-math.inf, 9), 3: (-0.5, 1)}], name) == [
        None, {"4": {"logprob": -9999.0, "rank": 9, "decoded_token": "d"},
               "3": {"logprob": -0.5, "rank": 1, "decoded_token": "c"}}]


def _shown(req, prompt_ids=(3, 4), echo="cd"):
    name = {3: "c", 4: "d", 5: "e", 7: "g"}.get
    return CompletionChoice(Prompt(list(prompt_ids), SamplingParams(logprobs=req.logprobs), echo), req, name)


PROMPT_LPS = [None, {4: (-1.5, 2), 3: (-0.2, 1)}]


def test_an_echoed_completion_shows_the_prompt_and_its_logprobs_first():
    """vLLM's echo: the prompt's text, then the choice's; logprobs of the prompt's tokens (None for the first) then
    the choice's, text offsets running on across chunks."""
    shown = _shown(_completion(echo=True, logprobs=1))
    first = shown.choice(TokenChunk([7], False, logprobs=[{7: -0.1, 3: -2.0}], prompt_logprobs=PROMPT_LPS), "g",
                         None)
    assert first["text"] == "cdg" and first["finish_reason"] is None
    assert first["logprobs"] == {"tokens": ["c", "d", "g"], "token_logprobs": [None, -1.5, -0.1],
                                 "top_logprobs": [None, {"d": -1.5, "c": -0.2}, {"g": -0.1, "c": -2.0}],
                                 "text_offset": [0, 1, 2]}
    later = shown.choice(TokenChunk([5], True, logprobs=[{5: -0.3}]), "e", "length")
    assert later["text"] == "e" and later["logprobs"]["text_offset"] == [3] and later["finish_reason"] == "length"


def test_echo_with_max_tokens_0_is_the_prompt_alone_and_token_ids_where_asked():
    shown = _shown(_completion(echo=True, max_tokens=0, logprobs=0, return_token_ids=True, prompt_logprobs=1))
    whole = shown.choice(TokenChunk([7], True, logprobs=[{7: -0.1}], prompt_logprobs=PROMPT_LPS), "g", "length",
                         whole=True)
    assert (whole["text"], whole["finish_reason"]) == ("cd", "length")
    assert whole["logprobs"]["tokens"] == ["c", "d"] and whole["logprobs"]["token_logprobs"] == [None, -1.5]
    assert (whole["prompt_token_ids"], whole["token_ids"]) == ([3, 4], [7])  # the one token vLLM generates too
    assert whole["prompt_logprobs"][1]["4"] == {"logprob": -1.5, "rank": 2, "decoded_token": "d"}
    plain = _shown(_completion(return_token_ids=True), echo="")
    assert plain.choice(TokenChunk([7], False), "g", None) == {"text": "g", "logprobs": None, "finish_reason": None,
                                                               "prompt_token_ids": [3, 4], "token_ids": [7]}
    assert "prompt_token_ids" not in plain.choice(TokenChunk([5], True), "e", "stop")


def test_prompts_truncated_as_vllm_truncates_them():
    ingress = openai_server("vllm")
    ids = list(range(10, 20))
    assert ingress.preparer.truncated(_completion(), ids) == ids
    assert ingress.preparer.truncated(_completion(truncate_prompt_tokens=3), ids) == [17, 18, 19]
    assert ingress.preparer.truncated(_completion(truncate_prompt_tokens=3, truncation_side="right"), ids) == [10, 11, 12]
    assert ingress.preparer.truncated(_completion(truncate_prompt_tokens=-1), list(range(100))) == list(range(36, 100))
    with pytest.raises(P.APIError):
        ingress.preparer.truncated(_completion(truncate_prompt_tokens=0), ids)


def test_the_detokenizer_keeps_the_stop_string_and_special_tokens_where_asked(tokenizer):
    ids = tokenizer("ab cd ef", add_special_tokens=False).input_ids
    assert Detokenizer(tokenizer, [" cd"]).push(ids, True) == "ab"
    assert Detokenizer(tokenizer, [" cd"], keep_stop=True).push(ids, True) == "ab cd"
    eos = tokenizer.eos_token_id
    assert Detokenizer(tokenizer, []).push(ids + [eos], True) == "ab cd ef"
    assert Detokenizer(tokenizer, [], skip_special=False).push(ids + [eos], True) == \
        "ab cd ef" + tokenizer.eos_token


def test_the_ingress_passes_allowed_token_ids_bad_words_and_prompt_logprobs():
    p = openai_server("vllm").preparer.prepare(_completion(model="cosine-target", allowed_token_ids=[5, 6], bad_words=["x y"],
                                              echo=True, logprobs=2), [1, 2, 3])
    assert (p.allowed_token_ids, p.bad_words, p.prompt_logprobs, p.logprobs) == ([5, 6], ["x y"], 2, 2)
    assert p.sampler_only() == ["logprobs", "prompt_logprobs", "allowed_token_ids", "bad_words"]
    p = openai_server("vllm").preparer.prepare(_completion(model="cosine-target", echo=True, max_tokens=0), [1, 2, 3])
    assert p.max_tokens == 1  # vLLM generates one token and shows the prompt alone


def test_speculation_usage_over_choices():
    one = {"num_drafts": 2, "num_draft_tokens": 8, "num_accepted_tokens": 6, "verify_steps": 5,
           "drafters_used": ["legal"]}
    two = {"num_drafts": 2, "num_draft_tokens": 8, "num_accepted_tokens": 2, "verify_steps": 7,
           "drafters_used": ["code", "legal"]}
    assert R.spec_usage([one]) == {"mean_acceptance_length": 4.0, "draft_acceptance_rate": 0.75, **one}
    assert R.spec_usage([one, two, None]) == {"mean_acceptance_length": 3.0, "draft_acceptance_rate": 0.5,
                                              "num_draft_tokens": 16, "num_accepted_tokens": 8, "num_drafts": 4,
                                              "verify_steps": 12, "drafters_used": ["code", "legal"]}


CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_tool_messages_reach_the_chat_template():
    req = _chat(messages=[{"role": "user", "content": "weather?"}, {"role": "assistant", "tool_calls": [CALL]},
                          {"role": "tool", "tool_call_id": "c1", "content": "sunny"}], tools=[TOOL])
    assert [m.template_dict() for m in req.messages][1:] == [
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]
    assert P.ignored_fields(req) == []
    assert _refusal(_chat, messages=[{"role": "assistant"}]).param == "messages"


@pytest.fixture(scope="module")
def vllm_ingress():
    # granite's reasoning markers are text: the shipped tokenizer has no <think> tokens, which qwen3's and
    # deepseek_r1's parsers look for (qwen3's takes a reply without them as reasoning, as Qwen3 thinks by default)
    return openai_server("vllm", tool_call_parser="hermes", reasoning_parser="granite")


def _constraint(ingress, parse=_chat, **fields):
    req = parse(model="cosine-target", **fields)
    return ingress.preparer.prepare(req, [1, 2, 3], ingress.preparer.constraints(req, chat=parse is _chat)).structured_outputs


def test_structured_outputs_as_vllm_reads_them(vllm_ingress):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    so = _constraint(vllm_ingress, response_format={"type": "json_schema", "json_schema": {"name": "x",
                                                                                           "schema": schema}})
    assert so["json"] == schema and so["regex"] is None
    assert _constraint(vllm_ingress, _completion, response_format={"type": "json_object"})["json_object"] is True
    assert _constraint(vllm_ingress, structured_outputs={"choice": ["yes", "no"]})["choice"] == ["yes", "no"]
    assert _constraint(vllm_ingress, response_format={"type": "text"}) is None
    assert _constraint(vllm_ingress) is None


def test_a_named_or_required_tool_choice_forces_the_tools_schema(vllm_ingress):
    so = _constraint(vllm_ingress, tools=[TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert so["json"] == TOOL["function"]["parameters"]
    so = _constraint(vllm_ingress, tools=[TOOL], tool_choice="required", parallel_tool_calls=False)
    assert so["json"]["type"] == "array" and so["json"]["maxItems"] == 1
    assert _constraint(vllm_ingress, tools=[TOOL], tool_choice="auto") is None  # the parser's, unconstrained
    assert _constraint(vllm_ingress, tools=[TOOL], tool_choice="none") is None


@pytest.mark.parametrize("fields,param", [
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"structured_outputs": {"choice": ["a"], "regex": "a"}}, "structured_outputs"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice")])
def test_constraints_vllm_refuses_are_400(vllm_ingress, fields, param):
    with pytest.raises(P.APIError) as e:
        _constraint(vllm_ingress, **fields)
    assert (e.value.status, e.value.param) == (400, param)


def test_auto_tool_choice_needs_a_parser():
    with pytest.raises(P.APIError) as e:
        _constraint(openai_server("vllm"), tools=[TOOL], tool_choice="auto")
    assert e.value.param == "tool_choice" and "ingress.tool_call_parser" in e.value.message


def test_behind_the_torch_verifier_structured_output_is_refused():
    with pytest.raises(P.APIError) as e:
        _constraint(openai_server("torch"), response_format={"type": "json_object"})
    assert e.value.param == "response_format" and "verifier.engine: torch" in e.value.message


@pytest.mark.parametrize("field", ["tool_call_parser", "reasoning_parser"])
def test_unknown_parsers_are_refused_at_startup(field):
    with pytest.raises(ValueError, match=f"ingress.{field}"):
        openai_server("vllm", **{field: "no-such-parser"})


def _stream(reply, tokenizer, text: str) -> list[dict]:
    """The reply's deltas with the text fed a token at a time, as the verifier commits it."""
    ids = tokenizer(text, add_special_tokens=False).input_ids
    return [reply.delta(tokenizer.decode(ids[:i + 1])[len(tokenizer.decode(ids[:i])):], [t], i == len(ids) - 1)
            for i, t in enumerate(ids)]


def _streamed_calls(deltas: list[dict]) -> tuple[list[dict], int]:
    """The tool calls the deltas add up to (OpenAI's rule: id, type and name once, arguments appended by index), and
    how many deltas carried a piece of them."""
    calls: dict[int, dict] = {}
    pieces = 0
    for d in deltas:
        for c in d.get("tool_calls", []):
            pieces += 1
            call = calls.setdefault(c["index"], {"name": "", "arguments": ""})
            if "id" in c:
                call["id"] = c["id"]
            fn = c.get("function", {})
            call["name"] += fn.get("name") or ""
            call["arguments"] += fn.get("arguments") or ""
    return [calls[i] for i in sorted(calls)], pieces


def test_replies_split_by_vllms_parsers(vllm_ingress, tokenizer):
    api = vllm_ingress.vllm_api
    auto = api.request({"tools": [TOOL], "tool_choice": "auto"}, chat=True)
    text = 'Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    ids = tokenizer(text, add_special_tokens=False).input_ids
    reply = ChatReply(api, auto, [1, 2])
    msg = reply.whole(text, ids)
    assert [c["function"] for c in msg["tool_calls"]] == [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    assert (msg["content"] or "").strip() in ("", "Let me look.") and reply.finish_reason("stop") == "tool_calls"
    plain = ChatReply(api, auto, [1, 2])
    assert plain.whole("no call here", [])["content"] == "no call here" and plain.finish_reason("stop") == "stop"

    # streamed: the call's name, then its arguments as they are generated, not the whole call in the last chunk
    streamed = ChatReply(api, auto, [1, 2])
    deltas = _stream(streamed, tokenizer, text)
    calls, pieces = _streamed_calls(deltas)
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert calls[0]["id"] and pieces >= 3 and not deltas[-1].get("tool_calls", [{}])[0].get("function", {}).get("name")
    assert "".join(d.get("content", "") for d in deltas).strip() == "Let me look."
    assert streamed.finish_reason("stop") == "tool_calls"

    named = api.request({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
                        chat=True)
    reply = ChatReply(api, named, [1, 2])
    msg = reply.whole('{"city": "Rome"}', [])
    assert msg["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}
    assert reply.finish_reason("stop") == "stop"  # OpenAI's (and vLLM's) for a named tool
    calls, pieces = _streamed_calls(_stream(ChatReply(api, named, [1, 2]), tokenizer, '{"city": "Rome"}'))
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", '{"city": "Rome"}')] and pieces > 1

    required = api.request({"tools": [TOOL], "tool_choice": "required"}, chat=True)
    reply = ChatReply(api, required, [1, 2])
    text = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    msg = reply.whole(text, [])
    assert msg["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert reply.finish_reason("stop") == "tool_calls"
    streamed = ChatReply(api, required, [1, 2])
    calls, pieces = _streamed_calls(_stream(streamed, tokenizer, text))
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", {"city": "Oslo"})]
    assert pieces > 1 and streamed.finish_reason("stop") == "tool_calls"


def test_reasoning_split_whole_and_streamed(vllm_ingress, tokenizer):
    api = vllm_ingress.vllm_api
    vreq = api.request({}, chat=True)
    text = "Here is my thought process: the user greets. Here is my response: Hello there"
    msg = ChatReply(api, vreq, [1, 2]).whole(text, [])
    assert (msg["reasoning_content"].strip(), msg["content"].strip()) == ("the user greets.", "Hello there")
    assert msg["reasoning"] == msg["reasoning_content"]
    deltas = _stream(ChatReply(api, vreq, [1, 2]), tokenizer, text)
    reasoning, content = ("".join(d.get(k, "") for d in deltas) for k in ("reasoning_content", "content"))
    assert (reasoning.strip(), content.strip()) == ("the user greets.", "Hello there")
    assert ChatReply(api, vreq, [1, 2]).whole("just text", [])["content"] == "just text"
    # include_reasoning: false (vLLM's): the reasoning is left out, whole and streamed
    hidden = api.request({"include_reasoning": False}, chat=True)
    msg = ChatReply(api, hidden, [1, 2]).whole(text, [])
    assert "reasoning_content" not in msg and msg["content"].strip() == "Hello there"
    deltas = _stream(ChatReply(api, hidden, [1, 2]), tokenizer, text)
    assert not any("reasoning_content" in d for d in deltas)
    assert "".join(d.get("content", "") for d in deltas).strip() == "Hello there"


def test_chat_template_kwargs_reach_the_template_and_may_not_set_the_requests_own_fields():
    """vLLM's chat_template_kwargs: variables of the model's chat template (a thinking switch, say); the ones the
    request's own fields set are refused, and a template that raises on a value is the client's 400."""
    ingress = openai_server("vllm")
    ingress.tokenizer.chat_template = ("{% if enable_thinking %}<think>{% endif %}{% for m in messages %}"
                                       "{{ m['content'] }}{% endfor %}{% if strict %}{{ raise_exception('no') }}"
                                       "{% endif %}")
    msgs = [{"role": "user", "content": "hi"}]
    plain = ingress.preparer.chat_ids(msgs)
    thinking = ingress.preparer.chat_ids(msgs, template_kwargs=_chat(chat_template_kwargs={"enable_thinking": True})
                                 .chat_template_kwargs)
    assert thinking != plain and ingress.tokenizer.decode(thinking).startswith("<think>")
    for taken in ("add_generation_prompt", "tools", "messages"):
        assert _refusal(_chat, chat_template_kwargs={taken: True}).param == "chat_template_kwargs"
    with pytest.raises(P.APIError) as e:
        ingress.preparer.chat_ids(msgs, template_kwargs={"strict": True})
    assert e.value.status == 400 and "no" in e.value.message
