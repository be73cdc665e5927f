"""`cosine bench steps` (benchmarks/steps.py): the paper's models' step costs through our engine. On this CPU the
same code runs on tiny stand-ins of the same architectures; the GPU run's JSON is committed
(bench_results/history/steps-h100.json) and the simulator is calibrated on it."""

from __future__ import annotations

import json

import pytest

from benchmarks import steps


def test_a_models_full_depth_is_the_line_through_its_slices():
    """Two slices (12 and 24 layers) of a step that costs 1 ms plus 0.5 ms a layer: 80 layers cost 41 ms, for every
    shape and mode; a shape with one slice only (the other failed) gets no extrapolated row."""
    rows = [{"model": "m", "graphs": g, "batch": b, "new_tokens": 1, "tokens": b, "context": 8, "layers_run": layers,
             "ms": 1 + 0.5 * layers + b, "device_ms": 0.5 + 0.5 * layers}
            for g in (False, True) for b in (1, 4) for layers in (12, 24)]
    rows.append(dict(rows[0], batch=8, layers_run=12))
    out = steps._extrapolate(rows, 80)
    assert len(out) == 4 and all(r["extrapolated"] and r["from_layers"] == [12, 24] for r in out)
    for r in out:
        assert r["ms"] == pytest.approx(41 + r["batch"]) and r["device_ms"] == pytest.approx(40.5)
        assert "layers_run" not in r


# over 10 s on the 2-core CPU (a subprocess timing steps): slow
@pytest.mark.slow
def test_the_command_measures_tiny_stand_ins_on_this_cpu(tmp_path):
    """The whole command on a CPU: each model in a process of its own, the JSON written with every model's shape, the
    step grid of its role, and the summary table the docs print."""
    out = tmp_path / "steps.json"
    result = steps.run(["llama-68m"], out, device="cpu", context=16, repeats=1, budget_s=300, scale=0.01)
    assert json.loads(out.read_text()) == result
    assert result["models"]["llama-68m"]["role"] == "drafter" and "errors" not in result["models"]["llama-68m"]
    grid = {(s["batch"], s["new_tokens"]) for s in result["steps"]}
    assert grid == {(b, 1) for b in steps.DRAFT_GRID["batch"]}
    assert all(s["ms"] > 0 and s["device_ms"] > 0 and s["graphs"] is False for s in result["steps"])
    assert "| llama-68m | 1 |" in steps.summary_table(result | {"steps": result["steps"] + [
        dict(s, graphs=True) for s in result["steps"]]})


def test_the_committed_gpu_run_covers_the_papers_models():
    """The committed H100 run the simulator reads (`MEASURED_STEPS`): every model of the paper's pairs, graphed steps
    for each, the 70B extrapolated from two slices, and its known defects stated."""
    from simulate.hardware import MEASURED_STEPS

    data = json.loads(MEASURED_STEPS.read_text())
    assert data["device"].startswith("NVIDIA H100") and data["dtype"] == "bfloat16"
    assert set(data["models"]) == set(steps.MODELS)
    graphed = {s["model"] for s in data["steps"] if s["graphs"]}
    assert graphed == set(steps.MODELS)
    assert any(s.get("extrapolated") and s["model"] == "r1-distill-llama-70b" for s in data["steps"])
    assert "autograd" in data["defects"]


def test_a_noisy_copy_never_puts_the_extrapolated_device_step_above_the_whole_one():
    """The copy of the logits to the host does not grow with depth: 0.47 ms measured at 12 layers and 0.14 ms at 24
    (the committed 70B's graphed batch-1 slices) extrapolate to a whole step 0.30 ms above the on-device one, not to
    a whole step 1.4 ms below it (a separate line through each column)."""
    rows = [{"model": "m", "graphs": True, "batch": 1, "new_tokens": 1, "tokens": 1, "context": 8, "layers_run": n,
             "ms": ms, "device_ms": dev} for n, ms, dev in ((12, 9.6741, 9.2063), (24, 17.7265, 17.5906))]
    [r] = steps._extrapolate(rows, 80)
    assert r["device_ms"] == pytest.approx(56.7173, abs=1e-4)
    assert r["ms"] - r["device_ms"] == pytest.approx((0.4678 + 0.1359) / 2, abs=1e-3)


def test_no_committed_step_is_shorter_than_its_part_on_the_device():
    """The committed H100 run (`MEASURED_STEPS`): every step's on-device time is at most its whole step (the same step
    with the logits copied to the host), the extrapolated rows are what `_extrapolate` makes of the file's slices.
    The eager rows' on-device times are the one exception, and the file's defects note says why (timed with autograd
    on: not used)."""
    from simulate.hardware import MEASURED_STEPS

    data = json.loads(MEASURED_STEPS.read_text())
    assert "eager rows' device_ms were timed with autograd on" in data["defects"]
    checked = [s for s in data["steps"] if s["graphs"]]
    assert len(checked) >= 60
    over = [s for s in checked if s["device_ms"] > s["ms"]]
    assert not over, over
    for name, model in data["models"].items():
        if "measured_layers" not in model:
            continue
        slices = [s for s in data["steps"] if s["model"] == name and s.get("layers_run")]
        ext = [s for s in data["steps"] if s["model"] == name and s.get("extrapolated")]
        if ext:
            assert sorted(ext, key=str) == sorted(steps._extrapolate(slices, model["layers"]), key=str)
