"""docs/config.md, the configuration reference, generated from the schema's fields and docstrings."""

from __future__ import annotations

from typing import get_args, get_origin

from pydantic import BaseModel

from config.app import AppConfig
from config.autoscaler import AutoscalerSpec
from config.deployment import DeploymentOptions


def reference_markdown() -> str:
    """docs/config.md: every field of the schema with its type, default and description (`cosine config docs`)."""
    lines = ["# Configuration reference", "",
             "Generated from `config.AppConfig` by `cosine config docs > docs/config.md` (the test suite checks it is "
             "current). These are the `args` of the Serve application (`import_path: serve_app.graph:build_app`); "
             "`cosine config schema` prints the same as JSON Schema.", ""]

    def walk(model: type[BaseModel], prefix: str) -> None:
        nested = []
        lines.extend([f"## `{prefix or 'top level'}`", ""])
        if model.__doc__ and model.__doc__.strip() and model is not AppConfig:
            lines.extend([" ".join(model.__doc__.split()), ""])
        lines.extend(["| field | type | default | description |", "|---|---|---|---|"])
        for name, f in model.model_fields.items():
            ann = f.annotation
            sub = _model_in(ann)
            path = f"{prefix}.{name}" if prefix else name
            if sub is not None and sub is not DeploymentOptions:
                nested.append((sub, path + ("[]" if "list" in str(ann) else "")))
            default = "required" if f.is_required() else repr(f.get_default(call_default_factory=True))
            if sub is not None:
                default = "see below" if sub is not DeploymentOptions else "see `deployment`"
            typ = str(ann).replace("typing.", "") if get_origin(ann) else getattr(ann, "__name__", str(ann))
            if sub is not None:  # a model's public name: the config package re-exports it
                typ = typ.replace(f"{sub.__module__}.", "config.")
            typ = typ.replace("|", "\\|")
            desc = (f.description or "").replace("|", "\\|")
            shown = default if sub is not None else f"`{default}`"
            lines.append(f"| `{name}` | `{typ}` | {shown} | {desc} |")
        lines.append("")
        for sub, path in nested:
            walk(sub, path)

    walk(AppConfig, "")
    walk(DeploymentOptions, "deployment (of ingress, verifier, speculation and every drafter)")
    walk(AutoscalerSpec, "autoscaling_policy.policy_kwargs (the drafter autoscaler, beside `args`)")
    return "\n".join(lines)


def _model_in(annotation) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for a in get_args(annotation):
        m = _model_in(a)
        if m is not None:
            return m
    return None
