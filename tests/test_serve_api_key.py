"""The API key served for real: the ingress's app is built in its replica (Serve's late-bound ingress), so the key
and the model name a config gives reach the app that answers. (They once reached only a copy: the module-level app
Serve pickled answered without a key; tests/test_ingress_auth.py, without Serve, could not see it.)"""

from __future__ import annotations

import httpx
import pytest
from openai import AuthenticationError, OpenAI

pytestmark = pytest.mark.slow

MODEL, KEY = "cosine-keyed", "s3cret"


@pytest.fixture(scope="module")
def server():
    from tests.conftest import local_serve

    args = {"ingress": {"model_name": MODEL, "api_key": KEY}, "speculation": {"mode": "off"},
            "verifier": {"engine": "torch", "model": "target", "max_batch": 2, "max_len": 256}}
    with local_serve(args) as url:
        yield url


def test_the_configured_key_is_required_and_open_paths_stay_open(server):
    assert httpx.get(f"{server}/v1/models", timeout=30).status_code == 401
    with pytest.raises(AuthenticationError):
        OpenAI(base_url=f"{server}/v1", api_key="wrong", timeout=60).models.list()
    assert httpx.get(f"{server}/health", timeout=30).json() == {"status": "ok"}
    reply = OpenAI(base_url=f"{server}/v1", api_key=KEY, timeout=120).completions.create(
        model=MODEL, prompt="def parse(path):", max_tokens=4, temperature=0)
    assert reply.usage.completion_tokens == 4


def test_the_openapi_document_describes_this_server(server):
    spec = httpx.get(f"{server}/openapi.json", headers={"authorization": f"Bearer {KEY}"}, timeout=30).json()
    assert {"/v1/chat/completions", "/v1/completions", "/tokenize", "/health"} <= set(spec["paths"])
    assert spec["components"]["schemas"]["CompletionRequest"]["properties"]["model"]["enum"] == [MODEL]
