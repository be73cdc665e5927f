"""The API key: every path but /health and /metrics needs `Authorization: Bearer <key>`, answered in OpenAI's
error shape (the middleware runs before routing, so this needs no Serve deployment: the app around a server whose
verifier is never reached)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from config import AppConfig
from serve_app.app import openai_app
from serve_app.server import OpenAIServer


class NoVerifier:
    """A Serve handle's place for a server whose requests never reach the verifier."""

    def options(self, **_):
        return self


@pytest.fixture(scope="module")
def server():
    return OpenAIServer(AppConfig(verifier={"model": "target", "max_len": 64}, speculation={"mode": "off"}), NoVerifier())


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
