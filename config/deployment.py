"""What Ray Serve needs to place and scale one deployment (the `deployment` of the ingress, the verifier,
the speculation node and every drafter), and Serve's per-deployment autoscaling keys."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from config.base import Strict


# Serve's autoscaling defaults (metrics every 10 s, scale up after 30 s, down after 600 s) are made for
# request-driven web services. Drafting demand moves with the controller's draft lengths, which change within
# seconds of a load change, and a drafter replica starts in seconds: the autoscaler needs fresher signals and
# shorter delays. Down stays slower than up: a removed replica's requests re-prefill elsewhere, and a drafter
# missing at a load peak costs verifier time.
DRAFTER_AUTOSCALING_DEFAULTS = {"metrics_interval_s": 2.0, "look_back_period_s": 10.0, "upscale_delay_s": 5.0,
                                "downscale_delay_s": 60.0}


class AutoscalingOptions(Strict):
    """Serve's per-deployment autoscaling_config (ray.serve.config.AutoscalingConfig), its keys checked here; a
    key left out is Serve's default (on a drafter, DRAFTER_AUTOSCALING_DEFAULTS' first). The application's
    autoscaling_policy is set by the graph, not per deployment."""

    min_replicas: int | None = Field(None, ge=0, description="fewest replicas; 0 on a drafter: parked when idle")
    max_replicas: int | None = Field(None, ge=1, description="most replicas")
    initial_replicas: int | None = Field(None, ge=0, description="replicas at deploy")
    target_ongoing_requests: float | None = Field(None, gt=0, description="Serve's default policy's target per "
                                                  "replica (the drafter autoscaler decides from its own signals)")
    metrics_interval_s: float | None = Field(None, gt=0, description="how often replicas report their load")
    look_back_period_s: float | None = Field(None, gt=0, description="the window load is averaged over")
    smoothing_factor: float | None = Field(None, gt=0, description="Serve's default policy: step size")
    upscale_smoothing_factor: float | None = Field(None, gt=0, description="Serve's default policy: up step size")
    downscale_smoothing_factor: float | None = Field(None, gt=0, description="Serve's default policy: down step")
    upscaling_factor: float | None = Field(None, gt=0, description="Serve's default policy: up multiplier")
    downscaling_factor: float | None = Field(None, gt=0, description="Serve's default policy: down multiplier")
    upscale_delay_s: float | None = Field(None, ge=0, description="how long a scale-up must be wanted first")
    downscale_delay_s: float | None = Field(None, ge=0, description="how long a scale-down must be wanted first")
    downscale_to_zero_delay_s: float | None = Field(None, ge=0, description="the same, for the last replica")
    aggregation_function: Literal["mean", "max", "min"] | None = Field(None, description="how the window's load "
                                                                      "samples are combined")

    @model_validator(mode="after")
    def _bounds(self):
        lo, hi = self.min_replicas, self.max_replicas
        if lo is not None and hi is not None and lo > hi:
            raise ValueError(f"autoscaling_config: min_replicas ({lo}) must be <= max_replicas ({hi})")
        return self

    def serve(self) -> dict[str, Any]:
        """The keys given, as Serve takes them."""
        return self.model_dump(exclude_none=True)


class DeploymentOptions(Strict):
    """What Ray Serve needs to place and scale one deployment."""

    num_replicas: int | Literal["auto"] = Field(1, description="replicas (ignored when autoscaling_config is set)")
    max_ongoing_requests: int = Field(256, ge=1, description="concurrent calls a replica takes (Serve's default of 5 "
                                      "starves deployments that batch)")
    ray_actor_options: dict[str, Any] = Field(default_factory=lambda: {"num_cpus": 0}, description="Ray placement: "
                                              "num_cpus, num_gpus, resources, accelerator_type")
    autoscaling_config: AutoscalingOptions | None = Field(
        None, description="Serve's per-deployment autoscaling. On a drafter, with the drafter autoscaler as the "
        "application's autoscaling_policy: min_replicas, max_replicas, and Serve's timing keys, defaulting to "
        f"{DRAFTER_AUTOSCALING_DEFAULTS}")
    # Serve's defaults stop a deployment's old replicas before starting new ones (a one-replica deployment is gone
    # until its replacement is up: 20-40 s here, requests in flight cut) and give a replica 20 s to finish
    max_surge_percent: int = Field(100, ge=0, le=100, description="extra replicas while a redeploy replaces this "
                                   "deployment's, in % of its replica count: 100 keeps the old replicas serving "
                                   "until their replacements are ready. Needs room for both; a verifier whose second "
                                   "copy does not fit its GPUs must set 0, and then it stops serving while it "
                                   "restarts")
    graceful_shutdown_timeout_s: float = Field(300.0, gt=0, description="a replica being replaced or scaled down "
                                               "finishes its requests in flight for up to this long (Serve's 20 s "
                                               "default would cut long generations)")

    def serve_options(self) -> dict[str, Any]:
        opts: dict[str, Any] = {"max_ongoing_requests": self.max_ongoing_requests,
                                "ray_actor_options": dict(self.ray_actor_options),
                                "max_surge_percent": self.max_surge_percent,
                                "graceful_shutdown_timeout_s": self.graceful_shutdown_timeout_s}
        if self.autoscaling_config is not None:
            opts["autoscaling_config"] = self.autoscaling_config.serve()
        else:
            opts["num_replicas"] = self.num_replicas
        return opts
