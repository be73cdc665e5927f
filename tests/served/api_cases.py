"""The request cases of tests/served/test_api_fields.py and vLLM target-only's answers to them (tests/helpers/
vllm_greedy.py, one run for every case). The package's conftest runs that reference before the served graph starts:
beside the graph's idle replicas on a 2-core machine the same run took about three times as long."""

from __future__ import annotations

from pathlib import Path

import torch

from model_family.distill import greedy_continue
from tests.helpers import vllm_greedy

# vLLM's structured-output engine option, the server's and the reference run's: JSON without free whitespace (a tiny
# model given the choice writes whitespace until max_tokens)
STRUCTURED_CONFIG = {"backend": "xgrammar", "disable_any_whitespace": True}

EOS = {0, 2}  # the shipped target's generation_config
CASE_SCHEMA = {"type": "object", "properties": {
    "party": {"type": "string", "maxLength": 10}, "binding": {"type": "boolean"},
    "kind": {"enum": ["contract", "tort", "crime"]}}, "required": ["party", "binding", "kind"],
    "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 10}}, "required": ["city"],
                                                "additionalProperties": False}}}
CASE_PROMPT = "Describe the case as JSON."
WEATHER_PROMPT = "What is the weather in Paris?"
# a hermes tool call (vLLM's hermes parser), and granite's reasoning markers: forced, so that a tiny model writes them
HERMES_CALL = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,8}"\}\}</tool_call>'
GRANITE = "Here is my thought process:[a-z ]{4,24}[.] Here is my response:[a-z ]{4,24}[.]"


def chat_ids(tokenizer, content: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False).input_ids


def build_cases(tokenizer, heldout, target) -> dict:
    """name -> (prompt ids, max_tokens, vLLM SamplingParams beyond greedy with ignore_eos)."""
    legal = tokenizer(heldout["legal"][11][:300], add_special_tokens=False).input_ids
    legal2 = tokenizer(heldout["legal"][12], add_special_tokens=False).input_ids[:48]
    hello, hi = chat_ids(tokenizer, "Hello"), chat_ids(tokenizer, "Hi!")
    out = greedy_continue(target, torch.tensor([hello]), 12)[0, len(hello):].tolist()
    stop_id = next(t for i, t in enumerate(out) if i >= 3 and t not in out[:i] and t not in EOS)
    # a word the plain greedy continuation writes, for bad_words; and a vocabulary of the prompt's own tokens
    plain = tokenizer.decode(greedy_continue(target, torch.tensor([legal2]), 32)[0, len(legal2):])
    bad = next(w for w in plain.split() if w.isalpha() and len(w) >= 3)
    return {
        "echo": (legal2, 16, {"logprobs": 2, "prompt_logprobs": 2}),
        "allowed": (legal2, 24, {"allowed_token_ids": sorted(set(legal2))}),
        "bad_words": (legal2, 32, {"bad_words": [bad]}),
        "logprobs": (legal, 24, {"logprobs": 5}),
        "chat_logprobs": (chat_ids(tokenizer, "Tell me about the law."), 16, {"logprobs": 3}),
        "plain": (legal2, 32, {}),
        "presence_frequency": (legal2, 32, {"presence_penalty": 1.0, "frequency_penalty": 0.5}),
        "repetition": (legal2, 32, {"repetition_penalty": 1.3}),
        "eos": (hi, 24, {"ignore_eos": False}),
        "eos_ignored": (hi, 24, {}),
        "min_tokens": (hi, 24, {"ignore_eos": False, "min_tokens": 12}),
        "stop_token_ids": (hello, 24, {"ignore_eos": False, "stop_token_ids": [stop_id]}),
        "stop_token_ids_min_tokens": (hello, 24, {"ignore_eos": False, "stop_token_ids": [stop_id], "min_tokens": 8}),
        "context_end": (hi, 512 - len(hi), {}),
        "json_schema": (chat_ids(tokenizer, CASE_PROMPT), 64, {"ignore_eos": False,
                                                                "structured_outputs": {"json": CASE_SCHEMA}}),
        "json_object": (legal2, 48, {"ignore_eos": False, "structured_outputs": {"json_object": True}}),
        "regex": (legal2, 32, {"structured_outputs": {"regex": "[^0-9]{1,400}"}}),
        "named_tool": (chat_ids(tokenizer, WEATHER_PROMPT), 48, {
            "ignore_eos": False, "structured_outputs": {"json": WEATHER["function"]["parameters"]}}),
        # the grammar lets the model spell the markers in any tokens: room for one character a token
        "hermes": (chat_ids(tokenizer, WEATHER_PROMPT), 160, {"ignore_eos": False,
                                                               "structured_outputs": {"regex": HERMES_CALL}}),
        "granite": (chat_ids(tokenizer, "Hi!"), 160, {"ignore_eos": False, "structured_outputs": {"regex": GRANITE}}),
    }


def vllm_reference(models: Path, cases: dict) -> dict:
    """vLLM target-only's tokens (and logprobs) of every case, cut before the token that stopped it: this server
    does not emit the stop token (EOS or a stop id)."""
    names = list(cases)
    req = {"model": str(models / "target"), "prompts": [cases[n][0] for n in names], "max_tokens": 32,
           "params": [{"max_tokens": cases[n][1], **cases[n][2]} for n in names],
           "structured_outputs_config": STRUCTURED_CONFIG}
    result = vllm_greedy.run(req)
    out = {}
    for i, n in enumerate(names):
        ids, params = result["outputs"][i], cases[n][2]
        stops = set(params.get("stop_token_ids", [])) | (set() if params.get("ignore_eos", True) else EOS)
        cut = next((j for j, t in enumerate(ids) if t in stops and j >= params.get("min_tokens", 0)), len(ids))
        logprobs = result.get("logprobs", [None] * len(names))[i]
        out[n] = (ids[:cut], logprobs[:cut] if logprobs else None, "stop" if cut < len(ids) else "length")
    out["prompt_logprobs"] = result["prompt_logprobs"][names.index("echo")]
    return out
