"""CoS collaborative decoding served: `verifier.collaboration` through the real Ray Serve graph and the OpenAI API
(examples/collaborative.yaml's shape, on the small target). The served greedy output is the combination's
token-by-token greedy output, computed here without Ray."""

from __future__ import annotations

import httpx
import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from config import CollaborationSpec
from engines.collaborative import CollaborativeEngine, Combination
from engines.sampling import SamplingParams
from model_family.paths import REPO_ROOT

pytestmark = pytest.mark.slow

MODEL = "cosine-collaborative"


@pytest.fixture(scope="module")
def app_args() -> dict:
    app = yaml.safe_load((REPO_ROOT / "examples" / "collaborative.yaml").read_text())["applications"][0]["args"]
    app["verifier"].update(model="target", max_batch=4, max_len=256)  # the small target keeps the suite fast
    app["ingress"]["model_name"] = MODEL
    return app


@pytest.fixture(scope="module")
def server(app_args):
    from tests.conftest import local_serve

    with local_serve(app_args) as url:
        yield url


def test_served_greedy_output_is_the_combinations(server, app_args, target, models, tokenizer, heldout):
    from openai import OpenAI

    c = CollaborationSpec(**app_args["verifier"]["collaboration"])
    partner = AutoModelForCausalLM.from_pretrained(models / c.partner, dtype=torch.float32).eval()
    reference = CollaborativeEngine(target, partner, Combination(c.combine, c.weight, c.mu), k=0, max_batch=4,
                                    max_len=256)
    client = OpenAI(base_url=f"{server}/v1", api_key="unused", timeout=120)
    for d in ("literature", "code", "legal"):
        ids = tokenizer(heldout[d][9], add_special_tokens=False).input_ids[:48]
        rid = reference.add_request(ids, SamplingParams(max_tokens=24, ignore_eos=True))
        want = []
        while reference.has_unfinished():
            want += [t for o in reference.step() for t in o.new_token_ids]
        out = client.completions.create(model=MODEL, prompt=ids, max_tokens=24, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert out.choices[0].text == tokenizer.decode(want, skip_special_tokens=True), d
        assert out.usage.completion_tokens == 24
        assert out.usage.model_extra["num_accepted_tokens"] > 0  # the partner's drafts were accepted
        assert reference.finished_stats(rid)["verify_steps"] == 24  # the reference: one target pass per token
    # speculation off for one request: the same combination, token by token (bench serve's baseline)
    off = client.completions.create(model=MODEL, prompt=ids, max_tokens=24, temperature=0,
                                    extra_body={"ignore_eos": True, "speculation": {"enabled": False}})
    assert off.choices[0].text == out.choices[0].text
    assert off.usage.model_extra["verify_steps"] == 24 and off.usage.model_extra["num_draft_tokens"] == 0


def test_served_streaming_and_sampling(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me about the court"}], "max_tokens": 20,
            "temperature": 0.8, "seed": 3, "stream": True}
    with httpx.stream("POST", f"{server}/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) > 3
    once = httpx.post(f"{server}/v1/chat/completions", json={**body, "stream": False}, timeout=120).json()
    again = httpx.post(f"{server}/v1/chat/completions", json={**body, "stream": False}, timeout=120).json()
    assert once["choices"][0]["message"]["content"] == again["choices"][0]["message"]["content"]  # seeded
