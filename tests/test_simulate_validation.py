"""The simulator against committed measurements, and what each check does and does not show.

Out of sample (the fit never sees what is predicted):
- the paper verifiers' bandwidth and FLOPS shares fitted on one model's measured slices predict the other model's
  steps (bench_results/history/steps-h100.json);
- `cosine simulate validate --recorded` on the runs recorded on this machine (simulate/traces/inprocess-fixed): each
  repeat's concurrency-2 run predicted from the latency model fitted on its concurrency-1 and -4 runs only.
Within one run (held-out steps, not held-out conditions): a run predicted from the even half of its own steps and
drafting rounds; this checks the loop's mechanics given the step costs, not that the costs carry to another run.
In sample (goodness of fit only, no validation): the engine costs against the one-token steps they are fitted on
(bench_results/history/gpu-steps.json, transcribed from GPU runs whose raw JSON was not kept, and steps-h100.json's
drafters).
"""

from __future__ import annotations

import json

import pytest

from simulate import validation
from simulate.hardware import (BW_EFFICIENCY, ENGINE_COSTS, FLOPS_EFFICIENCY, GPU_STEPS, GPUS, MEASURED_STEPS, PROFILES,
                               SHAPES, DraftRound, calibration_file, fit, measured_efficiencies)
from speculation.trace import Trace

# a run predicted from the even half of its own steps: the largest error on the committed runs is 8.5%
IN_RUN_TOLERANCE = 0.10
# concurrency 2 predicted from the runs at 1 and 4 of the same repeat: the largest error on the committed runs is
# 12.6% (repeat 1); the simulation is deterministic, so the bound holds run after run. A verify slope twice the
# fitted one is off by up to 27.5%, drafting rounds 30% cheaper by up to 43%
ACROSS_RUNS_TOLERANCE = 0.15


def test_a_gpu_run_committed_with_its_provenance_replaces_the_history_copy(tmp_path):
    """The simulator reads its GPU calibration from bench_results/history/ (runs of earlier code) until a run of the
    same name is committed under bench_results/."""
    history = tmp_path / "bench_results" / "history"
    history.mkdir(parents=True)
    (history / "steps-h100.json").write_text("{}")
    assert calibration_file("steps-h100.json", tmp_path) == history / "steps-h100.json"
    (tmp_path / "bench_results" / "steps-h100.json").write_text("{}")
    assert calibration_file("steps-h100.json", tmp_path) == tmp_path / "bench_results" / "steps-h100.json"
    assert MEASURED_STEPS.parent.name == "history" and GPU_STEPS.parent.name == "history"  # none re-measured yet


def test_the_shapes_have_their_models_parameters():
    models = json.loads(GPU_STEPS.read_text())["models"]
    for name in ("bench-target", "drafter-generic"):
        assert SHAPES[name].params == models[name]["params"]
    assert SHAPES["qwen2.5-0.5b"].params == 494_032_768  # Qwen2.5-0.5B's published count
    assert round(SHAPES["llama-68m"].params / 1e6) == 68
    assert round(SHAPES["r1-distill-qwen-32b"].params / 1e9, 1) == 32.8
    assert round(SHAPES["r1-distill-llama-70b"].params / 1e9, 1) == 70.6


# the one-token steps the fitted engine costs miss by more than 10%: the 68M's graphed steps at batch 1-8 are not
# monotonic in the batch (0.33 / 0.37 / 0.31 / 0.40 ms), which no cost growing with the batch follows
MISSED_BY_THE_FIT = {("H100-SXM", True, "llama-68m", 2), ("H100-SXM", True, "llama-68m", 4),
                     ("H100-SXM", True, "llama-68m", 8), ("H200", True, "bench-target", 8)}


