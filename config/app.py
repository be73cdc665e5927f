"""The top level of the schema (`AppConfig`, the application's `args`): its sections and the checks across them."""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from config.base import Strict
from config.drafters import DrafterSpec
from config.ingress import IngressSpec
from config.routing import RoutingSpec
from config.speculation import SpeculationSpec
from config.verifier import VerifierSpec


class AppConfig(Strict):
    tokenizer: str | None = Field(None, description="the tokenizer of the target, which every drafter must share "
                                  "(checked at startup); null: the target model's own")
    ingress: IngressSpec = Field(default_factory=IngressSpec, description="the OpenAI-compatible HTTP front")
    verifier: VerifierSpec = Field(..., description="the target model's deployment")
    drafters: list[DrafterSpec] = Field(default_factory=list, description="one deployment per drafter (domain)")
    speculation: SpeculationSpec = Field(default_factory=SpeculationSpec, description="drafting and verification")
    routing: RoutingSpec = Field(default_factory=RoutingSpec, description="which drafters draft each request")

    @field_validator("drafters")
    @classmethod
    def _unique_names(cls, v: list[DrafterSpec]) -> list[DrafterSpec]:
        names = [d.name for d in v]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"drafter names must be unique, repeated: {dupes}")
        return v

    @model_validator(mode="after")
    def _consistent(self):
        names = {d.name for d in self.drafters}
        if self.verifier.collaboration is not None:
            if self.verifier.engine != "torch":
                raise ValueError("verifier.collaboration runs in the torch engine (vLLM cannot sample from a "
                                 "combination of two models): set verifier.engine: torch")
            if self.speculation.mode != "off":
                raise ValueError("verifier.collaboration drafts with its partner inside the verifier: set "
                                 "speculation.mode: off (the drafting tier's drafts would be ignored)")
        if self.speculation.mode != "off" and not self.drafters:
            raise ValueError("speculation is on but no drafters are configured (set speculation.mode: off)")
        for n in self.speculation.fixed_drafters or []:
            if n not in names:
                raise ValueError(f"speculation.fixed_drafters names unknown drafter {n!r}; known: {sorted(names)}")
        if self.speculation.drafter is not None and self.speculation.drafter not in names:
            raise ValueError(f"speculation.drafter names unknown drafter {self.speculation.drafter!r}; known: "
                             f"{sorted(names)}")
        voters = self.speculation.vote.drafters or sorted(names)
        unknown = sorted(set(voters) - names)
        if unknown:
            raise ValueError(f"speculation.vote.drafters names unknown drafters {unknown}; known: {sorted(names)}")
        if self.speculation.mode == "vote":
            if len(set(voters)) < 2:
                raise ValueError("speculation.mode: vote needs at least two voters (with one, use mode: chain)")
        spec = self.speculation
        if spec.drafting_tier == "auto" and spec.mode != "off" and (not spec.adaptive
                                                                     or spec.controller.kind != "goodput"):
            raise ValueError("speculation.drafting_tier: auto chooses the tier from the goodput controller's verify "
                             "model and acceptance: set speculation.adaptive: true and controller.kind: goodput, or "
                             "pick a tier (deployments or colocated)")
        if self.speculation.drafting_tier == "colocated":
            scaled = [d.name for d in self.drafters if d.deployment.autoscaling_config is not None
                      or d.deployment.num_replicas != 1]
            if scaled:
                raise ValueError(f"speculation.drafting_tier: colocated runs every drafter inside the verifier's "
                                 f"replica; drafters {scaled} ask for replicas of their own (use deployments)")
        for d in self.drafters:
            if d.max_len is None:
                d.max_len = self.verifier.max_len
        if self.tokenizer is None:
            self.tokenizer = self.verifier.model
        if self.routing.drafters_per_request > max(1, len(self.drafters)):
            self.routing.drafters_per_request = max(1, len(self.drafters))
        return self
