"""`cosine bench anchors`: the pieces that decide what is compared (the runs themselves are benchmarks)."""

import subprocess
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import yaml

from assembly.drafter_server import DrafterServer
from benchmarks import anchor_notes, anchors, common, turns
from benchmarks.repeated import repeated_prompts, workload_stats
from benchmarks.sampled import Sampling
from benchmarks.worker_handle import Worker
from benchmarks.workers import BENCH_TENANT, forget_outputs, suffix_unavailable
from config import AppConfig, DrafterSpec
from speculation.messages import DrafterCall
from tests.conftest import free_port

BENCH = Path(__file__).resolve().parent.parent / "examples" / "bench.yaml"
MODEL_FREE = BENCH.with_name("bench-model-free.yaml")


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
    assert goals[f"{anchors.OURS} / best built-in vLLM method, concurrency 8"] == round(150 / 180, 3)
    assert goals[f"{anchors.OURS} / vLLM target-only, concurrency 8"] == round(150 / 160, 3)
    # vLLM suffix is a built-in method too; ours with the model-free drafters has goals of its own
    rows += [row(anchors.SUFFIX, 1, 150), row(anchors.OURS_MF, 1, 165), row(anchors.OURS_MF, 8, 170)]
    goals = anchors._goals(rows, (1, 8))
    assert goals[f"{anchors.OURS} / best built-in vLLM method, concurrency 1"] == round(132 / 150, 3)
    assert goals[f"{anchors.OURS_MF} / best built-in vLLM method, concurrency 1"] == 1.1
    assert goals[f"{anchors.OURS_MF} / vLLM target-only, concurrency 8"] == round(170 / 160, 3)
    # vllm serve runs target-only: the served rows are read against it, and it is not a method to beat
    rows += [row(anchors.VLLM_SERVE, 1, 200), row(anchors.VLLM_SERVE, 8, 120), row(anchors.SERVED, 1, 27),
             row(anchors.SERVED, 8, 132)]
    goals = anchors._goals(rows, (1, 8))
    assert goals[f"{anchors.SERVED} / {anchors.VLLM_SERVE}, concurrency 1"] == round(27 / 200, 3)
    assert goals[f"{anchors.SERVED} / {anchors.VLLM_SERVE}, concurrency 8"] == 1.1
    assert goals[f"{anchors.OURS_MF} / best built-in vLLM method, concurrency 1"] == 1.1
    assert not any(k.startswith(anchors.OURS + " /") and "vllm serve" in k for k in goals)
    # vllm serve with its own speculation: a served anchor the served rows are read against, not a built-in method
    rows += [row(anchors.VLLM_SERVE_DRAFT, 1, 25), row(anchors.VLLM_SERVE_DRAFT, 8, 200)]
    goals = anchors._goals(rows, (1, 8))
    assert goals[f"{anchors.SERVED} / {anchors.VLLM_SERVE_DRAFT}, concurrency 1"] == round(27 / 25, 3)
    assert goals[f"{anchors.SERVED} / {anchors.VLLM_SERVE_DRAFT}, concurrency 8"] == round(132 / 200, 3)
    assert goals[f"{anchors.OURS_MF} / best built-in vLLM method, concurrency 1"] == 1.1


def test_repeats_rotate_the_order_and_ratios_pair_each_repeat():
    """Every system runs first at each concurrency in some repeat, and each ratio is taken repeat by repeat: a
    machine that slows between repeats (as target-only's 30 -> 20 below) does not move it."""
    plan = [(anchors.TARGET_ONLY, 1), (anchors.OURS, 1), (anchors.SERVED, 1), (anchors.TARGET_ONLY, 8),
            (anchors.OURS, 8)]
    orders = [common.rotated(plan, rep) for rep in range(3)]
    assert all(sorted(o) == sorted(plan) for o in orders)
    assert all([c for _, c in o] == [1, 1, 1, 8, 8] for o in orders)  # a concurrency's runs stay together
    assert {o[0][0] for o in orders} == {anchors.TARGET_ONLY, anchors.OURS, anchors.SERVED}
    assert {o[3][0] for o in orders} == {anchors.TARGET_ONLY, anchors.OURS}
    base = {"system": anchors.TARGET_ONLY, "concurrency": 1, "tokens_per_s_by_repeat": [30.0, 20.0, 25.0]}
    ours = {"system": anchors.OURS, "concurrency": 1, "tokens_per_s_by_repeat": [29.0, 19.6, 24.0]}
    p = common.paired(ours, base)
    assert p["by_repeat"] == [0.967, 0.98, 0.96] and (p["median"], p["min"], p["max"]) == (0.967, 0.96, 0.98)
    # the ratio of the medians would say 24 / 25 = 0.96; an older run without repeats has no pairing
    assert common.paired(ours, {"system": anchors.TARGET_ONLY, "tokens_per_s": 25.0}) is None
    line = anchor_notes.paired_line(dict(ours, paired_vs_vllm_target_only=p))
    assert line == (f"- {anchors.OURS} / vLLM target-only, concurrency 1, paired by repeat: 0.97x (0.96-0.98; "
                    "0.97, 0.98, 0.96)")

