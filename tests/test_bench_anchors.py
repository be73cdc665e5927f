"""`cosine bench anchors`: the pieces that decide what is compared (the runs themselves are benchmarks)."""

from pathlib import Path

import pytest
import yaml

from benchmarks import anchors
from benchmarks.sampled import Sampling
from benchmarks.workers import Worker
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


@pytest.mark.slow
def test_drafting_cost_columns_on_a_tiny_run(tmp_path, tokenizer, heldout):
    """The real workers (vLLM draft_model with the generic drafter and the sampling fix; ours in process, the pooled
    drafters of examples/bench.yaml) on two short prompts: each row's drafting cost present and positive, in the
    table too, and the two greedy outputs equal."""
    from model_family.bench_target import ensure_bench_target
    from model_family.paths import models_dir

    ensure_bench_target(models_dir())  # as `run` does: a fresh checkout has none
    greedy = Sampling()
    prompts = [tokenizer(heldout[d][0], add_special_tokens=False).input_ids[:24] for d in ("code", "legal")]
    # with the sampling fix a sampled run applies (greedy never meets the bugs it fixes): applied in the worker
    systems = {"vLLM draft_model, generic drafter": {"kind": "vllm", "draft": "generic", "fix_sampling": True},
               anchors.OURS: {"kind": "ours", "config": str(BENCH)}}
    runs = {}
    for i, (name, spec) in enumerate(systems.items()):
        worker = Worker(dict(spec, max_batch=2, k=3), tmp_path / f"{i}.log")
        try:
            worker.run(prompts[:1], 1, 4, ["code"], greedy.for_requests(1, 0))  # warm-up
            runs[name] = worker.run(prompts, 2, 16, ["code", "legal"], greedy.for_requests(2, 1))
        finally:
            worker.stop()
    reference = runs[anchors.OURS]["outputs"]
    assert runs["vLLM draft_model, generic drafter"]["outputs"] == reference
    rows = []
    for name, res in runs.items():
        res["tokens"] = sum(len(o) for o in res["outputs"])
        row = anchors._row(name, 2, [res], reference, tokenizer)
        assert row["draft_ms_per_drafted_token"] > 0 and row["draft_ms_per_round"] > 0
        # latency from each request's token arrivals: the first token after the prompt, later ones closer together
        assert 0 < row["itl_p99_ms"] and 0 < row["ttft_ms"]
        assert all(len(r["itl_s"]) >= 1 for r in res["latency"])
        rows.append(dict(row, speedup_vs_vllm_target_only=1.0))
    table = anchors.format_table({"rows": rows, "goals": {}})
    assert "drafting ms per drafted token" in table and "p99 inter-token ms" in table
    assert f"{rows[0]['draft_ms_per_drafted_token']:.2f}" in table


def test_sampled_rows_report_a_p_value_text_statistics_and_a_warning():
    """A sampled run: no token identity, each row's distribution test in the table, a failed one warned about."""
    def row(system, p, outputs):
        res = {"outputs": outputs, "tokens": sum(map(len, outputs)), "wall": 1.0, "seconds": [0.5] * len(outputs),
               "accepted": 0, "drafts": 0, "steps": None}
        r = anchors._row(system, 1, [res], [[9] * 8] * len(outputs), None, greedy=False)
        return r | {"speedup_vs_vllm_target_only": 1.0, "distribution_p": p}

    rows = [row(anchors.TARGET_ONLY, 0.41, [[1, 2, 3, 4, 1, 2, 3, 4], [5, 6, 7, 8, 9, 10, 11, 12]]),
            row("vLLM ngram", 1e-7, [[7] * 8, [7] * 8])]
    assert rows[0]["identical_to_vllm_target_only"] is None
    assert rows[0]["text"]["repeated_4gram_share"] == {"median": 0.1, "min": 0.0, "max": 0.2}
    result = {"config": {"sampling": Sampling(0.7, 0.95, 0).as_dict()}, "rows": rows, "goals": {},
              "warnings": ["vLLM ngram, concurrency 1: ..."]}
    table = anchors.format_table(result)
    assert "| p = 0.41 | 6 (4-8) | 0.10 (0.00-0.20) |" in table
    assert "| p = 1e-07 FAILED | 1 (1-1) | 0.80 (0.80-0.80) |" in table
    assert "- sampling: T = 0.7, top_p 0.95, seed 0" in table and "- WARNING: vLLM ngram" in table
    assert Sampling(0.7, 0.95, 3).for_requests(2, 1) == {"temperature": 0.7, "top_p": 0.95,
                                                           "seeds": [10_003, 10_004]}
