"""The OpenAI / vLLM request fields beyond the basics, through the served graph with speculation on (tests/served/
conftest.py's graph: the shipped target verified in vLLM, three domain drafters and the generalist), each against vLLM
target-only with the same request (tests/served/api_cases.py: the cases, and their reference run before the graph
starts): logprobs, penalties, min_tokens, stop_token_ids, ignore_eos, structured output (response_format,
structured_outputs) and tool_choice named / required, whose output is vLLM's constrained decoding; tool calls parsed by
vLLM's hermes parser and reasoning by its granite parser (their markers forced by a regex constraint, so a tiny model
writes them); and n, unknown fields, refused fields, /tokenize, /detokenize, /version. docs/api.md has the field
table."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
import torch

from model_family.distill import greedy_continue
from tests.served.api_cases import CASE_PROMPT, CASE_SCHEMA, GRANITE, HERMES_CALL, WEATHER, WEATHER_PROMPT
from tests.served.conftest import MODEL

pytestmark = pytest.mark.slow

TOL = 2e-3  # logprobs: vLLM verifying drafts against vLLM decoding one token at a time, both fp32


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server}/v1", api_key="unused", timeout=180)


def _served(client, cases, name: str, **extra):
    """The case as a completion of its prompt ids through the served graph, the case's vLLM parameters sent as the
    OpenAI fields (the SDK's own where it has them)."""
    ids, max_tokens, params = cases[name]
    params = dict(params)
    sdk = {k: params.pop(k) for k in ("presence_penalty", "frequency_penalty", "logprobs") if k in params}
    body = {"ignore_eos": params.pop("ignore_eos", True), **params, **extra.pop("extra_body", {})}
    return client.completions.create(model=MODEL, prompt=ids, max_tokens=max_tokens, temperature=0, **sdk, **extra,
                                     extra_body=body)


def _ids(tokens: list[str]) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in tokens]


def test_logprobs_are_vllm_target_only_ones_with_speculation(client, cases, reference):
    """Tokens, each token's logprob and the top 5 (and the token's own) of each position: vLLM's own, with most of
    them committed from accepted drafts."""
    r = _served(client, cases, "logprobs", extra_body={"return_tokens_as_token_ids": True,
                                                       "speculation": {"drafters": ["legal"]}})
    want_ids, want_lps, _ = reference["logprobs"]
    lp = r.choices[0].logprobs
    assert _ids(lp.tokens) == want_ids
    assert r.usage.model_extra["num_accepted_tokens"] > 0  # drafts were accepted: several tokens a step
    for t, got, top, want in zip(want_ids, lp.token_logprobs, lp.top_logprobs, want_lps):
        want = dict(want)
        assert got == pytest.approx(want[t], abs=TOL)
        assert len(top) == len(want) and {int(k.removeprefix("token_id:")) for k in top} == set(want)
        assert all(v == pytest.approx(want[int(k.removeprefix("token_id:"))], abs=TOL) for k, v in top.items())
    assert lp.text_offset == [sum(len(x) for x in lp.tokens[:i]) for i in range(len(lp.tokens))]


def test_chat_logprobs_and_top_logprobs_with_the_sdk(client, tokenizer, cases, reference):
    want_ids, want_lps, _ = reference["chat_logprobs"]
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Tell me about the law."}],
                                       max_tokens=16, temperature=0, logprobs=True, top_logprobs=3,
                                       extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert [c.token for c in content] == [tokenizer.decode([t]) for t in want_ids]
    assert r.choices[0].message.content == tokenizer.decode(want_ids, skip_special_tokens=True)
    for c, t, want in zip(content, want_ids, want_lps):
        assert c.logprob == pytest.approx(dict(want)[t], abs=TOL)
        assert c.bytes == list(c.token.encode())
        # vLLM's first three entries: the token's own, then the most likely ones
        assert [x.token for x in c.top_logprobs] == [tokenizer.decode([u]) for u, _ in want[:3]]
        assert [x.logprob for x in c.top_logprobs] == pytest.approx([x for _, x in want[:3]], abs=TOL)


def _close(got: dict, want: list) -> bool:
    return set(got) == {t for t, _ in want} and all(got[t] == pytest.approx(x, abs=TOL) for t, x in want)