def test_the_model_free_configuration_is_the_bench_configuration_with_the_model_free_drafters():
    """examples/bench-model-free.yaml (ours' -model-free rows, and for users) differs from examples/bench.yaml by
    the n-gram and suffix drafters alone, and is valid (one schema: config/)."""
    plain = yaml.safe_load(BENCH.read_text())
    model_free = yaml.safe_load(MODEL_FREE.read_text())
    args = model_free["applications"][0]["args"]
    added = [d for d in args["drafters"] if d.get("kind") in ("ngram", "suffix")]
    assert sorted(d["kind"] for d in added) == ["ngram", "suffix"]
    args["drafters"] = [d for d in args["drafters"] if d not in added]
    assert model_free == plain
    cfg = AppConfig.model_validate(yaml.safe_load(MODEL_FREE.read_text())["applications"][0]["args"])
    assert {d.name for d in cfg.drafters if d.model_free} == {"ngram", "suffix"}


def test_the_cli_offers_every_system_and_workload_the_benchmark_has():
    from serve_app.cli import build_parser

    args = build_parser().parse_args(["bench", "anchors", "--workload", "repeated", "--systems", *anchors.SHORT])
    assert args.workload == "repeated" and args.model_free_config == str(MODEL_FREE.relative_to(BENCH.parent.parent))
    assert set(args.systems) == set(anchors.SHORT)
    assert build_parser().parse_args(["bench", "anchors"]).workload in anchors.WORKLOADS
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "anchors", "--workload", "nonsense"])


def test_served_configs_of_two_systems_do_not_overwrite_each_other(tmp_path):
    assert anchors._with_k(str(BENCH), 4, tmp_path) != anchors._with_k(str(MODEL_FREE), 4, tmp_path)


def test_the_table_names_the_workload_whether_it_copies_enough_and_a_system_not_run():
    rows = [dict(anchors._row(anchors.TARGET_ONLY, 1, [{"outputs": [[1, 2, 3, 4, 5]], "tokens": 5, "wall": 1.0,
                                                          "seconds": [1.0], "accepted": 0, "drafts": 0,
                                                          "steps": None}], [[1, 2, 3, 4, 5]], None),
                 speedup_vs_vllm_target_only=1.0)]
    stats = workload_stats([[1, 2, 3, 4, 5, 6]], [[1, 2, 3, 4, 5]])
    result = {"config": {"workload": "repeated"}, "workload": stats, "rows": rows, "goals": {},
              "unavailable": {anchors.SUFFIX: "arctic-inference is not installed"}}
    table = anchors.format_table(result)
    assert ("- workload: repeated context (benchmarks/repeated.py), the share of the target's output 4-grams its "
            "prompt holds: median 1.00 (1.00-1.00), enough") in table
    assert "- vLLM suffix: not run: arctic-inference is not installed" in table
    result["workload"] = workload_stats([[9, 9, 9, 9]], [[1, 2, 3, 4, 5]])
    assert "median 0.00 (0.00-0.00), NOT enough (below 0.3)" in anchors.format_table(result)
    result["config"]["workload"], result["workload"] = "heldout", {"distinct_tokens": {}}
    assert "- workload: held-out prompts to continue\n" in anchors.format_table(result) + "\n"
    del result["config"]["workload"]  # a JSON from before the workloads: no such line
    assert "- workload" not in anchors.format_table(result)


