"""Every result under bench_results/ says where it came from, by value: the full hash of a commit in this
repository's history, a clean tree, a date with its time, the machine, the package versions, and the command that
wrote that very file (benchmarks/provenance.py), as every `cosine bench` and `cosine simulate` writer records them.

Exempt, and only these: files under bench_results/history/, runs of earlier code or of a dirty tree, and blocks typed
by hand after a run (docs/benchmarks-history.md and bench_results/history/README.md say which). Fast (reads JSON;
one `git cat-file` per commit); no marks."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from benchmarks.metrics import save_json
from benchmarks.provenance import FIELDS, known_commit, missing_fields, provenance

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench_results"
HISTORY = RESULTS / "history"


def _results() -> list[Path]:
    return sorted(p for p in RESULTS.rglob("*.json") if HISTORY not in p.parents)


def test_every_result_records_where_it_came_from():
    lacking = {}
    for p in _results():
        name = p.relative_to(ROOT).as_posix()
        problems = missing_fields(json.loads(p.read_text()), name)
        if problems:
            lacking[name] = problems
    assert not lacking, ("results without their provenance (write them with a cosine bench / simulate command from "
                         "a clean tree, or move a run of earlier code to bench_results/history/):\n"
                         + "\n".join(f"{n}: {'; '.join(m)}" for n, m in lacking.items()))


def test_every_results_commit_is_in_this_repositorys_history():
    commits = {json.loads(p.read_text())["provenance"]["commit"] for p in _results()}
    if known_commit("HEAD") is None:
        pytest.skip("no git history to look the commits up in (a shallow clone, or not a git checkout)")
    unknown = sorted(c for c in commits if not known_commit(c))
    assert not unknown, f"results written at commits this repository does not have: {unknown}"


def _good() -> dict:
    """A block as a clean run of `cosine bench rounds --json bench_results/r.json` at this checkout writes it."""
    return dict(provenance(), dirty=False, commit="0" * 40, command="cosine bench rounds --json bench_results/r.json")


@pytest.mark.parametrize("change,problem", [
    ({"dirty": True}, "dirty"),
    ({"dirty": None}, "dirty"),
    ({"commit": "4d2669e"}, "commit"),
    ({"commit": None}, "commit"),
    ({"date": "2026-11-27"}, "date"),
    ({"date": "2026-11-27T10:00:00"}, "date"),
    ({"machine": {"cpu": None, "logical_cores": None, "gpu": "NVIDIA H200"}}, "machine.cpu"),
    ({"versions": {"python": None, "torch": "2.11.0", "transformers": "5.17.0", "vllm": None, "ray": None}},
     "versions.python"),
    ({"command": "cosine bench rounds"}, "does not write"),
    ({"command": "cosine bench rounds --json bench_results/other.json"}, "does not write"),
    ({"command": "bench.py rounds --json bench_results/r.json"}, "not a cosine"),
    ({"command": ""}, "not a cosine"),
])
def test_a_null_dirty_short_or_hand_typed_block_is_caught(change, problem):
    assert missing_fields({"provenance": _good()}, "bench_results/r.json") == []
    found = missing_fields({"provenance": {**_good(), **change}}, "bench_results/r.json")
    assert any(problem in m for m in found), found


def test_the_h200_runs_hand_typed_blocks_are_caught():
    """The two H200 runs' blocks, typed after the run, are what the check exists for (they live in the history)."""
    for name in ("engine-h200-9b-bf16-identity.json", "engine-h200-9b-fp32-identity.json"):
        found = missing_fields(json.loads((HISTORY / name).read_text()), f"bench_results/{name}")
        for problem in ("commit", "dirty", "date", "machine.cpu", "versions.python", "does not write"):
            assert any(problem in m for m in found), (name, problem, found)


def test_a_python_m_command_and_an_absolute_output_path_name_the_file():
    for command in ("python -m benchmarks.steps --json bench_results/r.json",
                    "cosine bench rounds --json=/home/u/repo/bench_results/r.json"):
        assert missing_fields({"provenance": dict(_good(), command=command)}, "bench_results/r.json") == []


def test_a_commit_outside_the_history_is_unknown():
    if known_commit("HEAD") is None:
        pytest.skip("no git history here (a shallow clone, or not a git checkout)")
    assert known_commit("HEAD") and not known_commit("f" * 40)


def test_a_benchmarks_json_carries_this_runs_provenance(tmp_path, monkeypatch):
    """What save_json writes (every cosine bench writer but steps, which adds it itself) has every field, the
    command as typed (the program by its name, not this machine's path to it), this checkout's commit, and the
    result itself unchanged beside it."""
    monkeypatch.setattr(sys, "argv", ["/some/where/bin/cosine", "bench", "rounds", "--json", "out file.json"])
    monkeypatch.setattr(sys, "orig_argv", ["/some/where/bin/python", *sys.argv])  # not `python -m pytest`'s own
    save_json({"rows": [1, 2]}, str(tmp_path / "r.json"))
    written = json.loads((tmp_path / "r.json").read_text())
    assert written["rows"] == [1, 2]
    # this checkout may have edits in progress: everything but `dirty` holds, and `dirty` says so
    assert [m for m in missing_fields(written, "out file.json") if "dirty" not in m] == []
    assert written["provenance"]["dirty"] is provenance()["dirty"]
    block = written["provenance"]
    assert block["command"] == "cosine bench rounds --json 'out file.json'"
    assert (ROOT / ".git").exists() <= (len(block["commit"] or "") == 40)
    assert block["machine"]["logical_cores"] >= 1 and block["versions"]["python"].count(".") == 2
    assert block["date"].endswith("+00:00")


def test_a_simulate_json_carries_it_too(tmp_path):
    from simulate.report import write_result

    write_result({"rows": []}, str(tmp_path / "s.json"))
    assert [m for m in missing_fields(json.loads((tmp_path / "s.json").read_text())) if "dirty" not in m
            and "command" not in m] == []


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
    assert block["commit"] is None and block["dirty"] is None
    assert {"commit", "dirty"} <= {k for k in ("commit", "dirty") for m in missing_fields({"provenance": block})
                                   if m.startswith(k)}, "a result from outside a checkout is no published result"


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
