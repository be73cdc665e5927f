"""The served graph on models that are not the shipped family, loaded by Hugging Face id from a hub cache.

A tiny random-weight Qwen3 target with this project's vocabulary, verified in vLLM, and drafters of two other
architectures' paths: a Qwen3 drafter (the fast runner; the target's own weights, so its drafts are accepted) and a
GPT-NeoX drafter (the transformers-backed runner). Every model is published under an id in a hub cache of
huggingface_hub's layout and the Ray cluster runs offline on it. Greedy output through the graph, streamed and not,
must equal vLLM's target-only greedy output, with drafts accepted.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import vllm_greedy
from tests.helpers.hub_cache import offline_env, publish
from tests.helpers.tiny_models import save_tiny

pytestmark = pytest.mark.slow
MODEL = "qwen3-tiny"
NEW_TOKENS = 24


def app_config() -> dict:
    return {
        "ingress": {"model_name": MODEL},
        "verifier": {"engine": "vllm", "model": "acme/qwen3-target", "max_batch": 4, "max_len": 256,
                     "kv_cache_gib": 1},
        "speculation": {"mode": "cosine", "k": 4, "draft_timeout_ms": 5000, "adaptive": False,
                        "guard": {"enabled": False}},
        "routing": {"drafters_per_request": 2},
        "drafters": [{"name": "self", "model": "acme/qwen3-target"},
                     {"name": "neox", "model": "acme/neox-drafter@v1"}],
    }


@pytest.fixture(scope="module")
def hub(tmp_path_factory, models):
    cache = tmp_path_factory.mktemp("hub")
    work = tmp_path_factory.mktemp("tiny")
    publish(cache, "acme/qwen3-target", save_tiny("qwen3", work / "qwen3", models / "tokenizer", seed=3))
    publish(cache, "acme/neox-drafter", save_tiny("gpt_neox", work / "neox", models / "tokenizer", seed=4),
            revision="v1")
    return cache


@pytest.fixture(scope="module")
def cases(hub, tokenizer, heldout) -> tuple[Path, list[list[int]], list[list[int]]]:
    """The hub target's snapshot, the prompts, and vLLM target-only's greedy continuations of them: run before the
    graph starts (`server` asks for them first), since beside its idle replicas a vLLM run takes about three times as
    long on a 2-core machine."""
    from tests.helpers.hub_cache import snapshot

    target_dir = snapshot(hub, "acme/qwen3-target")
    prompts = [tokenizer(heldout[d][3], add_special_tokens=False).input_ids[:40] for d in ("code", "legal")]
    return target_dir, prompts, _vllm_target_only(target_dir, prompts)


@pytest.fixture(scope="module")
def server(hub, cases):
    from huggingface_hub import constants

    from tests.conftest import local_serve

    with pytest.MonkeyPatch.context() as mp:
        for key, value in offline_env(hub).items():  # the Ray processes started below inherit them
            mp.setenv(key, value)
        mp.setattr(constants, "HF_HUB_CACHE", str(hub))  # this process read them at import
        mp.setattr(constants, "HF_HUB_OFFLINE", True)
        with local_serve(app_config()) as url:
            yield url


def _vllm_target_only(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    req = {"model": str(model_dir), "prompts": prompts, "max_tokens": NEW_TOKENS}
    return vllm_greedy.run(req)["outputs"]


def test_greedy_through_the_graph_on_hub_models_equals_vllm_target_only(server, cases, tokenizer):
    from openai import OpenAI

    from model_family.compat import eos_token_ids

    target_dir, prompts, wants = cases
    eos = set(eos_token_ids(target_dir, tokenizer))
    client = OpenAI(base_url=f"{server}/v1", api_key="unused", timeout=300)
    accepted = []
    for ids, want in zip(prompts, wants):
        cut = next((i for i, t in enumerate(want) if t in eos), len(want))
        text = tokenizer.decode(want[:cut], skip_special_tokens=True)
        out = client.completions.create(model=MODEL, prompt=ids, max_tokens=NEW_TOKENS, temperature=0)
        assert out.choices[0].text == text
        assert out.usage.completion_tokens == cut
        accepted.append(out.usage.model_extra["mean_acceptance_length"])
        stream = client.completions.create(model=MODEL, prompt=ids, max_tokens=NEW_TOKENS, temperature=0,
                                           stream=True)
        assert "".join(c.choices[0].text for c in stream if c.choices) == text
    # the Qwen3 drafter is the target itself: with speculation silently off every round would commit one token
    assert max(accepted) > 2.0, accepted
