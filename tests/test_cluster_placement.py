"""`serve deploy cluster.yaml` onto a local multi-node Ray cluster, with the models by their hub ids.

Three Ray nodes on this machine stand in for the cluster of cluster.yaml, started with the custom resources it
asks for: a head "A100" node advertising `verifier_node` and two "RTX 3090" nodes advertising `drafter_node`. The
deployed config is cluster.yaml itself with only what a site changes: the model ids name this project's small models
(published under those ids in a Hugging Face cache the nodes share, offline: nothing can be downloaded here), the
runtime_env's zip is `cosine package`'s (at a path of this machine), and sizes fit this machine. Every replica must
land on the right kind of node, and the application must answer.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.helpers.hub_cache import offline_env, publish

pytestmark = pytest.mark.slow
CLUSTER_YAML = Path(__file__).resolve().parent.parent / "cluster.yaml"
# the shipped model that stands in for each id of cluster.yaml
STAND_INS = {"deepseek-ai/DeepSeek-R1-Distill-Qwen-32B": "target", "Qwen/Qwen2.5-Coder-0.5B": "drafter-code",
             "Qwen/Qwen2.5-Math-1.5B": "drafter-techdocs", "Qwen/Qwen2.5-0.5B-Instruct": "drafter-dialogue",
             "Qwen/Qwen2.5-0.5B": "drafter-generic"}


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
    args["speculation"]["draft_timeout_ms"] = 5000  # this machine's CPU drafts far slower than a 3090
    for spec in [args["ingress"], args["speculation"], args["verifier"], *args["drafters"]]:
        options = spec["deployment"]["ray_actor_options"]
        options.pop("accelerator_type", None)
        options.update(num_gpus=0, num_cpus=0)  # 2 CPUs per node here: placement by the custom resources only
    return cfg


def test_serve_deploy_places_every_replica_on_its_kind_of_node(tmp_path, monkeypatch):
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster
    from ray.util.state import list_actors

    from model_family.paths import models_dir
    from serve_app.ray_start import start_with_retry
    from tests.conftest import RAY_TMP, free_port, stop_ray

    dash, http_port = free_port(), free_port()
    cache = tmp_path / "hub"
    for repo_id, shipped in STAND_INS.items():
        publish(cache, repo_id, models_dir() / shipped)
    package = tmp_path / "cosine-serve.zip"
    subprocess.run([sys.executable, "-m", "serve_app.cli", "package", "--out", str(package)], check=True,
                   capture_output=True, timeout=120)
    config = _config(http_port, package)
    ids = {d["model"] for d in config["applications"][0]["args"]["drafters"]}
    assert ids | {config["applications"][0]["args"]["verifier"]["model"]} == set(STAND_INS)
    monkeypatch.setenv("COSINE_MODELS_DIR", str(tmp_path / "no-shipped-models"))  # ids only, from the cache
    for key, value in offline_env(cache).items():  # every node (started below) inherits them
        monkeypatch.setenv(key, value)

    def start() -> tuple[Cluster, list]:
        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 2, "resources": {"verifier_node": 1}, "include_dashboard": True, "dashboard_port": dash,
            "temp_dir": RAY_TMP})
        drafter_nodes = [cluster.add_node(num_cpus=2, resources={"drafter_node": 1}) for _ in range(2)]
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
        assert len(drafters) == 4
        for d in drafters:
            assert placed[f"Drafter-{d}"] and set(placed[f"Drafter-{d}"]) <= drafter_ids, d
        for name in ("Verifier", "Speculation"):  # the ingress replicas go wherever Serve puts them
            assert set(placed[name]) == {head_id}, name

        r = httpx.post(f"http://127.0.0.1:{http_port}/v1/completions", timeout=120,
                       json={"model": "deepseek-r1-distill-qwen-32b", "prompt": "def main():", "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0
    finally:
        stop_ray()
        cluster.shutdown()  # every node, Serve's actors with them
