import pytest
from pydantic import ValidationError

from config import AppConfig


def _cfg(**over):
    base = {"verifier": {"model": "target"},
            "drafters": [{"name": "code", "model": "drafter-code"}, {"name": "legal", "model": "drafter-legal"}]}
    base.update(over)
    return base


def test_defaults_validate():
    cfg = AppConfig.model_validate(_cfg())
    assert cfg.verifier.engine == "torch" and cfg.speculation.mode == "cosine"
    assert cfg.routing.drafters_per_request == 2


@pytest.mark.parametrize("bad,needle", [
    ({"drafters": [{"name": "code", "model": "a"}, {"name": "code", "model": "b"}]}, "unique"),
    ({"drafters": []}, "no drafters"),
    ({"speculation": {"fixed_drafters": ["bio"]}}, "unknown drafter"),
    ({"routing": {"alpha": 0.1, "beta": 0.5}}, "alpha"),
    ({"verifier": {"model": "target", "engine": "tensorrt"}}, "engine"),
    ({"verifier": {"model": "target", "max_batchsize": 4}}, "max_batchsize"),
    ({"speculation": {"deployment": {"num_replicas": 2}}}, "num_replicas: 1"),
    ({"speculation": {"drafting_tier": "colocated"}, "drafters": [
        {"name": "code", "model": "a", "deployment": {"autoscaling_config": {"min_replicas": 1, "max_replicas": 2}}}]},
     "replicas of their own"),
])
def test_bad_configs_are_rejected_with_a_clear_message(bad, needle):
    with pytest.raises(ValidationError) as e:
        AppConfig.model_validate(_cfg(**bad))
    assert needle in str(e.value)


def test_autoscaling_config_is_typed_and_goes_to_serve_as_written():
    """Serve's keys, as YAML writes them, pass through unchanged; a misspelt key or reversed bounds is refused at
    startup, not left for Serve (or nobody) to notice."""
    from ray.serve.config import AutoscalingConfig

    scaling = {"min_replicas": 0, "max_replicas": 3, "upscale_delay_s": 2.0, "aggregation_function": "max"}
    cfg = AppConfig.model_validate(_cfg(drafters=[{"name": "code", "model": "a",
                                                   "deployment": {"autoscaling_config": scaling}}]))
    opts = cfg.drafters[0].deployment.serve_options()
    assert opts["autoscaling_config"] == scaling and "num_replicas" not in opts
    AutoscalingConfig(**opts["autoscaling_config"])  # Serve takes it
    for bad, needle in (({"max_replica": 2}, "max_replica"), ({"min_replicas": 3, "max_replicas": 2}, "<=")):
        with pytest.raises(ValidationError, match=needle):
            AppConfig.model_validate(_cfg(drafters=[{"name": "code", "model": "a",
                                                     "deployment": {"autoscaling_config": bad}}]))


def test_a_probe_backoff_cap_below_the_base_rate_is_refused():
    spec = {"mode": "cosine", "controller": {"participation_probe": 64, "participation_probe_max": 32}}
    with pytest.raises(ValidationError, match="participation_probe_max"):
        AppConfig.model_validate(_cfg(speculation=spec))
    spec["controller"]["participation_probe_max"] = 64  # equal: no backoff
    assert AppConfig.model_validate(_cfg(speculation=spec)).speculation.controller.participation_probe_max == 64


def test_shipped_serve_configs_validate_against_both_schemas():
    from pathlib import Path

    import yaml
    from ray.serve.schema import ServeDeploySchema

    root = Path(__file__).resolve().parent.parent
    for name in ["cluster.yaml", *(p.relative_to(root) for p in sorted((root / "examples").glob("*.yaml")))]:
        doc = yaml.safe_load((root / name).read_text())
        ServeDeploySchema.model_validate(doc) if hasattr(ServeDeploySchema, "model_validate") \
            else ServeDeploySchema.parse_obj(doc)
        for app in doc["applications"]:
            assert app["import_path"] == "serve_app.graph:build_app"
            AppConfig.model_validate(app["args"])


def test_the_config_reference_in_docs_is_current():
    from config import reference_markdown
    from model_family.paths import REPO_ROOT

    doc = (REPO_ROOT / "docs" / "config.md").read_text()
    assert doc.strip() == reference_markdown().strip(), "regenerate: cosine config docs > docs/config.md"
    for tunable in ("speculation.controller", "probe_interval", "drafter_timeout_ms", "generalist_margin"):
        assert tunable in doc


def test_the_speculation_modes_are_the_strategies_names():
    """One list of modes (config.SpeculationMode): each but off names a drafting strategy, and a request chooses
    among some of them (config.RequestMode), which the API and the loop's messages take from there."""
    from typing import get_args

    from config import RequestMode, SpeculationMode
    from speculation.strategies import STRATEGIES

    modes = set(get_args(SpeculationMode))
    assert modes - {"off"} <= set(STRATEGIES) and "off" not in STRATEGIES
    assert set(get_args(RequestMode)) <= modes - {"off"}