def test_the_repeated_workload_reaches_every_system_and_each_timed_run_starts_forgetting(monkeypatch, tokenizer):
    """`run` with `workload="repeated"`, its workers replaced by ones that copy their prompt: every system gets the
    repeated-context prompts, each timed run is preceded by forgetting (not the warm-up: it is forgotten after),
    and the JSON's workload block finds the copying."""
    calls, workers = [], []

    class Copying:
        def __init__(self, spec, log_path):
            self.name = spec.get("config") or str(spec)
            self.proc = subprocess.Popen(["sleep", "600"])
            workers.append(self)

        def run(self, prompts, concurrency, max_tokens, domains, sampling):
            # benchmarks/turns.py: the other systems are paused while this one runs
            assert all((psutil.Process(w.proc.pid).status() == psutil.STATUS_STOPPED) == (w is not self)
                       for w in workers)
            calls.append((self.name, "run", max_tokens, prompts))
            return {"outputs": [p[:max_tokens] for p in prompts], "seconds": [1.0] * len(prompts), "wall": 1.0,
                    "drafts": 0, "accepted": 0, "steps": None}

        def forget_outputs(self):
            calls.append((self.name, "forget"))
            return 0

        def stop(self):
            assert psutil.Process(self.proc.pid).status() != psutil.STATUS_STOPPED  # resumed before stopping
            self.proc.kill()
            self.proc.wait()

    monkeypatch.setattr(anchors, "Worker", Copying)
    monkeypatch.setattr(turns, "SETTLE_S", 0)
    result = anchors.run(per_domain=1, new_tokens=24, concurrencies=(1, 2), repeats=2, served=False,
                         only=("ngram", "ours-model-free"), workload="repeated", log=lambda *a: None)
    prompts = [ids for _, ids in repeated_prompts(tokenizer, 1, quote_len=64)]
    timed = [i for i, c in enumerate(calls) if c[1] == "run" and c[2] == 24]
    assert len(timed) == 3 * 2 * 2  # target-only, ngram and ours, at two concurrencies, twice
    assert all(calls[i][3] == prompts and calls[i - 1] == (calls[i][0], "forget") for i in timed)
    assert result["config"]["workload"] == "repeated" and result["workload"]["copies_enough"]
    assert result["workload"]["copied_4gram_share"]["median"] == 1.0
    assert str(MODEL_FREE.relative_to(BENCH.parent.parent)) in {c[0] for c in calls}


def test_forgetting_outputs_empties_the_suffix_drafters_tenant_trees_between_repeats():
    """The worker's `forget_outputs` on an in-process tier: a tenant's earlier output drafts a repeat of its prompt
    until forgotten, then the drafter has only the request's own context, as in the first repeat."""
    suffix = DrafterServer.from_spec(DrafterSpec(name="suffix", kind="suffix", max_len=512))
    ngram = DrafterServer.from_spec(DrafterSpec(name="ngram", kind="ngram", max_len=512))
    tier = SimpleNamespace(servers={"suffix": suffix, "ngram": ngram})
    prompt, output = [5, 6, 7], [11, 12, 13, 14, 15, 16]

    def repeat(rid: str) -> list[int]:
        """The prompt, what the drafter proposes after the output's first token, then the output to its end."""
        suffix.step([DrafterCall(rid, prompt, tenant=BENCH_TENANT)])
        chain = suffix.step([DrafterCall(rid, prompt + output[:1], steps=4, tenant=BENCH_TENANT)]).chains.get(rid, [])
        suffix.step([DrafterCall(rid, prompt + output, tenant=BENCH_TENANT)])
        suffix.release_later([rid]).result()
        return [p.token for p in chain]

    assert repeat("r1") == []  # nothing to copy: the context has no earlier occurrence of its end
    assert repeat("r2") == output[1:5]  # the first repeat's output
    assert forget_outputs(tier) == 2 and forget_outputs(tier) == 0
    assert repeat("r3") == []


