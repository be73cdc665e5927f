"""The code's shape: one-way layers (the import-linter contracts in pyproject.toml) and no import cycles."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

from serve_app.package import PACKAGES

ROOT = Path(__file__).resolve().parent.parent


def test_every_package_is_layered_installed_and_packaged():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert sorted(project["tool"]["importlinter"]["root_packages"]) == sorted(PACKAGES)
    assert sorted(p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]) \
        == sorted(PACKAGES)
    on_disk = {p.parent.name for p in ROOT.glob("*/__init__.py") if p.parent.name != "tests"}
    assert on_disk == set(PACKAGES)


def test_import_contracts_are_kept():
    lint = Path(sys.executable).with_name("lint-imports")
    out = subprocess.run([str(lint), "--no-cache", "--no-logo"], capture_output=True, text=True,
                         cwd=ROOT)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout


def test_no_import_cycles():
    import grimp

    graph = grimp.build_graph(*PACKAGES)
    cycles = []
    for module in sorted(graph.modules):
        for dep in graph.find_modules_directly_imported_by(module):
            if dep != module and graph.chain_exists(importer=dep, imported=module):
                cycles.append(graph.find_shortest_chain(importer=dep, imported=module) + (dep,))
    assert not cycles, f"import cycles: {cycles[:5]}"
