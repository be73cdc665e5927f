"""benchmarks/gpu_engine.sh, dry: the GPU run's every step on the CPU at a tiny size, so that the script cannot rot
before a GPU is lent. Its result has a row per method with drafting overlapping verification and without, output
equal to target-only's, the draft timeout as shipped, and the commit and dirty flag the caller passed in (.git does
not travel to the device machine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
METHODS = ("ours: chain, domain", "ours: chain, generic", "ours: chain, goodput", "full CoSine (routing")


@pytest.mark.slow  # a subprocess, over ~10 s
def test_the_gpu_script_runs_dry_on_the_cpu(tmp_path):
    commit = "0123456789abcdef" * 2 + "01234567"
    env = {**os.environ, "OUT": str(tmp_path), "DRY_RUN": "1", "PYTHON": sys.executable, "COSINE_COMMIT": commit,
           "COSINE_DIRTY": "1"}
    done = subprocess.run(["bash", "benchmarks/gpu_engine.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "engine-9b.json").read_text())
    assert result["provenance"]["commit"] == commit and result["provenance"]["dirty"] is True
    assert result["config"]["draft_timeout_ms"] is None and result["config"]["repeats"] == 1
    rows = {r["method"]: r for r in result["rows"]}
    for m in METHODS:
        for overlap in ("on", "off"):
            (name,) = [n for n in rows if m in n and n.endswith(f" [overlap {overlap}]")]
            assert rows[name]["identical_to_target"] and rows[name]["graph_captures"] == 0
    assert f"commit {commit}, dirty 1" in (tmp_path / "engine-9b.log").read_text()