@pytest.mark.slow
def test_drafting_cost_columns_on_a_tiny_run_and_a_worker_forgets_what_it_drafts_from(tmp_path, tokenizer, heldout):
    """The real workers (vLLM draft_model with the generic drafter and the sampling fix; ours in process, the pooled
    drafters of examples/bench-model-free.yaml: bench.yaml's and the model-free ones) on two short prompts: each row's
    drafting cost present and positive, in the table too, and the greedy outputs equal, `vllm serve` with its own
    draft_model speculation's too. Then ours on two
    repeated-context prompts: its model-free drafters remember a run's outputs and forget them when told, and the
    output stays the target's greedy output (one worker for both: each costs the suite half a minute to start)."""
    from model_family.bench_target import ensure_bench_target
    from model_family.paths import models_dir

    ensure_bench_target(models_dir())  # as `run` does: a fresh checkout has none
    greedy = Sampling()
    prompts = [tokenizer(heldout[d][0], add_special_tokens=False).input_ids[:24] for d in ("code", "legal")]
    # with the sampling fix a sampled run applies (greedy never meets the bugs it fixes): applied in the worker
    systems = {"vLLM draft_model, generic drafter": {"kind": "vllm", "draft": "generic", "fix_sampling": True},
               anchors.OURS_MF: {"kind": "ours", "config": str(MODEL_FREE)}}
    runs, temps, repeats = {}, [], []
    for i, (name, spec) in enumerate(systems.items()):
        worker = Worker(dict(spec, max_batch=2, k=3), tmp_path / f"{i}.log")
        temps.append(Path(worker.tmp))
        try:
            worker.run(prompts[:1], 1, 4, ["code"], greedy.for_requests(1, 0))  # warm-up
            runs[name] = worker.run(prompts, 2, 16, ["code", "legal"], greedy.for_requests(2, 1))
            if name == anchors.OURS_MF:
                repeats = _forgetting_runs(worker, tokenizer)
        finally:
            worker.stop()
    # `vllm serve` with its own draft_model speculation (the served anchor): streamed, its drafts read from its
    # Prometheus counters around the run
    served = common.VllmServe(free_port(), 2, 512, tmp_path / "vllm-serve.log", "generic", 3)
    temps.append(Path(served.tmp))
    try:
        served.run(prompts[:1], 1, 4, None)  # warm-up
        spec_run = served.run(prompts, 2, 16, None)
    finally:
        served.stop()
    assert not any(t.exists() for t in temps)  # a worker's temp files (vLLM's rendezvous file) go with it
    reference = runs[anchors.OURS_MF]["outputs"]
    assert runs["vLLM draft_model, generic drafter"]["outputs"] == reference
    assert spec_run["outputs"] == reference
    assert spec_run["drafts"] > 0 and 0 <= spec_run["accepted"] <= spec_run["draft_tokens"] <= 3 * spec_run["drafts"]
    spec_run["tokens"] = sum(len(o) for o in spec_run["outputs"])
    spec_row = anchors._row(anchors.VLLM_SERVE_DRAFT, 2, [spec_run], reference, tokenizer)
    assert spec_row["mean_accepted_length"] == round(1 + spec_run["accepted"] / spec_run["drafts"], 3)
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
    # ours reports what the guard let through: steps with drafts (some: it drafted), its verdicts, each load's
    ours = rows[1]
    assert 0 < ours["drafted_step_share"][0] <= 1 and ours["guard_switched_off"] == [0]
    assert rows[0]["drafted_step_share"] is None
    # a round's drafter forwards: some (the model drafters draft these prompts' rounds), within the round's time;
    # none for vLLM's
    assert ours["drafter_forwards_per_round"] > 0
    assert 0 < ours["draft_forward_ms_per_round"] < ours["draft_ms_per_round"]
    assert "draft_forward_ms_per_round" not in rows[0]
    assert f"{ours['drafter_forwards_per_round']:.2f} drafter forwards" in table
    assert f"{anchors.OURS_MF}, concurrency 2: steps with drafts per run" in table
    shares = ours["by_drafter"]  # which drafters the router chose, with each one's acceptance
    assert shares and sum(d["drafted_share"] for d in shares.values()) == pytest.approx(1, abs=0.01)
    assert all(0 <= d["accepted_rate"] <= 1 for d in shares.values())
    assert f"{anchors.OURS_MF}, concurrency 2: drafted tokens by drafter: " in table
    # forgetting: the same output in every run, each the full length
    assert repeats[0]["outputs"] == repeats[1]["outputs"] == repeats[2]["outputs"]
    assert all(len(o) == 24 for o in repeats[0]["outputs"])


