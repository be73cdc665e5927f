"""`cosine package`: this project's code as one zip, for the `runtime_env.working_dir` of a Serve config.

`serve deploy` takes only remote URIs there (http(s), s3, gs, file://...): it does not upload a local directory.
Ray unpacks such a zip on every node that runs a replica of the application (and for the controller that runs
the autoscaling policy) and puts its one top-level directory on the path, so the nodes need the project's
dependencies installed, not its code.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

from model_family.paths import REPO_ROOT

# the project's packages, every one (pyproject.toml's import-linter root_packages and setuptools' include list the
# same: tests/test_layers.py)
PACKAGES = ["config", "model_family", "engines", "speculation", "assembly", "deployments", "autoscale", "benchmarks",
            "simulate", "serve_app"]


def build_package(out: Path) -> Path:
    """Write the zip to `out` (a `.zip` file, or a directory to put `cosine-serve.zip` in); return its path."""
    out = Path(out)
    if out.suffix != ".zip":
        out = out / "cosine-serve.zip"
    out.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        for pkg in PACKAGES:
            for f in sorted((REPO_ROOT / pkg).rglob("*")):
                if f.is_file() and "__pycache__" not in f.parts and f.suffix != ".pyc":
                    z.write(f, Path("cosine-serve") / f.relative_to(REPO_ROOT))
    return out
