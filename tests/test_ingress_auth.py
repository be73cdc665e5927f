"""The OpenAI server's HTTP app without Serve: the API key (every path but /health and /metrics needs
`Authorization: Bearer <key>`), and OpenAI's error shape for what is refused before any generation. Served for
real: tests/test_serve_one_machine.py."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from serve_app.app import IGNORED_HEADER, openai_app
from tests.helpers.openai_server import openai_server


@pytest.fixture(scope="module")
def server():
    return openai_server(model_name="cosine-target", max_body_bytes=4096)


@pytest.fixture
def client(server):
    return TestClient(openai_app(server, api_key="s3cret"), raise_server_exceptions=False)


@pytest.mark.parametrize("path", ["/v1/models", "/v1/chat/completions", "/v1/internal/speculation_stats", "/docs",
                                  "/openapi.json"])
def test_without_the_key_everything_but_health_and_metrics_is_401(client, path):
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "s3cret"}):
        r = client.get(path, headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key" and r.json()["error"]["type"] == "authentication_error"


def test_with_the_key_or_on_open_paths_requests_pass_the_middleware(client):
    assert client.get("/openapi.json", headers={"authorization": "Bearer s3cret"}).status_code == 200
    assert client.get("/v1/models", headers={"authorization": "Bearer s3cret"}).json()["data"][0]["id"] == \
        "cosine-target"
    for path in ("/health", "/metrics"):  # routed on (the verifier is not there: 503 and 500): anything but 401
        assert client.get(path).status_code != 401


def test_no_key_no_authentication(server):
    assert TestClient(openai_app(server)).get("/openapi.json").status_code == 200


def test_requests_refused_before_generation_in_openais_error_shape(server):
    client = TestClient(openai_app(server), raise_server_exceptions=False)

    def error(path: str, status: int, **kw) -> dict:
        r = client.post(path, **kw)
        assert r.status_code == status, r.text
        return r.json()["error"]

    assert error("/v1/completions", 400, content=b"{not json")["message"] == "request body is not valid JSON"
    assert error("/v1/completions", 413, json={"prompt": "x" * 5000})["code"] == "request_too_large"
    assert error("/v1/completions", 404, json={"model": "other", "prompt": "hi"})["code"] == "model_not_found"
    assert error("/v1/chat/completions", 400, json={"model": "cosine-target", "messages": [
        {"role": "user", "content": "hi"}], "max_tokens": 100})["code"] == "context_length_exceeded"
    assert error("/v1/nope", 404)["code"] == "not_found"


def test_tokenize_and_detokenize_round_trip_and_name_ignored_fields(server):
    client = TestClient(openai_app(server))
    r = client.post("/tokenize", json={"prompt": "def parse(path):", "return_token_strs": True, "verbosity": 1})
    body = r.json()
    assert body["count"] == len(body["tokens"]) == len(body["token_strs"]) > 0 and body["max_model_len"] == 64
    assert r.headers[IGNORED_HEADER] == "verbosity"
    assert client.post("/detokenize", json={"tokens": body["tokens"]}).json() == {"prompt": "def parse(path):"}