def _forgetting_runs(worker: Worker, tokenizer) -> list[dict]:
    """Three greedy runs of two repeated-context prompts: the first, one after the worker forgot the first's outputs
    (two requests' worth; nothing left to forget after), and one that remembers the second's."""
    prompts = [ids for _, ids in repeated_prompts(tokenizer, 1, quote_len=24)][:2]
    greedy = Sampling().for_requests(2, 0)
    worker.forget_outputs()  # the drafting-cost runs' outputs
    runs = [worker.run(prompts, 1, 24, ["code", "legal"], greedy)]
    assert worker.forget_outputs() == 2 and worker.forget_outputs() == 0
    runs.append(worker.run(prompts, 1, 24, ["code", "legal"], greedy))
    runs.append(worker.run(prompts, 1, 24, ["code", "legal"], greedy))  # the outputs above remembered
    return runs


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


def test_a_served_row_reports_the_guard_from_the_servers_statistics_around_each_run():
    """`served_speculation`: what the in-process rows report of the guard, read from the served graph's speculation
    statistics before and after a run (the counts since start differenced, the verdicts by load as left)."""
    def stats(steps, drafted, off, by_batch):
        return {"steps_since_start": steps, "drafted_steps_since_start": drafted,
                "controller": {"guard": {"switched_off": off, "by_batch": by_batch}}}

    on, off = {"speculating": True}, {"speculating": False}
    runs = []
    for a, b in ((stats(10, 9, 0, {"1": on}), stats(110, 59, 1, {"1": on, "5-8": off})),
                 (stats(110, 59, 1, {"1": on, "5-8": off}), stats(310, 79, 3, {"1": off, "5-8": off}))):
        runs.append({"outputs": [[1] * 40], "tokens": 40, "wall": 1.0, "seconds": [1.0], "accepted": 0,
                     "drafts": 0, "steps": None} | common.served_speculation(a, b))
    row = anchors._row(anchors.SERVED, 8, runs, [[1] * 40], None, greedy=False)
    assert row["drafted_step_share"] == [0.5, 0.1] and row["guard_switched_off"] == [1, 2]
    assert anchor_notes.guard_line(row).endswith("steps with drafts per run 50%, 10%; speculation switched off 1, 2 "
                                                 "times per run by the guard; after the last run, by load: 1: off, "
                                                 "5-8: off")
    # no guard (configured off, or speculation off): nothing to report
    assert common.served_speculation({"controller": None}, {"controller": None}) == {}
    assert common.served_speculation(stats(1, 1, 0, {}) | {"controller": {}}, stats(2, 2, 0, {})) == {}


def test_a_served_row_reports_its_drafting_rounds_where_the_verifier_drafts_in_its_replica():
    """Colocated drafting: the rounds' seconds, forwards and participations, differenced around each run, give the
    served row the in-process rows' drafting figures; drafting in deployments of its own: none, and no error."""
    def stats(rounds, seconds, forwards, forward_s, parts):
        return {"rounds": rounds, "step_seconds": seconds, "drafter_forwards_since_start": forwards,
                "drafter_forward_s_since_start": forward_s, "by_participation_since_start": parts}

    got = common.served_speculation(stats(5, 0.5, 10, 0.25, {"1": 4, "2 fused": 1}),
                                    stats(105, 2.5, 310, 1.75, {"1": 84, "2 fused": 1, "1 generalist": 20}))
    assert got == {"draft_s": 2.0, "draft_rounds": 100, "drafter_forwards": 300, "draft_forward_s": 1.5,
                   "by_participation": {"1": 80, "1 generalist": 20}}
    run = {"outputs": [[1] * 40], "tokens": 40, "wall": 1.0, "seconds": [1.0], "accepted": 30, "drafts": 10,
           "draft_tokens": 40, "steps": 12}
    row = anchors._row(anchors.SERVED, 8, [run | got], [[1] * 40], None)
    assert (row["draft_ms_per_round"], row["draft_ms_per_drafted_token"]) == (20.0, 50.0)
    assert anchor_notes.rounds_line(row).endswith("a drafting round 20.00 ms: 3.00 drafter forwards taking 15.00 ms, "
                                                  "host work 5.00 ms")
    assert anchor_notes.participation_line(row).endswith("requests' rounds by participation: 1 80%, 1 generalist 20%")
    remote = anchors._row(anchors.SERVED, 8, [run], [[1] * 40], None)  # drafting tier: deployments
    assert remote["draft_ms_per_round"] is None and remote["draft_ms_per_drafted_token"] is None


