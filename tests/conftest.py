from __future__ import annotations

import gc
import os
import random
import shutil
import socket
import tempfile
import uuid
from contextlib import contextmanager
from pathlib import Path

# OpenMP workers that sleep as soon as their parallel region ends, rather than spin first (libgomp reads this when
# torch loads it, so it is set before `import torch`; Ray's processes and every subprocess inherit it). A serving
# process has its cores to itself and spins; the suite runs two workers, Ray clusters and vLLM engines on the same
# cores, where every spinning worker burns a core another process needs: the suite on two workers in one checkout on a
# 2-core AMD EPYC took 22:31 of pytest with spinning workers and 17:30 without (2026-11-30, 755 passed each).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# The suite's own processes run torch on one thread unless a test or an engine sets more (a thread's count is its own:
# engines/build.py `set_thread_torch_threads`): its models are tiny, two workers share two cores with Ray and vLLM,
# and a second thread only adds wake-ups. libgomp reads OMP_NUM_THREADS once, as torch loads it; the variable is
# restored after, so Ray's processes and every subprocess get the machine's defaults, as they would in production.
# tests/test_engines.py and tests/test_collaborative.py alone, on an idle 2-core AMD EPYC (2026-11-30): 156 CPU s and
# 128 s with two threads, 115 CPU s and 115 s with one.
_omp_threads = os.environ.get("OMP_NUM_THREADS")
os.environ["OMP_NUM_THREADS"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

if _omp_threads is None:
    del os.environ["OMP_NUM_THREADS"]
else:
    os.environ["OMP_NUM_THREADS"] = _omp_threads

# The suite owns every directory it writes: vLLM and torch.compile caches, Ray's temp dir (sessions, sockets and
# the ray_current_cluster address file, which Ray puts under $RAY_TMPDIR/ray), and Ray's auth token (given in the
# environment, so nothing is written to ~/.ray). All of it goes when the session ends; nothing is assumed to exist.
# So does whatever else this process and its children put in the temp dir (vLLM's rendezvous files vllm_dist_*,
# multiprocessing's pymp-* dirs, the benchmarks' log dirs, pytest's tmp_path), which suite runs left in /tmp before.
# The prefix is short: Ray's unix socket paths under it must stay within 107 bytes. pytest-xdist's workers import
# this module too, with the controller's TMPDIR; their dirs go beside the controller's, in the temp root it started
# with (handed down in the environment): nested inside it, Ray's socket paths passed 107 bytes in a fresh clone.
_ROOT = os.environ.setdefault("COSINE_TEST_TMP_ROOT", tempfile.gettempdir())
_CACHE = Path(tempfile.mkdtemp(prefix="cos-", dir=_ROOT))
(_CACHE / "t").mkdir()
os.environ["TMPDIR"] = tempfile.tempdir = str(_CACHE / "t")
os.environ["RAY_TMPDIR"] = str(_CACHE)
os.environ.setdefault("RAY_AUTH_MODE", "token")
os.environ.setdefault("RAY_AUTH_TOKEN", uuid.uuid4().hex)
os.environ.setdefault("VLLM_CACHE_ROOT", str(_CACHE / "vllm"))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(_CACHE / "inductor"))
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
RAY_TMP = str(_CACHE / "ray")  # Ray's default temp dir under RAY_TMPDIR

from model_family import DOMAINS  # noqa: E402
from model_family.paths import models_dir  # noqa: E402


def wait_until(pred, timeout: float = 60.0, interval: float = 0.5) -> bool:
    """Whether `pred()` became true within `timeout` seconds, asked every `interval` (tests wait on conditions)."""
    import time

    end = time.time() + timeout
    while time.time() < end:
        if pred():
            return True
        time.sleep(interval)
    return False


