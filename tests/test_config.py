import pytest
from pydantic import ValidationError

from serve_app.config import AppConfig


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
])
def test_bad_configs_are_rejected_with_a_clear_message(bad, needle):
    with pytest.raises(ValidationError) as e:
        AppConfig.model_validate(_cfg(**bad))
    assert needle in str(e.value)