def test_the_calibration_reproduces_the_measured_one_token_steps():
    """In sample (goodness of fit, not validation): the drafter's kind of step (one token per request), which the
    engine costs are fitted on, within 10% on every device and mode except the rows named above, which stay within
    16% (a fit that gets worse anywhere, or better on a named row, fails); the 0.5B drafter's, which the paper-qwen
    profile rests on, within 8%; graphs make the engine's per-layer cost 8x smaller."""
    missed = set()
    for costs in ENGINE_COSTS.values():
        for p in costs.points:
            if p["new_tokens"] == 1:
                error = abs(p["model_ms"] / p["ms"] - 1)
                if error > 0.10:
                    missed.add((costs.gpu, costs.graphs, p["model"], p["batch"]))
                assert error <= (0.08 if p["model"] == "qwen2.5-0.5b" else 0.16), (costs.gpu, costs.graphs, p)
    assert missed == MISSED_BY_THE_FIT
    assert ENGINE_COSTS[("H200", False)].per_layer > 8 * ENGINE_COSTS[("H200", True)].per_layer
    assert ("H100-SXM", True) in ENGINE_COSTS and ENGINE_COSTS[("H100-SXM", True)].per_vocab_row > 0


def _verifier_slices(data: dict, model: str | None = None) -> list[dict]:
    return [s for s in data["steps"] if s["graphs"] and s.get("layers_run") and s["model"].startswith("r1-")
            and model in (None, s["model"])]


def _share_model_ms(s: dict, e_bw: float, e_flops: float) -> float:
    gpu = GPUS["H100-SXM"]
    read = SHAPES[s["model"]].read_params_at(s["layers_run"])
    return 1000 * (2 * read / (gpu.bandwidth_gbs * 1e9 * e_bw)
                   + 2 * read * s["tokens"] / (gpu.half_tflops * 1e12 * e_flops))


@pytest.mark.parametrize("fitted,predicted", [("r1-distill-llama-70b", "r1-distill-qwen-32b"),
                                              ("r1-distill-qwen-32b", "r1-distill-llama-70b")])
def test_the_bandwidth_and_flops_shares_of_one_verifier_predict_the_other(tmp_path, fitted, predicted):
    """Out of sample: the shares fitted on one paper verifier's measured slices (graphed, logits on the device) give
    every step of the other model within 25% (on the committed run: the 32B from the 70B within -21%..-6%, the 70B
    from the 32B within -1%..+23%); the datasheet alone (both shares 1) is off by more than 25% on some step."""
    data = json.loads(MEASURED_STEPS.read_text())
    path = tmp_path / "steps.json"
    path.write_text(json.dumps(dict(data, steps=_verifier_slices(data, fitted))))
    e_bw, e_flops = measured_efficiencies(path)
    rows = _verifier_slices(data, predicted)
    assert len(rows) >= 16
    errors = [_share_model_ms(s, e_bw, e_flops) / s["device_ms"] - 1 for s in rows]
    assert max(abs(e) for e in errors) <= 0.25, errors
    assert max(abs(_share_model_ms(s, 1.0, 1.0) / s["device_ms"] - 1) for s in rows) > 0.25


def test_the_shares_the_simulator_uses_are_fitted_on_both_verifiers():
    """The shares in use are the fit on both models' slices (steps-h100.json), the read is bandwidth-bound (e_bw
    between 0.5 and 0.9 of the H100's 3.35 TB/s), and a 16-token step of a slice costs less than 1.5x its one-token
    step (the paper's verify steps hide drafts of a few tokens): measured facts, not a validation."""
    data = json.loads(MEASURED_STEPS.read_text())
    e_bw, e_flops = measured_efficiencies()
    assert (e_bw, e_flops) == (BW_EFFICIENCY, FLOPS_EFFICIENCY)
    assert 0.5 < e_bw < 0.9
    rows = _verifier_slices(data)
    assert {(s["model"], s["layers_run"]) for s in rows} >= {("r1-distill-qwen-32b", 24), ("r1-distill-llama-70b", 12),
                                                            ("r1-distill-llama-70b", 24)}
    one = {(s["model"], s["layers_run"], s["batch"]): s["device_ms"] for s in rows if s["new_tokens"] == 1}
    for s in rows:
        if s["new_tokens"] == 16 and s["batch"] == 1:
            assert s["device_ms"] < 1.5 * one[(s["model"], s["layers_run"], 1)]