def free_port() -> int:
    """A free loopback port outside the kernel's ephemeral range.

    A port the kernel hands out for bind(0) is free only until the next ephemeral bind: a Ray cluster started
    after picking it opens dozens of sockets and may take it first. Ports below the ephemeral range (and above
    Ray's worker ports, 10002-19999) are only ever taken on purpose.
    """
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for port in random.sample(range(20000, low), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free loopback port below the ephemeral range")


def one_machine_app(drafting_tier: str, domains, draft_timeout_ms: int, model_name: str = "cosine-target") -> dict:
    """The application args of a one-machine graph: the small target in vLLM, the `domains`' drafters and the
    generalist, drafting on `drafting_tier`."""
    return {
        "ingress": {"model_name": model_name},
        "verifier": {"engine": "vllm", "model": "target", "max_batch": 8, "max_len": 512, "kv_cache_gib": 1},
        # the guard off: these graphs' tests check that drafts flow, and on a shared 2-core CPU it may rightly find
        # speculation slower than plain decoding and switch it off (its own tests: tests/test_guard.py)
        "speculation": {"mode": "cosine", "k": 4, "draft_timeout_ms": draft_timeout_ms,
                        "drafting_tier": drafting_tier, "guard": {"enabled": False}},
        "drafters": [{"name": d, "model": f"drafter-{d}"} for d in domains]
        + [{"name": "generic", "model": "drafter-generic", "generalist": True}],
    }


@contextmanager
def local_serve(app_args: dict, **ray_init):
    """The application on a local Ray cluster, its actors run as under `cosine serve`; yields its URL and shuts
    the cluster down after. `ray_init`: more `ray.init` arguments."""
    import ray
    from ray import serve

    from serve_app.graph import build_app
    from serve_app.launch import serve_env
    from serve_app.ray_start import start_with_retry

    port = free_port()
    with head_env(serve_env()):
        start_with_retry(lambda: ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
                                          _temp_dir=RAY_TMP, **ray_init))
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(app_args), name="cosine", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_ray()


@contextmanager
def head_env(env: dict[str, str]):
    """`env` in this process's environment while a Ray head starts (its raylet reads it, its workers inherit it), as
    `cosine serve` sets it; restored after."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def stop_ray() -> None:
    """Stop the local Ray cluster this driver started, Serve's actors with it (nothing is left: no process, no shared
    memory); `serve.shutdown()` before it would only wait for every replica's graceful stop (6-11 s a graph).

    Serve's driver-side client to its controller outlives the cluster, and Serve takes it for the next cluster's
    when the job ids match, which they do: every local cluster's first driver is job 01000000. `serve.status()` on
    the next cluster would then call a dead controller, so the cached client is dropped here (Serve's own
    `_disconnect`, which `serve.shutdown()` calls last)."""
    import ray
    from ray.serve import context

    ray.shutdown()
    context._disconnect()


# The modules that start a Ray cluster and a served graph, each taking both cores for a minute or more. `make test`
# runs the suite on two pytest-xdist workers: these modules one after another on one worker, the others meanwhile on
# the other, each module whole on one worker (its tests share its module-scoped engines and servers).
CLUSTER_MODULES = ("tests/served/", "tests/test_autoscaling_e2e.py", "tests/test_cluster_placement.py",
                   "tests/test_serve_haproxy.py",
                   "tests/test_serve_collaborative.py", "tests/test_serve_in_verifier.py",
                   "tests/test_serve_one_machine.py")


def scope_of(nodeid: str) -> str:
    """The unit `make test`'s scheduler hands a worker whole: every cluster module together, else the test's module."""
    path = nodeid.split("::", 1)[0]
    return "cluster modules" if path.startswith(CLUSTER_MODULES) else path


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    # xdist's own `--dist loadgroup` would do this from marks, but pytest 9.2 no longer lets a worker rename its
    # tests, which that mode relies on (pytest-xdist issue 1386): the tests ran ungrouped
    from xdist.scheduler import LoadScopeScheduling

    class ClusterModulesTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid)

    return ClusterModulesTogether(config, log)


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(_CACHE, ignore_errors=True)


@pytest.fixture(autouse=True, scope="module")
def _heap_unfrozen_after_each_module():
    """`build_loop` freezes the heap once its models are loaded (assembly/loop.py `freeze_startup_heap`), as a
    serving process should: it builds one loop. A test process builds dozens, and each frozen loop's reference cycles
    (its models, caches and engine) outlived it: one worker grew to 9.5 GB and the suite to 22.7 of 23.5 GB, where
    Ray's memory monitor starts killing the served graph's actors. After each module they go back to the collector."""
    yield
    gc.unfreeze()
    gc.collect()


@pytest.fixture(scope="session")
def models() -> Path:
    return models_dir()


@pytest.fixture(scope="session")
def tokenizer(models):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(models / "tokenizer")


@pytest.fixture(scope="session")
def target(models):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(models / "target", dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def heldout():
    from model_family.samples import heldout_texts

    return heldout_texts()


@pytest.fixture(scope="session")
def domain_prompt_ids(tokenizer, heldout) -> dict[str, list[list[int]]]:
    """Two held-out prompts per domain, 48 tokens each."""
    out = {}
    for d in DOMAINS:
        out[d] = [tokenizer(t, add_special_tokens=False).input_ids[:48] for t in heldout[d][:2]]
    return out
