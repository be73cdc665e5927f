"""`make test` runs the suite on two pytest-xdist workers with tests/conftest.py's scheduler: the modules that start
a Ray cluster one after another on one worker (two graphs starting at once would each take both cores), every other
module whole on one worker (its tests share its module-scoped engines and servers); every process of the suite writes
its temp files in a dir of its own, beside the others'; none of them imports scikit-learn, which no test uses."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from xdist.scheduler import LoadScopeScheduling

from tests.conftest import _CACHE, _ROOT, CLUSTER_MODULES, RAY_TMP, scope_of


def test_the_cluster_modules_share_one_scope_and_every_other_module_is_its_own():
    cluster = {scope_of(f"{m}::test_a[x]" if m.endswith(".py") else f"{m}test_graph.py::test_b")
               for m in CLUSTER_MODULES}
    assert len(cluster) == 1
    assert scope_of("tests/test_planner.py::test_a") == scope_of("tests/test_planner.py::test_b[1]")
    assert scope_of("tests/test_planner.py::test_a") != scope_of("tests/test_goodput.py::test_a")
    assert scope_of("tests/test_planner.py::test_a") not in cluster


def test_xdist_still_splits_scopes_where_the_scheduler_overrides_it():
    # pytest-xdist is pinned: its LoadScopeScheduling hands each scope of `_split_scope` to one worker; a version that
    # no longer calls it would spread the cluster modules over both workers, silently
    assert callable(vars(LoadScopeScheduling).get("_split_scope"))


def test_this_process_writes_its_temp_files_in_a_dir_of_its_own_beside_the_other_workers():
    # pytest-xdist's workers inherit the controller's TMPDIR; a worker's dir made inside the controller's pushed
    # Ray's socket paths past 107 bytes (91 errors in a fresh clone)
    assert _CACHE.parent == Path(_ROOT) and not any(p.name.startswith("cos-") for p in _CACHE.parents)
    assert tempfile.gettempdir() == os.environ["TMPDIR"] == str(_CACHE / "t")
    child = subprocess.run([sys.executable, "-c", "import tempfile; print(tempfile.gettempdir())"],
                           capture_output=True, text=True, check=True).stdout.strip()
    assert child == str(_CACHE / "t")
    # Ray's longest socket path under its temp dir: a session dir, then sockets/plasma_store
    assert len(f"{RAY_TMP}/session_2026-12-01_01-17-37_575436_4194304/sockets/plasma_store") <= 107


def test_loading_a_model_imports_no_scikit_learn():
    # lm-eval, a test dependency, brings scikit-learn; where it is installed, transformers imports it (and
    # scipy.stats) in every process that loads a model: 2-3 s of each Ray replica's start here. `make setup` removes it
    importlib.import_module("transformers.models.auto.modeling_auto")
    assert "sklearn" not in sys.modules
