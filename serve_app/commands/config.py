"""`cosine config ...`: the configuration schema (every tunable, with descriptions), and checking a config."""

from __future__ import annotations

import json
from pathlib import Path


def add_parser(sub) -> None:
    c = sub.add_parser("config", help="the configuration schema (every tunable, with descriptions)")
    csub = c.add_subparsers(dest="config_command", required=True)
    csub.add_parser("schema", help="JSON Schema of the Serve application's args").set_defaults(func=schema)
    csub.add_parser("docs", help="the Markdown reference (docs/config.md)").set_defaults(func=docs)
    cv = csub.add_parser("validate", help="validate a Serve config file's application args")
    cv.add_argument("file")
    cv.set_defaults(func=validate)


def schema(args) -> int:
    from config import AppConfig

    print(json.dumps(AppConfig.model_json_schema(), indent=2))
    return 0


def docs(args) -> int:
    from config import reference_markdown

    print(reference_markdown())
    return 0


def validate(args) -> int:
    """Every application's args, each ok or its problems (exit 1 where one fails)."""
    from pydantic import ValidationError

    from config import AppConfig
    from serve_app.launch import read_serve_config

    failed = 0
    for app in read_serve_config(Path(args.file))["applications"]:
        try:
            AppConfig.model_validate(app.get("args") or {})
            print(f"{app.get('name')}: ok")
        except ValidationError as e:
            failed += 1
            print(f"{app.get('name')}: {e}")
    return 1 if failed else 0
