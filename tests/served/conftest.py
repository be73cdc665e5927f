"""One served graph for every module of this package: the application on a local Ray cluster, started once (a
package-scoped fixture, torn down after the package's last test) because each start costs about a minute of the
suite. The modules only send requests, except tests/served/test_serve_faults.py, which kills and stops replicas and
checks that serving resumes: it runs last.

The graph runs with the small target (the bench target would only make the suite slower) verified in vLLM, as
examples/local.yaml does, every domain drafter and the generalist deployed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from model_family import DOMAINS

MODEL = "cosine-target"
METRICS: dict[str, int] = {}  # the port of Ray's metrics agent (Prometheus text format)
LAST = "test_serve_faults.py"


def app_config() -> dict:
    return {
        "ingress": {"model_name": MODEL, "max_queued_requests": 6},
        "verifier": {"engine": "vllm", "model": "target", "max_batch": 8, "max_len": 512, "kv_cache_gib": 1},
        "speculation": {"mode": "cosine", "k": 4, "tree_budget": 8, "draft_timeout_ms": 2000},
        "drafters": [{"name": d, "model": f"drafter-{d}"} for d in DOMAINS]
        + [{"name": "generic", "model": "drafter-generic", "generalist": True}],
    }


def pytest_collection_modifyitems(items):
    """The fault tests after every other test of this package, in the package's own places in the run (so the
    package's tests stay together and share one server); nothing else moves."""
    here = Path(__file__).parent
    places = [i for i, item in enumerate(items) if item.path.parent == here]
    ours = sorted((items[i] for i in places), key=lambda item: item.path.name == LAST)
    for i, item in zip(places, ours):
        items[i] = item


@pytest.fixture(scope="package")
def server():
    from tests.conftest import free_port, local_serve

    METRICS["port"] = free_port()
    # the Serve actors run as under `cosine serve` (make run)
    with local_serve(app_config(), _metrics_export_port=METRICS["port"]) as url:
        yield url
