"""`cosine bench anchors`: the pieces that decide what is compared (the runs themselves are benchmarks)."""

from pathlib import Path

import yaml

from benchmarks import anchors
from config import AppConfig

BENCH = Path(__file__).resolve().parent.parent / "examples" / "bench.yaml"


def test_with_k_changes_only_the_draft_length(tmp_path):
    path = anchors._with_k(str(BENCH), 8, tmp_path)
    original = yaml.safe_load(BENCH.read_text())
    changed = yaml.safe_load(Path(path).read_text())
    assert changed["applications"][0]["args"]["speculation"]["k"] == 8
    changed["applications"][0]["args"]["speculation"]["k"] = original["applications"][0]["args"]["speculation"]["k"]
    assert changed == original
    AppConfig.model_validate(yaml.safe_load(Path(path).read_text())["applications"][0]["args"])


def test_goals_compare_with_the_fastest_built_in_method():
    def row(system, c, tps):
        return {"system": system, "concurrency": c, "tokens_per_s": tps}

    rows = [row(anchors.TARGET_ONLY, 1, 30), row(anchors.ORACLE, 1, 120), row("vLLM ngram", 1, 70),
            row(anchors.OURS, 1, 132), row(anchors.TARGET_ONLY, 8, 160), row(anchors.ORACLE, 8, 180),
            row(anchors.OURS, 8, 150)]
    goals = anchors._goals(rows, (1, 8))
    assert goals[f"{anchors.OURS} / best built-in vLLM method, concurrency 1"] == 1.1
    assert goals[f"{anchors.OURS} / vLLM target-only, concurrency 8"] == round(150 / 160, 3)
