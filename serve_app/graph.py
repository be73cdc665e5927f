"""The application builder used by `serve run` / `serve deploy`: `import_path: serve_app.graph:build_app`.

Ingress -> Verifier -> Speculation (router + fusion) -> Drafter-<domain> (one deployment per domain).
"""

from __future__ import annotations

from ray.serve import Application

from deployments.drafter import DrafterDeployment
from serve_app.ingress import IngressDeployment
from deployments.speculation import SpeculationDeployment
from deployments.verifier import VerifierDeployment
from config import AppConfig


def build_app(args: dict) -> Application:
    cfg = AppConfig.model_validate(args or {})  # a bad config fails here, at deploy time, with pydantic's message
    speculation = None
    if cfg.speculation.mode != "off":
        drafters = {d.name: DrafterDeployment.options(name=f"Drafter-{d.name}", **d.deployment.serve_options())
                    .bind(d) for d in cfg.drafters}
        speculation = SpeculationDeployment.options(**cfg.speculation.deployment.serve_options()).bind(cfg, drafters)
    verifier = VerifierDeployment.options(**cfg.verifier.deployment.serve_options()).bind(cfg, speculation)
    return IngressDeployment.options(**cfg.ingress.deployment.serve_options()).bind(cfg, verifier)