def test_an_echoed_prompt_and_its_logprobs_are_vllm_target_only_ones(client, server, tokenizer, cases, reference):
    """echo: the prompt's text and tokens before the choice's, each prompt token's logprob and top 2 (vLLM's
    prompt_logprobs) from the target's prefill, the first None; the same as vLLM's `prompt_logprobs` field; with
    max_tokens 0 the prompt alone (lm-eval's loglikelihood reads it so); streamed, the prompt comes first."""
    prompt, _, _ = cases["echo"]
    want_ids, want_lps, _ = reference["echo"]
    want_prompt = reference["prompt_logprobs"]
    assert want_prompt[0] is None and len(want_prompt) == len(prompt)
    r = _served(client, cases, "echo", echo=True, extra_body={"return_tokens_as_token_ids": True,
                                                              "speculation": {"drafters": ["legal"]}})
    choice, lp = r.choices[0], r.choices[0].logprobs
    assert choice.text == tokenizer.decode(prompt) + tokenizer.decode(want_ids, skip_special_tokens=True)
    assert _ids(lp.tokens) == prompt + want_ids and r.usage.model_extra["num_accepted_tokens"] > 0
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i, (t, want) in enumerate(zip(prompt + want_ids, want_prompt + want_lps)):
        if want is not None:
            assert lp.token_logprobs[i] == pytest.approx(dict(want)[t], abs=TOL)
            assert _close({int(k.removeprefix("token_id:")): v for k, v in lp.top_logprobs[i].items()}, want)
    field = choice.model_extra["prompt_logprobs"]
    assert field[0] is None and all(_close({int(k): v["logprob"] for k, v in got.items()}, want)
                                    for got, want in zip(field[1:], want_prompt[1:]))
    only = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0)
    assert only.choices[0].text == tokenizer.decode(prompt) and len(only.choices[0].logprobs.tokens) == len(prompt)
    assert only.choices[0].logprobs.token_logprobs[1:] == pytest.approx(
        [dict(w)[t] for t, w in zip(prompt[1:], want_prompt[1:])], abs=TOL)
    chunks = _stream(server, "/v1/completions", {"prompt": prompt, "max_tokens": 16, "temperature": 0, "echo": True,
                                                 "ignore_eos": True})
    assert chunks[0]["text"].startswith(tokenizer.decode(prompt)) and "".join(c["text"] for c in chunks) == \
        choice.text


@pytest.mark.parametrize("name", ["allowed", "bad_words"])
def test_allowed_token_ids_and_bad_words_equal_vllm_target_only(client, tokenizer, cases, reference, name):
    """vLLM's sampler masks the target's distribution at every position, drafts' included: the output is vLLM
    target-only's with the same field, and differs from the plain one."""
    want, _, _ = reference[name]
    r = _served(client, cases, name)
    assert r.choices[0].text == tokenizer.decode(want, skip_special_tokens=True)
    plain = _served(client, cases, name, extra_body={"allowed_token_ids": None, "bad_words": None}).choices[0].text
    field = cases[name][2]
    if name == "allowed":
        assert set(want) <= set(field["allowed_token_ids"]) and r.choices[0].text != plain
    else:
        assert field["bad_words"][0] in plain.split() and field["bad_words"][0] not in r.choices[0].text.split()


def test_chat_echo_continues_the_last_assistant_message(client, server):
    """vLLM's chat echo: where the last message is the assistant's, the reply is prefixed with it."""
    messages = [{"role": "user", "content": "Tell me about the law."}, {"role": "assistant", "content": "The court"}]
    kw = {"model": MODEL, "messages": messages, "max_tokens": 12, "temperature": 0}
    cont = {"add_generation_prompt": False, "continue_final_message": True, "ignore_eos": True}
    plain = client.chat.completions.create(**kw, extra_body=cont).choices[0].message.content
    echoed = client.chat.completions.create(**kw, extra_body={**cont, "echo": True}).choices[0].message.content
    assert echoed == "The court" + plain
    streamed = _stream(server, "/v1/chat/completions", {**kw, **cont, "echo": True})
    assert "".join(c["delta"].get("content") or "" for c in streamed) == echoed
    user_last = client.chat.completions.create(model=MODEL, messages=messages[:1], max_tokens=4, temperature=0,
                                               extra_body={"echo": True})  # a user's message is not echoed
    assert not user_last.choices[0].message.content.startswith("Tell me")


