"""The drafter autoscaler's settings (`autoscaling_policy.policy_kwargs`, beside the application's `args`)."""

from __future__ import annotations

from pydantic import Field

from config.base import Strict


class AutoscalerSpec(Strict):
    """The drafter autoscaler (autoscale/policy.py), an application-level Serve autoscaling policy. It is not part
    of the application's `args`: Serve gives it these fields as `autoscaling_policy.policy_kwargs`."""

    target_utilization: float = Field(0.6, gt=0, le=1, description="share of a drafter replica's time it should "
                                      "compute: lower keeps drafts quick (the verifier waits for them), higher "
                                      "uses fewer replicas")
    hysteresis: float = Field(0.25, ge=0, lt=1, description="scale down only while the remaining replicas would "
                              "stay this much below target_utilization (no flapping at a boundary)")
    smoothing: float = Field(0.5, gt=0, le=1, description="weight of the newest decision period in the smoothed "
                             "demand (Serve already averages each signal over look_back_period_s)")
    speculation_off_below: float = Field(0.05, ge=0, lt=1, description="when the verifier gives drafts to fewer "
                                         "than this share of its request rounds, speculation is off: drafters go "
                                         "to min_replicas")
    draft_wait_above: float = Field(0.2, ge=0, le=1, description="when the verifier waits for drafts more than "
                                    "this share of its time and a drafter is at target_utilization, that drafter "
                                    "gets a replica more")
