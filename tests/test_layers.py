"""The code's shape: one-way layers (the import-linter contracts in pyproject.toml) and no import cycles."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

PACKAGES = ("config", "model_family", "engines", "speculation", "deployments", "autoscale", "serve_app", "benchmarks")


def test_import_contracts_are_kept():
    lint = Path(sys.executable).with_name("lint-imports")
    out = subprocess.run([str(lint), "--no-cache", "--no-logo"], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parent.parent)
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
