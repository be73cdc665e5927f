"""The ingress deployment: the OpenAI-compatible server (serve_app/server.py) as the Serve deployment `Ingress`
in front of the verifier.

Ray Serve LLM's shape: a thin deployment around the plain server class. Its FastAPI app (serve_app/app.py) is
built in the replica, around the replica's own server (Serve's late-bound ingress), so that the routes, the API key
and the model name are those of this server: nothing is shared through a module-level app."""

from __future__ import annotations

from ray import serve

from config import AppConfig
from deployments.verifier import VerifierServer
from serve_app.app import configured_api_key, openai_app
from serve_app.local_handle import LocalHandle
from serve_app.server import OpenAIServer


@serve.deployment(name="Ingress")
@serve.ingress()
class IngressDeployment(OpenAIServer):
    def __serve_build_asgi_app__(self):
        return openai_app(self, api_key=configured_api_key(self.cfg))


@serve.deployment(name="Verifier")
@serve.ingress()
class VerifierIngress(VerifierServer):
    """The verifier replica with the OpenAI server in it (`ingress.in_verifier`): Serve's proxy sends HTTP straight
    to the verifier's replicas, and a streamed chunk crosses no replica boundary before the proxy."""

    def __init__(self, config: AppConfig, speculation=None):
        super().__init__(config, speculation)
        self.server = OpenAIServer(config, LocalHandle(self))

    def __serve_build_asgi_app__(self):
        return openai_app(self.server, api_key=configured_api_key(self.server.cfg))