@pytest.mark.slow
def test_vllm_suffix_forgets_the_outputs_it_drafts_from_between_repeats(tmp_path, tokenizer, monkeypatch):
    """The real vLLM suffix worker (arctic-inference from `make vllm-suffix`) on two repeated-context prompts, greedy:
    it remembers a run's outputs, forgets them when told, then drafts as in its first run, and writes the target's
    greedy output. The arctic-inference plugin is enabled, and would refuse this vLLM version if it were loaded: it
    is not. (Ours with the model-free drafters: the drafting-cost test above.)"""
    from model_family.bench_target import ensure_bench_target
    from model_family.paths import models_dir

    if suffix_unavailable():
        pytest.skip(suffix_unavailable())
    monkeypatch.setenv("ARCTIC_INFERENCE_ENABLED", "1")
    ensure_bench_target(models_dir())
    spec = anchors._systems(False, str(BENCH), str(MODEL_FREE))[anchors.SUFFIX]
    worker = Worker(dict(spec, max_batch=2, k=4), tmp_path / "worker.log")
    try:
        runs = _forgetting_runs(worker, tokenizer)
    finally:
        worker.stop()
    assert runs[0]["outputs"] == runs[1]["outputs"] == runs[2]["outputs"]
    assert all(len(o) == 24 for o in runs[0]["outputs"])
    assert runs[1]["accepted"] == runs[0]["accepted"] < runs[2]["accepted"]


def test_the_drafters_line_says_how_the_model_free_confidences_were_scaled():
    row = {"system": anchors.OURS_MF, "concurrency": 8, "model_free_calibration": {"suffix": 0.31},
           "by_drafter": {"suffix": {"drafted_share": 0.43, "accepted_rate": 0.15}}}
    line = anchor_notes.drafters_line(row)
    assert "suffix 43% (0.15 accepted)" in line and "scaled by suffix 0.31" in line
    assert "scaled" not in anchor_notes.drafters_line(dict(row, model_free_calibration=None))


def test_a_rows_participations_are_summed_over_its_runs_and_said_as_shares():
    """What the goodput controller chose (issue 58's closing note): each run's requests' rounds per participation,
    summed over the row's runs; a participation no run used is not listed."""
    runs = [{"by_participation": {"1 generalist": 30, "1": 10}}, {"by_participation": {"1": 20, "2 lockstep": 20}},
            {}]
    counts = anchor_notes.summed([r.get("by_participation") or {} for r in runs])
    assert counts == {"1": 30, "1 generalist": 30, "2 lockstep": 20}
    assert anchor_notes.summed([{}, {}]) is None
    line = anchor_notes.participation_line({"system": anchors.OURS, "concurrency": 8, "by_participation": counts})
    assert line.endswith("requests' rounds by participation: 1 generalist 38%, 1 38%, 2 lockstep 25%"), line


def test_the_in_verifier_layout_runs_only_where_named_and_is_served_so(tmp_path):
    import yaml

    systems = anchors._systems(True, "examples/bench.yaml", "examples/bench-model-free.yaml")
    by_default, _ = anchors._chosen(systems, None, print)
    assert anchors.SERVED in by_default and not {anchors.SERVED_IV, anchors.SERVED_HAP} & set(by_default)
    named, _ = anchors._chosen(systems, ("served", "served-in-verifier"), print)
    assert set(named) == {anchors.TARGET_ONLY, anchors.SERVED, anchors.SERVED_IV}
    plain, iv = (yaml.safe_load(open(anchors._with_k("examples/bench.yaml", 8, tmp_path, flag)))["applications"][0]
                 ["args"] for flag in (False, True))
    assert plain["speculation"]["k"] == iv["speculation"]["k"] == 8
    assert not plain["ingress"].get("in_verifier") and iv["ingress"]["in_verifier"] is True
    # served-haproxy: the same in-verifier layout, its server started with `--haproxy`
    assert systems[anchors.SERVED_HAP] == {**systems[anchors.SERVED_IV], "haproxy": True}
