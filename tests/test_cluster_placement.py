"""`serve deploy cluster.yaml` onto a local multi-node Ray cluster, with the models by their hub ids, on models
that are not the shipped family.

Three Ray nodes on this machine stand in for the cluster of cluster.yaml, started with the custom resources it
asks for: a head "A100" node advertising `verifier_node` and two "RTX 3090" nodes advertising `drafter_node`. The
deployed config is cluster.yaml itself with only what a site changes: a drafter pinned to a revision, the runtime_env's
zip `cosine package`'s (at a path of this machine), sizes and timeouts for this machine's CPU. Every replica must
land on the right kind of node.

The ids name tiny random-weight checkpoints with this project's vocabulary, published under them in a Hugging Face
cache the nodes share, offline (nothing can be downloaded here): a Qwen3 target verified in vLLM, the same checkpoint
as the code drafter (the fast runner; its drafts are the target's, so they are accepted), and a GPT-NeoX drafter
(the transformers-backed runner) at a pinned revision. The site keeps two of cluster.yaml's four drafters and one
ingress replica (each replica's start costs this 2-core machine seconds of both cores). Greedy output through the
graph, streamed and not, must equal vLLM's target-only greedy output (the same verifier with speculation off for the
request), with drafts accepted.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.helpers.hub_cache import offline_env, publish
from tests.helpers.tiny_models import save_tiny

pytestmark = pytest.mark.slow
CLUSTER_YAML = Path(__file__).resolve().parent.parent / "cluster.yaml"
TARGET = "deepseek-ai/DeepSeek-R1-Distill-Qwen-32B"
# the checkpoint that stands in for each id of cluster.yaml; the NeoX drafter is published at a revision
STAND_INS = {TARGET: "qwen3", "Qwen/Qwen2.5-Coder-0.5B": "qwen3", "Qwen/Qwen2.5-Math-1.5B": "gpt_neox"}
KEPT = ("code", "math")  # the drafters the site deploys: one of each runner
REVISION = "v1"
NEW_TOKENS = 24


def _config(http_port: int, package: Path) -> dict:
    """cluster.yaml with sizes for this machine: vLLM on CPU, no GPU or CPU counts (placement by the custom
    resources), one loopback proxy (every node of this cluster is this machine, so a proxy per node would bind one
    port three times); the model ids as they are."""
    cfg = yaml.safe_load(CLUSTER_YAML.read_text())
    cfg["proxy_location"] = "HeadOnly"
    cfg["http_options"] = {"host": "127.0.0.1", "port": http_port}
    app = cfg["applications"][0]
    app["runtime_env"]["working_dir"] = package.as_uri()
    args = app["args"]
    args["verifier"].update(max_batch=4, max_len=256, tensor_parallel_size=1, kv_cache_gib=1, engine_kwargs={})
    # this machine's CPU drafts far slower than a 3090, and verifies the tiny target in milliseconds: drafts wait for
    # their time, not for a share of the verify step; every round drafts k (the controller would find drafting on
    # these CPUs not paying, and the guard switch it off: tests/test_guard.py), so drafts are checked
    args["speculation"].update(draft_timeout_ms=5000, draft_timeout_share=None, adaptive=False,
                               guard={"enabled": False})
    args["drafters"] = [d for d in args["drafters"] if d["name"] in KEPT]
    args["ingress"]["deployment"]["num_replicas"] = 1
    for spec in args["drafters"]:
        if STAND_INS[spec["model"]] == "gpt_neox":
            spec["model"] += f"@{REVISION}"
    for spec in [args["ingress"], args["speculation"], args["verifier"], *args["drafters"]]:
        options = spec["deployment"]["ray_actor_options"]
        options.pop("accelerator_type", None)
        options.update(num_gpus=0, num_cpus=0)  # 2 CPUs per node here: placement by the custom resources only
    return cfg


def _hub(cache: Path, work: Path, tokenizer_dir: Path) -> None:
    """The stand-ins published under cluster.yaml's ids in `cache`."""
    checkpoints = {"qwen3": save_tiny("qwen3", work / "qwen3", tokenizer_dir, seed=3),
                   "gpt_neox": save_tiny("gpt_neox", work / "neox", tokenizer_dir, seed=4)}
    for repo_id, kind in STAND_INS.items():
        publish(cache, repo_id, checkpoints[kind], revision=REVISION if kind == "gpt_neox" else "main")