def test_token_ids_truncation_and_stop_strings_kept(client, server, tokenizer, cases, reference):
    """vLLM's return_token_ids (whole and streamed), truncate_prompt_tokens (the prompt's last tokens kept, the
    output that of the kept ones) and include_stop_str_in_output."""
    prompt, _, _ = cases["plain"]
    want, _, _ = reference["plain"]
    r = _served(client, cases, "plain", extra_body={"return_token_ids": True})
    assert (r.choices[0].model_extra["prompt_token_ids"], r.choices[0].model_extra["token_ids"]) == (prompt, want)
    chunks = _stream(server, "/v1/completions", {"prompt": prompt, "max_tokens": 32, "temperature": 0,
                                                 "ignore_eos": True, "return_token_ids": True})
    assert chunks[0]["prompt_token_ids"] == prompt and [t for c in chunks for t in c["token_ids"]] == want
    text = tokenizer.decode(prompt)
    cut = client.completions.create(model=MODEL, prompt=text, max_tokens=8, temperature=0,
                                    extra_body={"truncate_prompt_tokens": 20, "return_token_ids": True,
                                                "ignore_eos": True})
    kept = tokenizer(text, add_special_tokens=False).input_ids[-20:]
    assert cut.choices[0].model_extra["prompt_token_ids"] == kept and cut.usage.prompt_tokens == 20
    assert cut.choices[0].text == client.completions.create(
        model=MODEL, prompt=kept, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}).choices[0].text
    full = tokenizer.decode(want, skip_special_tokens=True)
    stop = full[len(full) // 2:len(full) // 2 + 3]
    for keep in (False, True):
        got = _served(client, cases, "plain", stop=[stop], extra_body={"include_stop_str_in_output": keep})
        assert got.choices[0].text == full[:full.index(stop) + (len(stop) if keep else 0)]


def test_streamed_logprobs_are_the_whole_ones(server, cases, reference):
    ids, max_tokens, _ = cases["logprobs"]
    body = {"model": MODEL, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "logprobs": 2, "return_tokens_as_token_ids": True, "stream": True}
    tokens, token_lps, offsets, text = [], [], [], ""
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=180) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                text += choice["text"]
                if choice["logprobs"]:
                    tokens += choice["logprobs"]["tokens"]
                    token_lps += choice["logprobs"]["token_logprobs"]
                    offsets += choice["logprobs"]["text_offset"]
                    assert all(len(top) <= 3 for top in choice["logprobs"]["top_logprobs"])
    want_ids, want_lps, _ = reference["logprobs"]
    assert _ids(tokens) == want_ids
    assert token_lps == pytest.approx([dict(w)[t] for t, w in zip(want_ids, want_lps)], abs=TOL)
    assert offsets == [sum(len(x) for x in tokens[:i]) for i in range(len(tokens))]


@pytest.mark.parametrize("name", ["presence_frequency", "repetition"])
def test_penalties_equal_vllm_target_only(client, tokenizer, cases, reference, name):
    want, _, _ = reference[name]
    assert want != reference["plain"][0]  # the penalty changes the output
    r = _served(client, cases, name)
    assert r.choices[0].text == tokenizer.decode(want, skip_special_tokens=True)
    assert r.usage.completion_tokens == len(want) and r.usage.model_extra["num_drafts"] > 0


@pytest.mark.parametrize("name", ["eos", "eos_ignored", "min_tokens", "stop_token_ids", "stop_token_ids_min_tokens"])
def test_min_tokens_stop_token_ids_and_ignore_eos_equal_vllm_target_only(client, tokenizer, cases, reference, name):
    want, _, reason = reference[name]
    r = _served(client, cases, name)
    assert r.choices[0].text == tokenizer.decode(want, skip_special_tokens=True)
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (len(want), reason)


def test_what_the_stop_cases_show(reference):
    """The cases (api_cases.py) test what they mean to: EOS ends 'Hi!' early, min_tokens holds it back, the stop id ends
    'Hello' early and min_tokens holds it back too."""
    assert len(reference["eos"][0]) < 12 and reference["eos"][2] == "stop"
    assert len(reference["eos_ignored"][0]) == 24
    assert len(reference["min_tokens"][0]) >= 12 and reference["min_tokens"][0] != reference["eos_ignored"][0]
    assert len(reference["stop_token_ids"][0]) < 8
    assert len(reference["stop_token_ids_min_tokens"][0]) >= 8


def test_chat_min_tokens_with_the_sdk(client, tokenizer, reference):
    want, _, _ = reference["min_tokens"]
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi!"}], max_tokens=24,
                                       temperature=0, extra_body={"min_tokens": 12})
    assert r.choices[0].message.content == tokenizer.decode(want, skip_special_tokens=True)


