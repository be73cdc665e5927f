"""`serve deploy` of the production graph shape onto a local multi-node Ray cluster.

Three Ray nodes on this machine stand in for the cluster of cluster.yaml, started with the custom resources it
asks for: a head "A100" node advertising `verifier_node` and two "RTX 3090" nodes advertising `drafter_node`. The
deployed config is cluster.yaml itself with the shipped small models (nothing can be downloaded here) and sizes for
this machine. Every replica must land on the right kind of node, and the application must answer.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

pytestmark = pytest.mark.slow
CLUSTER_YAML = Path(__file__).resolve().parent.parent / "cluster.yaml"


def _config(http_port: int) -> dict:
    """cluster.yaml with this project's small models and sizes for this machine: the shipped target in vLLM on
    CPU, the shipped drafters, no GPU or CPU counts (placement by the custom resources), one loopback proxy (every node of this
    cluster is this machine, so a proxy per node would bind one port three times)."""
    cfg = yaml.safe_load(CLUSTER_YAML.read_text())
    cfg["proxy_location"] = "HeadOnly"
    cfg["http_options"] = {"host": "127.0.0.1", "port": http_port}
    args = cfg["applications"][0]["args"]
    args["tokenizer"] = "tokenizer"
    args["verifier"].update(model="target", max_batch=4, max_len=256, tensor_parallel_size=1, kv_cache_gib=1,
                            engine_kwargs={})
    args["speculation"]["draft_timeout_ms"] = 5000  # this machine's CPU drafts far slower than a 3090
    for spec in [args["ingress"], args["speculation"], args["verifier"], *args["drafters"]]:
        options = spec["deployment"]["ray_actor_options"]
        options.pop("accelerator_type", None)
        options.update(num_gpus=0, num_cpus=0)  # 2 CPUs per node here: placement by the custom resources only
    for d in args["drafters"]:
        d.update(model=f"drafter-{d['name']}", max_len=256)
    return cfg


def test_serve_deploy_places_every_replica_on_its_kind_of_node(tmp_path):
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster
    from ray.util.state import list_actors

    from tests.conftest import RAY_TMP, free_port

    dash, http_port = free_port(), free_port()

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "resources": {"verifier_node": 1}, "include_dashboard": True, "dashboard_port": dash,
        "temp_dir": RAY_TMP})
    drafter_nodes = [cluster.add_node(num_cpus=2, resources={"drafter_node": 1}) for _ in range(2)]
    cluster.wait_for_nodes()
    cfg = tmp_path / "cluster-local.yaml"
    cfg.write_text(yaml.safe_dump(_config(http_port)))
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
        drafters = [d["name"] for d in _config(http_port)["applications"][0]["args"]["drafters"]]
        assert len(drafters) == 7
        for d in drafters:
            assert placed[f"Drafter-{d}"] and set(placed[f"Drafter-{d}"]) <= drafter_ids, d
        for name in ("Verifier", "Speculation"):  # the ingress replicas go wherever Serve puts them
            assert set(placed[name]) == {head_id}, name

        r = httpx.post(f"http://127.0.0.1:{http_port}/v1/completions", timeout=120,
                       json={"model": "deepseek-r1-distill-qwen-32b", "prompt": "def main():", "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0
    finally:
        try:
            serve.shutdown()
        except Exception:  # noqa: BLE001
            pass
        ray.shutdown()
        cluster.shutdown()
