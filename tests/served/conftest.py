"""One served graph for every module of this package: the application on a local Ray cluster, started once (a
package-scoped fixture, torn down after the package's last test) because each start costs about a minute of the
suite. The modules only send requests, except tests/served/test_serve_faults.py, which kills and stops replicas and
checks that serving resumes: it runs last (ORDER).

The graph runs with the small target (the bench target would only make the suite slower) verified in vLLM, as
examples/local.yaml does, three domain drafters and the generalist deployed (enough to route between and to vote; each
more replica costs the graph's start seconds of both cores).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.served.api_cases import STRUCTURED_CONFIG, build_cases, vllm_reference

MODEL = "cosine-target"
SERVED_DOMAINS = ("code", "legal", "biomedical")  # the domain drafters deployed
METRICS: dict[str, int] = {}  # the port of Ray's metrics agent (Prometheus text format)
# the graph's tests read state the server learns (routing, vote weights) from their own requests: first; the fault
# tests kill and stop replicas: last
ORDER = ["test_serve_graph.py", "test_api_fields.py", "test_serve_faults.py"]


def app_config() -> dict:
    return {
        # vLLM's hermes tool-call parser and granite reasoning parser: their markers are plain text, which a
        # regex constraint makes the tiny target write (tests/served/test_api_fields.py)
        "ingress": {"model_name": MODEL, "max_queued_requests": 6, "tool_call_parser": "hermes",
                    "reasoning_parser": "granite"},
        "verifier": {"engine": "vllm", "model": "target", "max_batch": 8, "max_len": 512, "kv_cache_gib": 1,
                     "engine_kwargs": {"structured_outputs_config": STRUCTURED_CONFIG}},
        # drafts wait up to 8 s (0.8 x draft_timeout_ms) for their drafters: on a slow, shared machine a round
        # that ends earlier sends its drafters to sit out, and tests that expect drafting would see none
        # the guard off: the tests check that drafts flow, and on a shared 2-core CPU it may rightly find speculation
        # slower than plain decoding and switch it off (its own tests: tests/test_guard.py)
        "speculation": {"mode": "cosine", "k": 4, "tree_budget": 8, "draft_timeout_ms": 10000,
                        "guard": {"enabled": False}},
        "drafters": [{"name": d, "model": f"drafter-{d}"} for d in SERVED_DOMAINS]
        + [{"name": "generic", "model": "drafter-generic", "generalist": True}],
    }


def pytest_collection_modifyitems(items):
    """The package's modules in ORDER, in the package's own places in the run (so the package's tests stay
    together and share one server); nothing else moves."""
    here = Path(__file__).parent
    places = [i for i, item in enumerate(items) if item.path.parent == here]
    ours = sorted((items[i] for i in places), key=lambda item: ORDER.index(item.path.name))
    for i, item in zip(places, ours):
        items[i] = item


@pytest.fixture(scope="package")
def cases(tokenizer, heldout, target) -> dict:
    """tests/served/test_api_fields.py's requests: name -> (prompt ids, max_tokens, vLLM SamplingParams)."""
    return build_cases(tokenizer, heldout, target)


@pytest.fixture(scope="package")
def reference_run(models, cases):
    """vLLM target-only's answers to `cases`, computed in a process of its own while the graph starts (`server`
    starts it first): the suite's other worker finishes its modules before the Ray modules end, so work in parallel
    here takes cores that would otherwise wait."""
    with ThreadPoolExecutor(1) as pool:
        yield pool.submit(vllm_reference, models, cases)


@pytest.fixture(scope="package")
def reference(reference_run) -> dict:
    return reference_run.result()


@pytest.fixture(scope="package")
def server(reference_run):
    from tests.conftest import free_port, local_serve

    METRICS["port"] = free_port()
    # the Serve actors run as under `cosine serve` (make run)
    with local_serve(app_config(), _metrics_export_port=METRICS["port"]) as url:
        yield url
