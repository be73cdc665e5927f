"""The application builder used by `serve run` / `serve deploy`: `import_path: serve_app.graph:build_app`.

Ingress -> Verifier -> Speculation (router + fusion) -> Drafter-<domain> (one deployment per domain); with
`speculation.drafting_tier: colocated`, Ingress -> Verifier, the drafting tier inside the verifier's replica; with
`auto`, both (speculation/tiers.py decides what each layout builds). With `ingress.in_verifier` the OpenAI server
runs in the verifier's replicas (`VerifierIngress`): no Ingress deployment, Serve's proxy -> Verifier.
"""

from __future__ import annotations

from ray.serve import Application

from config import DRAFTER_AUTOSCALING_DEFAULTS, AppConfig, DrafterSpec
from deployments.drafter import DrafterDeployment
from engines.build import check_models
from deployments.speculation import SpeculationDeployment
from deployments.verifier import VerifierDeployment
from serve_app.ingress import IngressDeployment, VerifierIngress
from speculation.tiers import resolve

# a request's drafter calls go to the replica holding its KV cache
DRAFTER_ROUTER = {"request_router_class": "deployments.replica_affinity:HomeReplicaRouter"}


def drafter_options(d: DrafterSpec) -> dict:
    opts = d.deployment.serve_options()
    if "autoscaling_config" in opts:
        opts["autoscaling_config"] = {**DRAFTER_AUTOSCALING_DEFAULTS, **opts["autoscaling_config"]}
    return {**opts, "name": f"Drafter-{d.name}", "request_router_config": DRAFTER_ROUTER}


def verifier_options(cfg: AppConfig, drafters: list[dict]) -> dict:
    """With autoscaling drafters, the verifier takes part in the application's autoscaling policy too (its signals
    reach the policy only so): at its configured replica count unless it autoscales itself."""
    opts = cfg.verifier.deployment.serve_options()
    scaling = [o["autoscaling_config"] for o in drafters if "autoscaling_config" in o]
    if scaling and "autoscaling_config" not in opts and isinstance(opts["num_replicas"], int):
        n = opts.pop("num_replicas")
        opts["autoscaling_config"] = {"min_replicas": n, "max_replicas": n, "initial_replicas": n,
                                      **{k: scaling[0][k] for k in ("metrics_interval_s", "look_back_period_s")}}
    return opts


def build_app(args: dict) -> Application:
    cfg = AppConfig.model_validate(args or {})  # a bad config fails here, at deploy time, with pydantic's message
    vocab_limit = check_models(cfg)  # so do models that cannot be had or do not share the target's vocabulary
    speculation, drafter_opts = None, []
    if resolve(cfg).remote:
        drafter_opts = [drafter_options(d) for d in cfg.drafters]
        drafters = {d.name: DrafterDeployment.options(**o).bind(d, vocab_limit)
                    for d, o in zip(cfg.drafters, drafter_opts)}
        speculation = SpeculationDeployment.options(**cfg.speculation.deployment.serve_options()).bind(cfg, drafters)
    if cfg.ingress.in_verifier:
        return VerifierIngress.options(**verifier_options(cfg, drafter_opts)).bind(cfg, speculation)
    verifier = VerifierDeployment.options(**verifier_options(cfg, drafter_opts)).bind(cfg, speculation)
    return IngressDeployment.options(**cfg.ingress.deployment.serve_options()).bind(cfg, verifier)
