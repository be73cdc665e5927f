"""The OpenAI server without Serve: its request preparation, replies and HTTP app, around a verifier that is
never reached (requests that would reach it are not sent)."""

from __future__ import annotations

from config import AppConfig
from serve_app.server import OpenAIServer


class NoVerifier:
    """A Serve handle's place for a server that only prepares requests."""

    def options(self, **_):
        return self


def openai_server(engine: str = "torch", **ingress_fields) -> OpenAIServer:
    """A server of the shipped target (a 64-token context) behind a verifier of `engine`."""
    cfg = AppConfig(verifier={"engine": engine, "model": "target", "max_len": 64}, speculation={"mode": "off"},
                    ingress={"max_queued_requests": 4, **ingress_fields})
    return OpenAIServer(cfg, NoVerifier())
