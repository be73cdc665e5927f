"""The operator's files in ops/: Prometheus alert rules (checked and unit-tested with promtool, Debian's
prometheus package, which `make setup` installs) and the Grafana dashboard (its queries run against a real
Prometheus scraping a served graph in tests/served/test_serve_graph.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import yaml

OPS = Path(__file__).resolve().parent.parent / "ops"
RULES = OPS / "prometheus" / "alerts.yml"
DASHBOARD = OPS / "grafana" / "cosine.json"


def _promtool(*args: str) -> subprocess.CompletedProcess:
    tool = shutil.which("promtool")
    assert tool, "promtool missing: `make setup` installs Debian's prometheus package"
    return subprocess.run([tool, *args], capture_output=True, text=True, timeout=120, cwd=RULES.parent)


def test_alert_rules_are_valid_and_cover_what_operators_are_paged_for():
    run = _promtool("check", "rules", str(RULES))
    assert run.returncode == 0, run.stdout + run.stderr
    alerts = {r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]}
    assert {"CosineAcceptanceCollapsed", "CosineDrafterDown", "CosineVerifierSaturated",
            "CosineSpeculationOffForLong"} <= alerts


def test_alert_rules_fire_on_their_conditions_and_only_then():
    run = _promtool("test", "rules", "alerts_test.yml")
    assert run.returncode == 0, run.stdout + run.stderr
    tested = {t["alertname"] for case in yaml.safe_load((RULES.parent / "alerts_test.yml").read_text())["tests"]
              for t in case["alert_rule_test"]}
    rules = {r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]}
    assert tested == rules  # every rule has a unit test


def dashboard_queries() -> list[str]:
    return [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p["targets"]]


def test_dashboard_is_importable_grafana_json():
    dash = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) and dash["uid"]
    assert {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus"} in \
        dash["templating"]["list"]
    for p in dash["panels"]:
        assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]
    # the alerts' series are on the dashboard too
    assert any("ALERTS" in q for q in dashboard_queries())