def test_a_request_runs_to_the_context_end(client, tokenizer, cases, reference):
    """No max_tokens: up to the context. Near its end vLLM gives every request k zeros as a draft (its own proposer
    would not fit); the verifier replaces them with ours, or none (they failed these requests before)."""
    want, _, _ = reference["context_end"]
    r = client.completions.create(model=MODEL, prompt=cases["context_end"][0], temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == tokenizer.decode(want, skip_special_tokens=True)
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (len(want), "length")


def test_n_choices_each_seeded_as_vllm_seeds_them(client):
    """n sampled choices; choice i is the request seeded seed + i (vLLM's rule), checked with speculation off,
    where one seed fixes a request's sampling."""
    kw = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 12,
          "temperature": 1.0}
    off = {"speculation": {"enabled": False}}
    r = client.chat.completions.create(n=3, seed=11, extra_body=off, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    singles = [client.chat.completions.create(seed=11 + i, extra_body=off, **kw).choices[0].message.content
               for i in range(3)]
    assert [c.message.content for c in r.choices] == singles
    assert len(set(singles)) > 1


def test_n_with_speculation_streamed_and_whole(client, server):
    body = {"model": MODEL, "prompt": "The court held that the contract", "max_tokens": 16, "temperature": 0.7,
            "n": 2, "seed": 3, "ignore_eos": True, "speculation": {"drafters": ["legal"]}}
    whole = httpx.post(f"{server}/v1/completions", json=body, timeout=180).json()
    assert [c["index"] for c in whole["choices"]] == [0, 1]
    assert whole["usage"]["completion_tokens"] == 32 and whole["usage"]["num_drafts"] > 0
    texts, reasons, usage = {0: "", 1: ""}, {}, None
    stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server}/v1/completions", json=stream, timeout=180) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                for c in chunk["choices"]:
                    texts[c["index"]] += c["text"]
                    reasons[c["index"]] = c["finish_reason"] or reasons.get(c["index"])
    assert reasons == {0: "length", 1: "length"} and all(texts.values())
    assert usage["completion_tokens"] == 32


def test_a_batch_of_prompts_gives_one_choice_per_prompt_and_n(server, client, cases, reference, tokenizer, target):
    """`prompt` as a batch, as OpenAI's completions take it (lm-eval's default sends token-id lists so): choice
    i * n + j is prompt i's j-th; greedy, each is vLLM target-only's continuation of its own prompt, whole and
    streamed, with speculation on; usage counts each prompt once. A batch of texts too, through the SDK."""
    names = ("plain", "eos_ignored")
    body = {"model": MODEL, "prompt": [cases[n][0] for n in names], "max_tokens": 24, "temperature": 0,
            "ignore_eos": True}
    want = [tokenizer.decode(reference[n][0][:24], skip_special_tokens=True) for n in names]
    whole = httpx.post(f"{server}/v1/completions", json=body, timeout=180).json()
    assert [c["index"] for c in whole["choices"]] == [0, 1]
    assert [c["text"] for c in whole["choices"]] == want
    assert whole["usage"]["prompt_tokens"] == sum(len(cases[n][0]) for n in names)
    assert whole["usage"]["completion_tokens"] == 48 and whole["usage"]["num_drafts"] > 0
    texts = {0: "", 1: ""}
    with httpx.stream("POST", f"{server}/v1/completions", json={**body, "stream": True}, timeout=180) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for c in json.loads(line[6:])["choices"]:
                    texts[c["index"]] += c["text"]
    assert [texts[0], texts[1]] == want
    prompts = ["The court held that the contract", "The patient presented with"]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=12, temperature=0.8, n=2, seed=5,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3] and all(c.text for c in r.choices)
    greedy = client.completions.create(model=MODEL, prompt=prompts, max_tokens=12, temperature=0,
                                       extra_body={"ignore_eos": True})
    for text, c in zip(prompts, greedy.choices):
        ids = tokenizer(text, add_special_tokens=False).input_ids
        assert c.text == tokenizer.decode(greedy_continue(target, torch.tensor([ids]), 12)[0, len(ids):].tolist(),
                                          skip_special_tokens=True)


@pytest.mark.parametrize("body,needle", [({"prompt": ["a", "b", "c", "d"], "n": 2, "temperature": 1}, "queues"),
                                         ({"prompt": ["a", 3]}, "prompt"), ({"prompt": [[]]}, "empty")])
