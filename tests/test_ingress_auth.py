"""The API key: every path but /health and /metrics needs `Authorization: Bearer <key>`, answered in OpenAI's
error shape (the middleware runs before routing, so this needs no Serve deployment)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from serve_app.ingress import app


@pytest.fixture
def client():
    app.state.api_key = "s3cret"
    yield TestClient(app, raise_server_exceptions=False)
    app.state.api_key = None


@pytest.mark.parametrize("path", ["/v1/models", "/v1/chat/completions", "/v1/internal/speculation_stats", "/docs",
                                  "/openapi.json"])
def test_without_the_key_everything_but_health_and_metrics_is_401(client, path):
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "s3cret"}):
        r = client.get(path, headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key" and r.json()["error"]["type"] == "authentication_error"


def test_with_the_key_or_on_open_paths_requests_pass_the_middleware(client):
    assert client.get("/openapi.json", headers={"authorization": "Bearer s3cret"}).status_code == 200
    for path in ("/health", "/metrics"):  # routed on (no deployment here): anything but 401
        assert client.get(path).status_code != 401


def test_no_key_no_authentication():
    app.state.api_key = None
    assert TestClient(app).get("/openapi.json").status_code == 200
