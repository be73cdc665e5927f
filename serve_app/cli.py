"""The `cosine` command line."""

from __future__ import annotations

import argparse
import sys

from model_family.paths import REPO_ROOT
from model_family.sources import ModelUnavailable
from serve_app.commands import bench, config, generate, models, serve
from simulate.report import add_parser as add_simulate

# What a user can fix, refused by the project's code: a model that cannot be had or does not fit the target (or an
# engine), a bad configuration or option value (ValueError, pydantic's ValidationError among them), a missing file.
REFUSALS = (ModelUnavailable, ValueError, FileNotFoundError)


class _Parser(argparse.ArgumentParser):
    """argparse's, with a bad command line refused in one line (the usage is one --help away)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="cosine", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    for group in (generate, models, serve, config, bench):  # serve: also profile and package
        group.add_parser(sub)
    add_simulate(sub, str(REPO_ROOT / "examples" / "local.yaml"))
    return p


def refusal(e: BaseException) -> str:
    """The refusal as one line: a configuration's problems each by its field, any other message's lines joined."""
    from pydantic import ValidationError

    if isinstance(e, ValidationError):
        problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'config'}: {err['msg']}" for err in e.errors())
        return f"invalid configuration: {problems}"
    return "; ".join(line.strip() for line in str(e).splitlines() if line.strip()) or type(e).__name__


def main(argv: list[str] | None = None) -> int:
    """A command's failure that the user can fix is one line on stderr and exit status 2 (argparse's, for a bad
    command line), not a traceback."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except REFUSALS as e:
        print(f"cosine: error: {refusal(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