def test_serve_deploy_places_every_replica_on_its_kind_of_node_and_serves_target_only_greedy(
        tmp_path, monkeypatch, models, tokenizer, heldout):
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster
    from ray.util.state import list_actors

    from serve_app.ray_start import start_with_retry
    from tests.conftest import RAY_TMP, free_port, stop_ray

    dash, http_port = free_port(), free_port()
    cache = tmp_path / "hub"
    _hub(cache, tmp_path / "tiny", models / "tokenizer")
    prompts = [tokenizer(heldout[d][3], add_special_tokens=False).input_ids[:40] for d in ("code", "legal")]
    package = tmp_path / "cosine-serve.zip"
    subprocess.run([sys.executable, "-m", "serve_app.cli", "package", "--out", str(package)], check=True,
                   capture_output=True, timeout=120)
    config = _config(http_port, package)
    ids = {d["model"].removesuffix(f"@{REVISION}") for d in config["applications"][0]["args"]["drafters"]}
    assert ids | {config["applications"][0]["args"]["verifier"]["model"]} == set(STAND_INS)
    monkeypatch.setenv("COSINE_MODELS_DIR", str(tmp_path / "no-shipped-models"))  # ids only, from the cache
    for key, value in offline_env(cache).items():  # every node (started below) inherits them
        monkeypatch.setenv(key, value)

    def start() -> tuple[Cluster, list]:
        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 2, "resources": {"verifier_node": 1}, "include_dashboard": True, "dashboard_port": dash,
            "temp_dir": RAY_TMP})
        # each node unpacks the package's working_dir into a directory of its own, as on separate machines: in the
        # session directory these nodes share, the drafter nodes unpacked it again while a head-node replica started
        # in it, and that replica's first process died ("Intel oneMKL FATAL ERROR: Cannot load libtorch_cpu.so")
        drafter_nodes = [cluster.add_node(num_cpus=2, resources={"drafter_node": 1},
                                          runtime_env_dir_name=f"runtime_resources_drafter_{i}") for i in range(2)]
        cluster.wait_for_nodes()
        return cluster, drafter_nodes

    cluster, drafter_nodes = start_with_retry(start)
    cfg = tmp_path / "cluster-local.yaml"
    cfg.write_text(yaml.safe_dump(config))
    try:
        serve_cli = str(Path(sys.executable).with_name("serve"))
        deployed = subprocess.run([serve_cli, "deploy", str(cfg), "--address", f"http://127.0.0.1:{dash}"],
                                  capture_output=True, text=True, timeout=180)
        assert deployed.returncode == 0, deployed.stderr[-2000:]
        ray.init(address=cluster.address)
        deadline = time.time() + 420
        while time.time() < deadline:
            apps = serve.status().applications
            if "cosine" in apps and apps["cosine"].status == "RUNNING":
                break
            time.sleep(2)
        assert serve.status().applications["cosine"].status == "RUNNING"

        head_id = cluster.head_node.node_id
        drafter_ids = {n.node_id for n in drafter_nodes}
        placed = {}
        for a in list_actors(filters=[("state", "=", "ALIVE")], limit=1000):
            if a.class_name and a.class_name.startswith("ServeReplica:cosine:"):
                placed.setdefault(a.class_name.split(":")[-1], []).append(a.node_id)
        drafters = [d["name"] for d in config["applications"][0]["args"]["drafters"]]
        assert drafters == list(KEPT)
        for d in drafters:
            assert placed[f"Drafter-{d}"] and set(placed[f"Drafter-{d}"]) <= drafter_ids, d
        for name in ("Verifier", "Speculation"):  # the ingress replicas go wherever Serve puts them
            assert set(placed[name]) == {head_id}, name

        _assert_target_only_greedy(f"http://127.0.0.1:{http_port}", config, prompts)
    finally:
        stop_ray()
        cluster.shutdown()  # every node, Serve's actors with them


def _assert_target_only_greedy(base: str, config: dict, prompts) -> None:
    """Each prompt's greedy output with speculation on, streamed and not, is the verifier's own with speculation off
    for the request (vLLM target-only decoding: one target pass per token, no drafts)."""
    from openai import OpenAI

    model = config["applications"][0]["args"]["ingress"]["model_name"]
    client = OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=300)
    accepted = []
    for ids in prompts:
        want = client.completions.create(model=model, prompt=ids, max_tokens=NEW_TOKENS, temperature=0,
                                         extra_body={"speculation": {"enabled": False}})
        assert want.usage.model_extra["num_draft_tokens"] == 0
        assert want.usage.model_extra["verify_steps"] == want.usage.completion_tokens
        out = client.completions.create(model=model, prompt=ids, max_tokens=NEW_TOKENS, temperature=0)
        assert out.choices[0].text == want.choices[0].text
        assert out.usage.completion_tokens == want.usage.completion_tokens
        accepted.append(out.usage.model_extra["mean_acceptance_length"])
        stream = client.completions.create(model=model, prompt=ids, max_tokens=NEW_TOKENS, temperature=0,
                                           stream=True)
        assert "".join(c.choices[0].text for c in stream if c.choices) == want.choices[0].text
    # the code drafter is the target itself: with speculation silently off every round would commit one token
    assert max(accepted) > 2.0, accepted