def test_a_batch_the_server_cannot_serve_is_a_400(server, body, needle):
    r = httpx.post(f"{server}/v1/completions", timeout=60, json={"model": MODEL, "max_tokens": 4, **body})
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("body,needle", [({"n": 2, "temperature": 0}, "temperature > 0"),
                                         ({"n": 9, "temperature": 1}, "queues")])
def test_n_refused_where_it_cannot_be_served(server, body, needle):
    r = httpx.post(f"{server}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], **body})
    assert r.status_code == 400 and needle in r.json()["error"]["message"] and r.json()["error"]["param"] == "n"


def test_unknown_fields_are_ignored_with_a_header(client, server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi", "cache_control": {"type": "x"}}],
            "max_tokens": 4, "temperature": 0, "verbosity": "low", "stream_options": None,
            "speculation": {"enabled": True, "future_knob": 1}}
    r = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200
    assert r.headers["x-cosine-ignored-fields"] == "verbosity,speculation.future_knob,messages.0.cache_control"
    with httpx.stream("POST", f"{server}/v1/chat/completions", json={**body, "stream": True}, timeout=120) as s:
        assert s.status_code == 200 and "verbosity" in s.headers["x-cosine-ignored-fields"]
        assert s.read().decode().rstrip().endswith("data: [DONE]")
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, extra_body={"newer_field": True})
    assert raw.headers["x-cosine-ignored-fields"] == "newer_field"
    plain = httpx.post(f"{server}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, timeout=60)
    assert "x-cosine-ignored-fields" not in plain.headers


@pytest.mark.parametrize("field,value,needle", [
    ("logit_bias", {"5": 10}, "speculative decoding"), ("min_p", 0.1, "speculative decoding"),
    ("use_beam_search", True, "beam search")])
def test_known_fields_not_served_are_400_saying_why(client, field, value, needle):
    from openai import BadRequestError

    with pytest.raises(BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       extra_body={field: value})
    err = e.value.body
    assert err["param"] == field and needle in err["message"] and field in err["message"]


def test_tokenize_detokenize_and_version(server, client, tokenizer):
    r = httpx.post(f"{server}/tokenize", json={"prompt": "The court held", "return_token_strs": True}, timeout=60)
    ids = tokenizer("The court held").input_ids
    assert r.json() == {"count": len(ids), "max_model_len": 512, "tokens": ids,
                        "token_strs": tokenizer.convert_ids_to_tokens(ids)}
    assert httpx.post(f"{server}/detokenize", json={"model": MODEL, "tokens": ids}, timeout=60).json() == {
        "prompt": "The court held"}
    messages = [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello, how"}]
    for extra in ({}, {"add_generation_prompt": False, "continue_final_message": True}):
        t = httpx.post(f"{server}/tokenize", json={"model": MODEL, "messages": messages, **extra}, timeout=60).json()
        c = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, extra_body=extra)
        assert t["count"] == c.usage.prompt_tokens == len(t["tokens"])  # the ids the chat endpoint generates from
    assert httpx.post(f"{server}/tokenize", json={"model": "gpt-4", "prompt": "x"}, timeout=60).status_code == 404
    assert httpx.post(f"{server}/detokenize", json={"tokens": [10**6]}, timeout=60).status_code == 400
    v = httpx.get(f"{server}/version", timeout=60).json()
    assert v["version"] == "0.1.0" and v["vllm_version"].startswith("0.32.0")


def _want(reference, tokenizer, name: str) -> str:
    return tokenizer.decode(reference[name][0], skip_special_tokens=True)


def _stream(server, path: str, body: dict) -> list[dict]:
    """The chunks' first choices of a streamed request."""
    out = []
    with httpx.stream("POST", f"{server}{path}", json={**body, "model": MODEL, "stream": True}, timeout=180) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out += json.loads(line[6:])["choices"][:1]
    return out


def test_json_schema_with_the_sdk_is_vllm_constrained_decoding(client, tokenizer, reference):
    """The output parses, validates against the schema, and is vLLM target-only's constrained decoding."""
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": CASE_PROMPT}], max_tokens=64, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "case", "schema": CASE_SCHEMA}})
    text = r.choices[0].message.content
    jsonschema.validate(json.loads(text), CASE_SCHEMA)
    assert text == _want(reference, tokenizer, "json_schema") and r.choices[0].finish_reason == "stop"


def test_json_object_whole_and_streamed_and_a_regex_with_accepted_drafts(server, client, tokenizer, cases,
                                                                           reference):
    want, _, reason = reference["json_object"]
    want = tokenizer.decode(want, skip_special_tokens=True)
    assert want.startswith("{") and (reason == "length" or isinstance(json.loads(want), dict))
    assert _served(client, cases, "json_object").choices[0].text == want
    ids, max_tokens, _ = cases["json_object"]
    chunks = _stream(server, "/v1/completions", {"prompt": ids, "max_tokens": max_tokens, "temperature": 0,
                                                 "response_format": {"type": "json_object"}})
    assert "".join(c["text"] for c in chunks) == want and chunks[-1]["finish_reason"] == reason
    # the legal drafter's drafts, verified under the grammar: most of them fit it and are accepted
    r = _served(client, cases, "regex", extra_body={"speculation": {"drafters": ["legal"]}})
    assert r.choices[0].text == _want(reference, tokenizer, "regex")
    assert r.usage.model_extra["num_accepted_tokens"] > 0


def test_named_tool_choice_is_constrained_decoding_of_its_schema(client, tokenizer, reference):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": WEATHER_PROMPT}], max_tokens=48, temperature=0,
        tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and call.id and r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    assert call.function.arguments == _want(reference, tokenizer, "named_tool")


def _joined_calls(pieces: list[dict]) -> list[dict]:
    """Streamed tool-call pieces joined as OpenAI's clients join them: by index, the name once, arguments appended."""
    calls: dict[int, dict] = {}
    for p in pieces:
        call = calls.setdefault(p["index"], {"id": p.get("id"), "name": "", "arguments": ""})
        call["name"] += (p.get("function") or {}).get("name") or ""
        call["arguments"] += (p.get("function") or {}).get("arguments") or ""
    return [calls[i] for i in sorted(calls)]


def test_required_tool_choice_streams_a_parsed_call(server):
    chunks = _stream(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": WEATHER_PROMPT}], "max_tokens": 64, "temperature": 0,
        "tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False})
    pieces = [tc for c in chunks for tc in c["delta"].get("tool_calls", [])]
    (call,) = _joined_calls(pieces)
    assert call["id"] and call["name"] == "get_weather" and len(pieces) > 1  # arguments streamed as generated
    jsonschema.validate(json.loads(call["arguments"]), WEATHER["function"]["parameters"])
    assert chunks[-1]["finish_reason"] == "tool_calls"


def test_auto_tool_choice_through_the_servers_parser(client, tokenizer, reference):
    """The hermes parser (ingress.tool_call_parser) parses the call the model wrote (forced here by a regex, whole and
    streamed); without the constraint the reply is consistent: content, or parsed calls."""
    kw = {"model": MODEL, "messages": [{"role": "user", "content": WEATHER_PROMPT}], "max_tokens": 160,
          "temperature": 0, "tools": [WEATHER], "tool_choice": "auto",
          "extra_body": {"structured_outputs": {"regex": HERMES_CALL}}}
    r = client.chat.completions.create(**kw)
    (call,) = r.choices[0].message.tool_calls
    assert (call.function.name, r.choices[0].finish_reason) == ("get_weather", "tool_calls")
    assert _want(reference, tokenizer, "hermes") == \
        f'<tool_call>{{"name": "get_weather", "arguments": {call.function.arguments}}}</tool_call>'
    streamed = [c for c in client.chat.completions.create(stream=True, **kw) if c.choices]
    pieces = [tc.model_dump(exclude_none=True) for c in streamed for tc in c.choices[0].delta.tool_calls or []]
    joined = _joined_calls(pieces)
    assert [(c["name"], json.loads(c["arguments"])) for c in joined] == \
        [("get_weather", json.loads(call.function.arguments))] and len(pieces) > 1
    assert streamed[-1].choices[0].finish_reason == "tool_calls"
    free = client.chat.completions.create(**{**kw, "extra_body": {}, "max_tokens": 16})
    m = free.choices[0]
    assert (m.message.tool_calls and m.finish_reason == "tool_calls") or \
        (m.message.content and not m.message.tool_calls and m.finish_reason in ("length", "stop"))


def test_reasoning_content_whole_and_streamed(server, client, tokenizer, reference):
    """vLLM's granite reasoning parser (ingress.reasoning_parser) splits the reply, its markers forced by a regex."""
    messages = [{"role": "user", "content": "Hi!"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=160, temperature=0,
                                       extra_body={"structured_outputs": {"regex": GRANITE}})
    m = r.choices[0].message
    reasoning = m.model_extra["reasoning_content"]
    assert reasoning and m.content and m.model_extra["reasoning"] == reasoning
    assert _want(reference, tokenizer, "granite") == \
        f"Here is my thought process:{reasoning}Here is my response:{m.content}"
    chunks = _stream(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 160, "temperature": 0,
                                                      "structured_outputs": {"regex": GRANITE}})
    # vLLM's granite parser streams from the deltas it is given (here a verify step's tokens, several at once): it
    # may leave a marker's first word in the reasoning
    assert "".join(c["delta"].get("reasoning_content", "") for c in chunks).startswith(reasoning)
    assert "".join(c["delta"].get("content", "") for c in chunks).strip() == m.content.strip()


@pytest.mark.parametrize("stream", [False, True])
def test_a_constraint_vllm_refuses_is_a_400(server, stream):
    r = httpx.post(f"{server}/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": "x", "max_tokens": 4, "stream": stream,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text


def test_langchain_chat_openai_invoke_stream_tools_and_structured_output(server, tokenizer, reference):
    """LangChain's ChatOpenAI against the server: each call is one of the requests above, so its answer is vLLM
    target-only's."""
    from langchain_openai import ChatOpenAI

    def chat(max_tokens: int) -> ChatOpenAI:
        return ChatOpenAI(base_url=f"{server}/v1", api_key="unused", model=MODEL, temperature=0,
                          max_tokens=max_tokens, timeout=180, max_retries=0)

    want = _want(reference, tokenizer, "eos")  # "Hi!", EOS honoured, 24 tokens at most
    assert chat(24).invoke("Hi!").content == want
    assert "".join(c.content for c in chat(24).stream("Hi!")) == want
    ai = chat(48).bind_tools([WEATHER], tool_choice="get_weather").invoke(WEATHER_PROMPT)
    assert [c["name"] for c in ai.tool_calls] == ["get_weather"]
    assert ai.tool_calls[0]["args"] == json.loads(_want(reference, tokenizer, "named_tool"))
    # streamed, LangChain joins the call's pieces (tool_call_chunks) into the same call
    chunks = list(chat(48).bind_tools([WEATHER], tool_choice="get_weather").stream(WEATHER_PROMPT))
    joined = chunks[0]
    for c in chunks[1:]:
        joined += c
    assert [(c["name"], c["args"]) for c in joined.tool_calls] == [("get_weather", ai.tool_calls[0]["args"])]
    assert sum(bool(c.tool_call_chunks) for c in chunks) > 1
    case = chat(64).with_structured_output({"title": "case", **CASE_SCHEMA}, method="json_schema").invoke(CASE_PROMPT)
    assert case == json.loads(_want(reference, tokenizer, "json_schema"))


def test_lm_eval_harness_scores_the_served_answers_against_the_targets_own(server, tokenizer, target, heldout,
                                                                            tmp_path, monkeypatch):
    """lm-eval's `local-completions` model against the server, on a generation task defined from a local JSON file
    whose answers are the target's own greedy continuations (HF, no speculation): a lossless server scores exact
    match on each; one answer is deliberately wrong, so the harness's comparison is shown to count."""
    import yaml as _yaml

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    eos = tokenizer.eos_token_id
    docs = []
    for domain in ("code", "legal", "biomedical", "dialogue"):
        text = tokenizer.decode(tokenizer(heldout[domain][1], add_special_tokens=False).input_ids[:40])
        ids = tokenizer(text, add_special_tokens=False).input_ids  # the prompt as the server tokenizes it
        with torch.no_grad():
            new = greedy_continue(target, torch.tensor([ids]), 12)[0, len(ids):].tolist()
        new = new[:new.index(eos)] if eos in new else new
        docs.append({"prompt": text, "answer": tokenizer.decode(new, skip_special_tokens=True)})
    docs.append({"prompt": docs[0]["prompt"], "answer": docs[0]["answer"] + " and not this"})
    (tmp_path / "docs.json").write_text(json.dumps(docs))
    (tmp_path / "task.yaml").write_text(_yaml.safe_dump({
        "task": "cosine_continuation", "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(tmp_path / "docs.json")}}, "test_split": "test",
        "output_type": "generate_until", "doc_to_text": "{{prompt}}", "doc_to_target": "{{answer}}",
        "generation_kwargs": {"until": [tokenizer.eos_token], "max_gen_toks": 12, "do_sample": False},
        "metric_list": [{"metric": "exact_match"}]}))
    # the task above alone: indexing lm-eval's ~15k built-in task files would cost ~12 s a test
    out = simple_evaluate(model="local-completions", tasks=["cosine_continuation"],
                          task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
                          model_args={"base_url": f"{server}/v1/completions", "model": MODEL,
                                      "tokenizer_backend": "huggingface", "tokenizer": str(tokenizer.name_or_path),
                                      "tokenized_requests": False, "max_retries": 1, "timeout": 300})
    logged = out["samples"]["cosine_continuation"]
    assert [s["exact_match"] for s in sorted(logged, key=lambda s: s["doc_id"])] == [1.0] * 4 + [0.0], \
        [(s["target"], s["filtered_resps"]) for s in logged]
    assert out["results"]["cosine_continuation"]["exact_match,none"] == pytest.approx(0.8)


def test_lm_eval_multiple_choice_loglikelihoods_are_the_targets_own(server, tokenizer, target, heldout, tmp_path,
                                                                    monkeypatch):
    """lm-eval's `local-completions` on a multiple-choice task from a local JSON file: its loglikelihood requests
    (token ids, `echo`, `logprobs: 1`, `max_tokens: 1`) score each choice from the echoed prompt's logprobs. Each
    choice's loglikelihood and is-greedy flag equal the target's own (HF, no speculation), and so does the
    accuracy; one label is deliberately wrong, so the harness's comparison is shown to count."""
    import yaml as _yaml

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    def enc(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False).input_ids

    def loglikelihood(context: str, continuation: str) -> tuple[float, bool]:
        """lm-eval's split (context and context + continuation encoded, the difference scored), scored by HF."""
        whole, n = enc(context + continuation), len(enc(context))
        with torch.no_grad():
            lp = target(torch.tensor([whole])).logits[0].float().log_softmax(-1)
        rows = lp[n - 1:len(whole) - 1]
        cont = torch.tensor(whole[n:])
        return rows.gather(1, cont[:, None]).sum().item(), bool((rows.argmax(-1) == cont).all())

    docs = []
    for i, domain in enumerate(("code", "legal", "biomedical", "dialogue")):
        ids = enc(heldout[domain][2])[:30]
        with torch.no_grad():
            new = greedy_continue(target, torch.tensor([ids]), 6)[0, len(ids):].tolist()
        other = tokenizer.decode(enc(heldout["literature"][i])[:6])
        choices = [tokenizer.decode(new).strip(), other.strip(), " ".join(reversed(other.split()))]
        docs.append({"question": tokenizer.decode(ids), "choices": choices, "label": 1 if i == 3 else 0})
    (tmp_path / "docs.json").write_text(json.dumps(docs))
    (tmp_path / "task.yaml").write_text(_yaml.safe_dump({
        "task": "cosine_choice", "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(tmp_path / "docs.json")}}, "test_split": "test",
        "output_type": "multiple_choice", "doc_to_text": "{{question}}", "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{label}}", "metric_list": [{"metric": "acc"}]}))
    # the task above alone (lm-eval's built-in tasks not indexed)
    out = simple_evaluate(model="local-completions", tasks=["cosine_choice"],
                          task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
                          model_args={"base_url": f"{server}/v1/completions", "model": MODEL,
                                      "tokenizer_backend": "huggingface", "tokenizer": str(tokenizer.name_or_path),
                                      "max_retries": 1, "timeout": 300})
    hits = []
    for s in sorted(out["samples"]["cosine_choice"], key=lambda s: s["doc_id"]):
        doc = docs[s["doc_id"]]
        want = [loglikelihood(s["arguments"][j][0], s["arguments"][j][1]) for j in range(len(doc["choices"]))]
        got = [r[0] for r in s["resps"]]
        assert [g[0] for g in got] == pytest.approx([w[0] for w in want], abs=1e-2)
        assert [bool(g[1]) for g in got] == [w[1] for w in want]
        hits.append(float(max(range(len(want)), key=lambda j: want[j][0]) == doc["label"]))
        assert s["acc"] == hits[-1]
    assert 0 < sum(hits) < len(hits)  # the wrong label counts as a miss
    assert out["results"]["cosine_choice"]["acc,none"] == pytest.approx(sum(hits) / len(hits))