def test_the_paper_profiles_follow_from_the_calibration():
    """A 24-layer 0.5B drafter on a 3090: its layers' engine cost and its weights read at the measured bandwidth;
    eager it costs about 5x as much; on the A100s it is faster; the 2-layer 68M drafter is cheap either way."""
    qwen, eager = PROFILES["paper-qwen"], PROFILES["paper-qwen-eager"]
    assert 3.0 < qwen.draft.a < 4.0 and 15.0 < eager.draft.a < 19.0
    assert qwen.colocated_draft.a < qwen.draft.a
    assert PROFILES["paper-llama"].draft.a < 0.5 < PROFILES["paper-llama-eager"].draft.a
    assert qwen.verify == PROFILES["paper-qwen-eager"].verify  # the verifier (vLLM) is not the calibrated engine


@pytest.fixture(scope="module")
def recorded():
    """The runs recorded with speculation.adaptive off (k = 4 always), where every decision follows from the replay,
    so that what is checked is the latency model and the loop's mechanics (the controller's runs diverge: see
    docs/simulation.md)."""
    args, runs = validation.recorded(validation.RECORDED.parent / "inprocess-fixed")
    assert args["speculation"]["adaptive"] is False
    return args, runs, validation.recorded_replay(args, runs)


def _error(row: dict) -> float:
    return max(abs(row[k]["error"]) for k in ("throughput_tok_s", "latency_ms_per_token"))


def _in_run_error(args, run, requests) -> float:
    """A run's larger error of throughput and latency per token, predicted from the latency model fitted on the even
    half of its own steps and drafting rounds."""
    [row] = validation.predict(args, [run], [run], requests, hw=fit(run["trace"], half=0))
    return _error(row)


def _across_runs_error(args, runs, repeat, requests, broken=None) -> float:
    """The concurrency-2 run of `repeat` predicted from the latency model fitted on that repeat's runs at
    concurrency 1 and 4 only (`broken` applied to that model): its larger error of throughput and latency per
    token."""
    fitted = [r for r in runs if r["repeat"] == repeat and r["concurrency"] != 2]
    [target] = [r for r in runs if r["repeat"] == repeat and r["concurrency"] == 2]
    hw = fit(Trace(*(sum((getattr(r["trace"], k) for r in fitted), []) for k in ("requests", "steps", "drafts"))))
    [row] = validation.predict(args, fitted, [target], requests, hw=broken(hw) if broken else hw)
    return _error(row)


def test_each_recorded_run_is_predicted_from_half_of_its_steps(recorded):
    """Within one run (not out of sample: the same run's conditions, its other half of steps unseen): throughput and
    latency per token at concurrency 1, 2 and 4 from the timings of half its steps and drafting rounds."""
    args, runs, requests = recorded
    assert sorted((r["concurrency"], r["repeat"]) for r in runs) == [(c, r) for c in (1, 2, 4) for r in range(3)]
    errors = {(r["concurrency"], r["repeat"]): _in_run_error(args, r, requests) for r in runs}
    assert max(errors.values()) <= IN_RUN_TOLERANCE, errors


def test_a_run_is_predicted_from_the_runs_at_other_concurrencies(recorded):
    """Out of sample: each repeat's run at concurrency 2, from the latency model fitted on its runs at 1 and 4 (no
    step of the predicted run seen): throughput and latency per token within 15%."""
    args, runs, requests = recorded
    errors = {rep: _across_runs_error(args, runs, rep, requests) for rep in range(3)}
    assert max(errors.values()) <= ACROSS_RUNS_TOLERANCE, errors


def test_a_wrong_latency_model_fails_the_same_check(recorded):
    """The out-of-sample check with the verify step's slope doubled, or drafting rounds 30% cheaper, fails: some
    repeat is off by more than the tolerance."""
    args, runs, requests = recorded

    def slope(hw):
        return hw.model_copy(update={"verify": hw.verify.model_copy(update={"b": 2 * hw.verify.b})})

    def drafting(hw):
        return hw.model_copy(update={"draft_round": DraftRound(**{k: 0.7 * v for k, v in hw.draft_round})})

    for broken in (slope, drafting):
        assert any(_across_runs_error(args, runs, rep, requests, broken) > ACROSS_RUNS_TOLERANCE for rep in range(3)), \
            broken.__name__
