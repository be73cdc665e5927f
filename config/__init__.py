"""The one configuration schema of the application, passed as Serve application `args` and validated at deploy.

Model references are a directory, the name of a shipped model (`target`, `drafter-code`, ...), or a Hugging Face
model id, optionally pinned to a revision as `org/name@revision` (model_family/sources.py: resolved with
huggingface_hub on the node that loads the model, honouring its HF_HOME, HF_HUB_OFFLINE and HF_TOKEN).

The schema is split by its sections, every public name re-exported here (`from config import AppConfig`): app.py
(the top level), ingress.py, verifier.py, drafters.py, speculation.py, routing.py, deployment.py (Serve's options of
every deployment), autoscaler.py (the drafter autoscaler's policy_kwargs); base.py holds the strict base model and
reference.py renders docs/config.md.
"""

from config.app import AppConfig
from config.autoscaler import AutoscalerSpec
from config.deployment import DRAFTER_AUTOSCALING_DEFAULTS, AutoscalingOptions, DeploymentOptions
from config.drafters import DrafterSpec, NgramSpec, SuffixSpec
from config.ingress import IngressSpec
from config.reference import reference_markdown
from config.routing import RoutingSpec
from config.speculation import (ControllerSpec, GuardSpec, RequestMode, RetirementSpec, SpeculationMode,
                                SpeculationSpec, VoteSpec)
from config.verifier import CollaborationSpec, VerifierSpec

__all__ = ["AppConfig", "AutoscalerSpec", "AutoscalingOptions", "CollaborationSpec", "ControllerSpec",
           "DRAFTER_AUTOSCALING_DEFAULTS", "DeploymentOptions", "DrafterSpec", "GuardSpec", "IngressSpec",
           "NgramSpec", "RequestMode", "RetirementSpec", "RoutingSpec", "SpeculationMode", "SpeculationSpec",
           "SuffixSpec", "VerifierSpec", "VoteSpec", "reference_markdown"]
