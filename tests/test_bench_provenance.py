"""Every result under bench_results/ says where it came from: date, commit (and whether the tree was dirty), machine,
command line and package versions (benchmarks/provenance.py), as every `cosine bench` and `cosine simulate` writer
adds them.

Exempt, and only these: files under bench_results/history/, runs of earlier code written before the writers recorded
provenance: kept for the history's comparisons, one diagnostic run, and the GPU steps the simulator is calibrated on
until a GPU measures them again (docs/benchmarks-history.md, simulate/hardware.py say so). Fast (reads JSON); no
marks."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from benchmarks.metrics import save_json
from benchmarks.provenance import FIELDS, missing_fields, provenance

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench_results"
HISTORY = RESULTS / "history"


def _results() -> list[Path]:
    return sorted(p for p in RESULTS.rglob("*.json") if HISTORY not in p.parents)


def test_every_result_records_where_it_came_from():
    lacking = {p.relative_to(RESULTS).as_posix(): missing_fields(json.loads(p.read_text())) for p in _results()}
    lacking = {name: m for name, m in lacking.items() if m}
    assert not lacking, ("results without their provenance (write them with a cosine bench / simulate command, or "
                         "move a run of earlier code to bench_results/history/):\n"
                         + "\n".join(f"{n}: {', '.join(m)}" for n, m in lacking.items()))


def test_a_benchmarks_json_carries_this_runs_provenance(tmp_path, monkeypatch):
    """What save_json writes (every cosine bench writer but steps, which adds it itself) has every field, the
    command as typed (the program by its name, not this machine's path to it), this checkout's commit, and the
    result itself unchanged beside it."""
    monkeypatch.setattr(sys, "argv", ["/some/where/bin/cosine", "bench", "rounds", "--json", "out file.json"])
    save_json({"rows": [1, 2]}, str(tmp_path / "r.json"))
    written = json.loads((tmp_path / "r.json").read_text())
    assert written["rows"] == [1, 2] and missing_fields(written) == []
    block = written["provenance"]
    assert block["command"] == "cosine bench rounds --json 'out file.json'"
    assert (ROOT / ".git").exists() <= (len(block["commit"] or "") == 40)
    assert block["machine"]["logical_cores"] >= 1 and block["versions"]["python"].count(".") == 2
    assert block["date"].endswith("+00:00")


def test_a_simulate_json_carries_it_too(tmp_path):
    from simulate.report import write_result

    write_result({"rows": []}, str(tmp_path / "s.json"))
    assert missing_fields(json.loads((tmp_path / "s.json").read_text())) == []


@pytest.mark.parametrize("drop", FIELDS)
def test_a_result_missing_any_field_is_caught(drop):
    block = provenance()
    del block[drop]
    assert drop in missing_fields({"provenance": block})
    assert missing_fields({"rows": []}) == list(FIELDS)


def test_outside_a_git_checkout_the_commit_is_null(monkeypatch, tmp_path):
    import benchmarks.provenance as prov

    monkeypatch.setattr(prov, "REPO_ROOT", tmp_path)
    block = prov.provenance()
    assert block["commit"] is None and block["dirty"] is None and missing_fields({"provenance": block}) == []


def test_only_code_makes_a_checkout_dirty(monkeypatch, tmp_path):
    """Results and plots that earlier runs rewrote are outputs, not code: a run after them is not `dirty`."""
    import subprocess

    import benchmarks.provenance as prov

    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", *args], check=True,
                       capture_output=True)

    for name in ("bench_results/r.json", "docs/img/p.png", "benchmarks/code.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("0")
    git("init", "-q")
    git("add", ".")
    git("commit", "-qm", "c")
    monkeypatch.setattr(prov, "REPO_ROOT", tmp_path)
    (tmp_path / "bench_results/r.json").write_text("1")
    (tmp_path / "docs/img/p.png").write_text("1")
    assert prov.provenance()["dirty"] is False
    (tmp_path / "benchmarks/code.py").write_text("1")
    assert prov.provenance()["dirty"] is True
