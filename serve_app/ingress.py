"""The ingress deployment: the OpenAI-compatible server (serve_app/server.py) as the Serve deployment `Ingress`
in front of the verifier.

Ray Serve LLM's shape: a thin deployment around the plain server class. Its FastAPI app (serve_app/app.py) is
built in the replica, around the replica's own server (Serve's late-bound ingress), so that the routes, the API key
and the model name are those of this server: nothing is shared through a module-level app."""

from __future__ import annotations

from ray import serve

from serve_app.app import configured_api_key, openai_app
from serve_app.server import OpenAIServer


@serve.deployment(name="Ingress")
@serve.ingress()
class IngressDeployment(OpenAIServer):
    def __serve_build_asgi_app__(self):
        return openai_app(self, api_key=configured_api_key(self.cfg))
