"""The numbers in the docs' tables are recomputed from the committed JSON they cite: a table copied from an older run,
edited by hand or rounded differently fails here.

Tables a command prints are rendered again with the command's own formatter and every row must appear verbatim in
the doc; tables that compare two runs (before -> after) are rendered here from both JSON files; every ratio (1.23x)
of the README and the docs is in a JSON its line or section cites, or says it is a paper's, simulated, or a run's
whose data was not kept. Fast (reads JSON and markdown); no marks."""
from __future__ import annotations

import importlib
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _json(name: str) -> dict:
    return json.loads((ROOT / "bench_results" / name).read_text())


def _doc(rel: str) -> str:
    return (ROOT / rel).read_text(encoding="utf-8")


def _table_rows(table: str) -> list[str]:
    return [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("|---")]


def _assert_rows_in(rel: str, rows: list[str], source: str) -> None:
    """Every row appears in the doc, and the doc's table holding them has no other row."""
    assert rows, f"nothing rendered from {source}"
    text = _doc(rel)
    missing = [r for r in rows if r not in text]
    assert not missing, f"{rel}: rows that {source} does not give (recompute them from it):\n" + "\n".join(missing)
    for _, block in _blocks(text):
        if any(r in block for r in rows):
            extra = [line for line in block[2:] if line not in rows]
            assert not extra, f"{rel}: rows beside {source}'s that it does not give:\n" + "\n".join(extra)


def _blocks(text: str) -> list[tuple[str, list[str]]]:
    """Every table of a markdown text (outside code blocks): (the text of the section it is in, its lines)."""
    lines = text.splitlines() + [""]
    heads, fence = [0], False
    for i, line in enumerate(lines):  # sections: from one heading to the next
        if line.startswith("```"):
            fence = not fence
        if not fence and line.startswith("#") and i:
            heads.append(i)
    heads.append(len(lines))
    out, block, fence = [], [], False
    for i, line in enumerate(lines):
        if line.startswith("```"):
            fence = not fence
        if not fence and line.startswith("|"):
            block.append(line)
            continue
        if block:
            s0, s1 = next((s0, s1) for s0, s1 in zip(heads, heads[1:]) if s0 <= i - 1 < s1)
            out.append(("\n".join(lines[s0:s1]), block))
        block = []
    return out


def _assert_tables_are(rel: str, name: str, rendered: str) -> None:
    """Each table `rendered` from bench_results/`name` is a table of the doc, line for line (no row missing, none
    added), in a section that names `name`."""
    doc, found = _blocks(_doc(rel)), 0
    for _, table in _blocks(rendered):
        if len(table) < 3:
            continue
        at = [(body, block) for body, block in doc if table[2] in block]
        assert at, f"{rel}: no table with {name}'s rows (render it again):\n" + "\n".join(table)
        body, block = at[0]
        assert block == table, (f"{rel}: the table of {name} differs from its rendering:\n"
                                + "\n".join(f"doc:  {x}" for x in block if x not in table) + "\n"
                                + "\n".join(f"JSON: {x}" for x in table if x not in block))
        assert f"bench_results/{name}" in body, f"{rel}: the section of {name}'s table does not name it"
        found += 1
    assert found, f"nothing rendered from {name}"


def _rounds_apart(result: dict) -> str:
    """The anchors' concurrency-1 diagnostic taken apart per round: a round commits the mean accepted length (bonus
    included), so it takes that over tokens/s; the rest is the round less its drafting; tokens drafted per round are
    the drafting time per round over that per drafted token."""
    names = {"vLLM draft_model, generic drafter": "vLLM draft_model, generic drafter",
             "vLLM draft_model, domain drafter": "vLLM draft_model, domain drafter",
             "ours: vLLM verifier + drafting tier, in process": "ours, in process"}
    lines = ["| system | ms per round | drafting ms per round | the rest of the round ms | tokens drafted per round |",
             "|---|---|---|---|---|"]
    for r in result["rows"]:
        if r["system"] in names and r["concurrency"] == 1:
            round_ms = 1000 * r["mean_accepted_length"] / r["tokens_per_s"]
            lines.append(f"| {names[r['system']]} | {round_ms:.1f} | {r['draft_ms_per_round']:.1f} | "
                         f"{round_ms - r['draft_ms_per_round']:.1f} | "
                         f"{r['draft_ms_per_round'] / r['draft_ms_per_drafted_token']:.1f} |")
    return "\n".join(lines)


# --- tables a command prints: its formatter on its JSON ----------------------------------------------------------

HISTORY_C1 = "history/anchors-k8-c1-per-domain-1.json"
# (doc, JSON under bench_results/, the formatter the command prints it with, or the test's own for a derived table)
PRINTED = [("docs/benchmarks.md", "anchors-k4-t07-1201e.json", "benchmarks.anchors:format_table"),
           ("docs/benchmarks.md", "anchors-k4-haproxy-1202.json", "benchmarks.anchors:format_table"),
           ("docs/benchmarks.md", "anchors-k4-t07-haproxy-1202.json", "benchmarks.anchors:format_table"),
           ("docs/benchmarks.md", "anchors-k4-1201e.json", "benchmarks.anchors:format_table"),
           ("docs/benchmarks.md", "anchors-k8-1201e.json", "benchmarks.anchors:format_table"),
           ("docs/benchmarks.md", "anchors-k8-scoring-1202b.json", "benchmarks.anchors:format_table"),
           ("docs/benchmarks.md", "anchors-k8-served-1202.json", "benchmarks.anchors:format_table"),
           ("docs/benchmarks-history.md", "anchors-k4-t07-1201d.json", "benchmarks.anchors:format_table"),
           ("docs/benchmarks.md", "anchors-k4-in-verifier-1201.json", "benchmarks.anchors:format_table"),
           ("docs/benchmarks.md", "anchors-k4-t07-in-verifier-1201.json", "benchmarks.anchors:format_table"),
           ("docs/benchmarks.md", "anchors-k4-served-rounds-1201.json", "benchmarks.anchors:format_table"),
           ("docs/benchmarks.md", "anchors-k4-served-rounds-held-1201.json", "benchmarks.anchors:format_table"),
           ("docs/benchmarks-history.md", "anchors-k4-1201d.json", "benchmarks.anchors:format_table"),
           ("docs/benchmarks-history.md", "anchors-k8-1201d.json", "benchmarks.anchors:format_table"),
           ("docs/benchmarks.md", "anchors-k4-t07-1201c.json", "benchmarks.anchors:format_table"),
           ("docs/benchmarks-history.md", "anchors-k4-t07-1201b.json", "benchmarks.anchors:format_table"),
           ("docs/benchmarks-history.md", "anchors-k4-t07-1201.json", "benchmarks.anchors:format_table"),
           ("docs/benchmarks-history.md", "anchors-k4-t07-1130.json", "benchmarks.anchors:format_table"),
           ("docs/benchmarks.md", "anchors-k4-1201c.json", "benchmarks.anchors:format_table"),
           ("docs/benchmarks-history.md", "anchors-k4-1201b.json", "benchmarks.anchors:format_table"),
           ("docs/benchmarks-history.md", "anchors-k4-1201.json", "benchmarks.anchors:format_table"),
           ("docs/benchmarks-history.md", "anchors-k4-1130.json", "benchmarks.anchors:format_table"),
           ("docs/benchmarks.md", "anchors-k8-1130.json", "benchmarks.anchors:format_table"),
           ("docs/benchmarks.md", "anchors-k8-rounds.json", "benchmarks.anchors:format_table"),
           ("docs/benchmarks.md", "anchors-k8-c8-model-free-1201.json", "benchmarks.anchors:format_table"),
           ("docs/benchmarks-history.md", "anchors-k8-c8-model-free-generalist.json",
            "benchmarks.anchors:format_table"),
           ("docs/benchmarks-history.md", "history/anchors-k4-2026-11-27.json", "benchmarks.anchors:format_table"),
           ("docs/benchmarks-history.md", "history/anchors-k8-2026-11-27.json", "benchmarks.anchors:format_table"),
           ("docs/benchmarks-history.md", "anchors-k4-t07.json", "benchmarks.anchors:format_table"),
           ("docs/benchmarks-history.md", "anchors-k4-t07-plain-steps.json", "benchmarks.anchors:format_table"),
           ("docs/benchmarks-history.md", "anchors-k4-t07-model-free.json", "benchmarks.anchors:format_table"),
           ("docs/benchmarks-history.md", "anchors-k4-t07-per-load.json", "benchmarks.anchors:format_table"),
           ("docs/benchmarks-history.md", "anchors-k8-model-free.json", "benchmarks.anchors:format_table"),
           ("docs/benchmarks-history.md", "anchors-k8-model-free-first.json", "benchmarks.anchors:format_table"),
           ("docs/benchmarks-history.md", "anchors-k8-priced.json", "benchmarks.anchors:format_table"),
           ("docs/benchmarks-history.md", "anchors-k4-t07-calibrated.json", "benchmarks.anchors:format_table"),
           ("docs/benchmarks-history.md", "anchors-k8-calibrated.json", "benchmarks.anchors:format_table"),
           ("docs/benchmarks-history.md", "anchors-k4-t07-paired.json", "benchmarks.anchors:format_table"),
           ("docs/benchmarks-history.md", "anchors-k4-t07-startup-thread.json", "benchmarks.anchors:format_table"),
           ("docs/benchmarks-history.md", "anchors-k4-after.json", "benchmarks.anchors:format_table"),
           ("docs/benchmarks-history.md", "anchors-k4-t07-nice.json", "benchmarks.anchors:format_table"),
           ("docs/benchmarks-history.md", "anchors-k4-t07-turns.json", "benchmarks.anchors:format_table"),
           ("docs/benchmarks-history.md", "anchors-k8-turns.json", "benchmarks.anchors:format_table"),
           ("docs/benchmarks-history.md", "anchors-k8-guard.json", "benchmarks.anchors:format_table"),
           ("docs/benchmarks-history.md", "anchors-k4-t07-guard.json", "benchmarks.anchors:format_table"),
           ("docs/benchmarks-history.md", "anchors-k4-t07-first-verdict.json", "benchmarks.anchors:format_table"),
           ("docs/benchmarks-history.md", "anchors-k4-turns.json", "benchmarks.anchors:format_table"),
           ("docs/benchmarks-history.md", "anchors-k4-guard.json", "benchmarks.anchors:format_table"),
           ("docs/benchmarks-history.md", "anchors-k8-tuned.json", "benchmarks.anchors:format_table"),
           ("docs/benchmarks-history.md", "anchors-k8-unmeasured.json", "benchmarks.anchors:format_table"),
           ("docs/benchmarks-history.md", "anchors-k8-prior.json", "benchmarks.anchors:format_table"),
           ("docs/benchmarks-history.md", "anchors-k8-probe-hold.json", "benchmarks.anchors:format_table"),
           ("docs/benchmarks-history.md", "anchors-k4-headline.json", "benchmarks.anchors:format_table"),
           ("docs/benchmarks-history.md", "anchors-k4-verifier-thread.json", "benchmarks.anchors:format_table"),
           ("docs/benchmarks-history.md", "anchors-k8-verifier-thread.json", "benchmarks.anchors:format_table"),
           ("docs/benchmarks-history.md", "anchors-k4-t07-verifier-thread.json", "benchmarks.anchors:format_table"),
           ("docs/benchmarks-history.md", "anchors-k4-t07-trial-half.json", "benchmarks.anchors:format_table"),
           ("docs/benchmarks-history.md", "anchors-k4-trial-half.json", "benchmarks.anchors:format_table"),
           ("docs/benchmarks-history.md", "anchors-k4-t07-served-c1-seed1.json", "benchmarks.anchors:format_table"),
           ("docs/benchmarks-history.md", "anchors-k8-headline.json", "benchmarks.anchors:format_table"),
           ("docs/benchmarks-history.md", "history/anchors-k4-t07-vllm-unfixed.json", "benchmarks.anchors:format_table"),
           ("docs/benchmarks-history.md", "history/anchors-k8-2026-11-26.json", "benchmarks.anchors:format_table"),
           ("docs/benchmarks-history.md", HISTORY_C1, "benchmarks.anchors:format_table"),
           ("docs/benchmarks-history.md", HISTORY_C1, "tests.test_docs_numbers:_rounds_apart"),
           ("docs/benchmarks.md", "rounds-c1-1201.json", "benchmarks.rounds:format_table"),
           ("docs/benchmarks-history.md", "rounds-c1.json", "benchmarks.rounds:format_table"),
           ("docs/benchmarks.md", "breakdown.json", "benchmarks.breakdown:table"),
           ("docs/benchmarks.md", "breakdown-calibrated.json", "benchmarks.breakdown:table"),
           ("docs/benchmarks.md", "control-plane-1202.json", "benchmarks.control_plane:format_table"),
           ("docs/benchmarks.md", "rounds-c8-1201.json", "benchmarks.rounds:format_table"),
           ("docs/benchmarks.md", "rounds-c8-k4-1201.json", "benchmarks.rounds:format_table"),
           ("docs/benchmarks-history.md", "rounds-c8.json", "benchmarks.rounds:format_table"),
           ("docs/benchmarks.md", "engine.json", "benchmarks.engine:format_table"),
           ("docs/benchmarks.md", "engine-modes.json", "benchmarks.engine:format_table"),
           ("docs/benchmarks.md", "engine-chain-choice.json", "benchmarks.engine:format_table"),
           ("docs/benchmarks.md", "collaborative.json", "benchmarks.collaborative:format_table"),
           ("docs/benchmarks-history.md", "history/drafter-pool-2026-11-26.json", "benchmarks.engine:pool_table"),
           ("docs/benchmarks.md", "drafter-pool.json", "benchmarks.engine:pool_table"),
           ("docs/benchmarks.md", "history/engine-guard-b8-2026-11-27.json", "benchmarks.engine:format_table"),
           ("docs/benchmarks.md", "history/engine-guard-b8-2026-11-27.json", "benchmarks.engine:device_table"),
           ("docs/simulation.md", "history/steps-h100.json", "benchmarks.steps:summary_table"),
           ("docs/simulation.md", "simulate-remote.json", "simulate.report:remote_pays_table"),
           ("docs/simulation.md", "simulate-tiers.json", "simulate.report:tiers_table"),
           ("docs/simulation.md", "simulate-validate-recorded.json", "simulate.report:out_of_sample_table"),
           ("docs/simulation.md", "simulate-validate-recorded-fixed.json", "simulate.report:out_of_sample_table")]


def _render(name: str, formatter: str) -> str:
    module, function = formatter.split(":")
    return getattr(importlib.import_module(module), function)(_json(name))


@pytest.mark.parametrize("rel,name,formatter", PRINTED, ids=[f"{p[1]}:{p[2].split(':')[1]}" for p in PRINTED])
def test_a_printed_table_in_the_docs_is_its_commands_output_on_the_committed_json(rel, name, formatter):
    _assert_tables_are(rel, name, _render(name, formatter))


def test_every_table_of_the_benchmarks_doc_is_rendered_from_its_json():
    """docs/benchmarks.md has no table that is not a rendering of the JSON its section names (a hand-made or
    hand-derived table fails here: render it from its JSON, or move it to the history)."""
    rendered = [b for rel, name, f in PRINTED if rel == "docs/benchmarks.md" for _, b in _blocks(_render(name, f))]
    stray = [block[:3] for _, block in _blocks(_doc("docs/benchmarks.md")) if block not in rendered]
    assert not stray, "tables of docs/benchmarks.md rendered from no JSON:\n" + "\n".join("\n".join(b) for b in stray)


# --- tables comparing the code before a change with after it -----------------------------------------------------

PAIRS = {"paper-llama": "Llama-70B + 68M", "paper-qwen": "Qwen-32B + 0.5B"}


def _by(rows: list[dict], *keys: str) -> dict:
    return {tuple(r[k] for k in keys): r for r in rows}


def test_the_reproduction_tables_are_the_two_runs():
    before, after = _json("history/simulate-reproduce-before.json"), _json("simulate-reproduce.json")
    b_off, a_off = _by(before["offline"], "profile", "batch", "system"), _by(after["offline"], "profile", "batch", "system")
    rows = []
    for (profile, batch, system), a in a_off.items():
        if system != "no-spec":
            continue
        tps = lambda d, s: d[(profile, batch, s)]["throughput_tok_s"]  # noqa: E731
        ms = lambda d, s: d[(profile, batch, s)]["service_ms_per_token"]  # noqa: E731
        cells = [f"{tps(b_off, 'no-spec'):.0f} -> {tps(a_off, 'no-spec'):.0f}"]
        cells += [f"{tps(b_off, s):.0f} ({ms(b_off, s):.1f}) -> {tps(a_off, s):.0f} ({ms(a_off, s):.1f})"
                  for s in ("vanilla", "cosine")]
        cells.append(f"{tps(b_off, 'cosine') / tps(b_off, 'vanilla'):.2f} -> "
                     f"{tps(a_off, 'cosine') / tps(a_off, 'vanilla'):.2f}")
        cos, van = a_off[(profile, batch, "cosine")], a_off[(profile, batch, "vanilla")]
        cells.append(f"{van['mean_accepted_length']:.2f} / {cos['mean_accepted_length']:.2f}")
        cells.append(f"{cos['ahead_used_share']:.0%}")
        rows.append(f"| {PAIRS[profile]} | {batch} | " + " | ".join(cells) + " |")
    b_on, a_on = _by(before["online"], "profile", "rate", "system"), _by(after["online"], "profile", "rate", "system")
    for (profile, rate, system), a in a_on.items():
        if system != "no-spec":
            continue
        cells = []
        for s in ("no-spec", "vanilla", "cosine", "cosine+autoscaler"):
            x, y = b_on[(profile, rate, s)], a_on[(profile, rate, s)]
            cell = (f"{x['latency_ms_per_token']:.1f} -> {y['latency_ms_per_token']:.1f} ms, "
                    f"${y['usd_per_million_tokens']:.2f}/M")
            if s == "cosine+autoscaler":
                cell += f"; {y['drafter_gpu_hours']:.2f} drafter GPU-h"
            cells.append(cell)
        rows.append(f"| {PAIRS[profile]} | {rate} | " + " | ".join(cells) + " |")
    assert len(rows) == 16
    _assert_rows_in("docs/simulation.md", rows,
                    "bench_results/{history/simulate-reproduce-before,simulate-reproduce}.json")


@pytest.mark.parametrize("suffix", ["", "-low"])
def test_the_sizing_tables_are_the_two_runs(suffix):
    before, after = _json(f"history/simulate-size{suffix}-before.json"), _json(f"simulate-size{suffix}.json")
    b_rows, a_rows = _by(before["rows"], "system", "kind", "gpus"), _by(after["rows"], "system", "kind", "gpus")
    rows = []
    for key, a in a_rows.items():
        system, kind, gpus = key
        if system == "cosine" and gpus not in (1, 7, 14):
            continue
        b = b_rows[key]
        cell = lambda r: f"{r['latency_ms_per_token']:.1f} ms, {r['good_tokens_per_usd'] / 1000:.0f}k"  # noqa: E731
        name = system if kind is None else f"{system}, {gpus} x {kind}"
        rows.append(f"| {name} | {cell(b)} | {cell(a)} |")
    assert len(rows) == 11
    _assert_rows_in("docs/simulation.md", rows, f"bench_results/{{history/,}}simulate-size{suffix}{{-before,}}.json")


def test_the_gpu_step_table_is_the_measured_steps_and_their_calibrated_model():
    """docs/simulation.md, "GPU steps, calibrated on the measured ones": each cell is a step of
    bench_results/history/gpu-steps.json (ms) and, in parentheses, what simulate/hardware.py's fit makes of it."""
    from simulate.hardware import calibrate

    data = _json("history/gpu-steps.json")
    model = {(c.gpu, c.graphs, p["model"], p["batch"], p["new_tokens"]): p["model_ms"]
             for c in calibrate().values() for p in c.points}
    groups: dict[tuple, dict[int, dict]] = {}
    for s in data["steps"]:
        groups.setdefault((s["device"], s["gpu"], s["dtype"], s["graphs"], s["model"], s["batch"]), {})[s["new_tokens"]] = s
    rows = []
    for (device, gpu, dtype, graphs, name, batch), by_n in groups.items():
        cells = [f"{by_n[n]['ms']} ({model[(gpu, graphs, name, batch, n)]:.2f})" if n in by_n else "-"
                 for n in (1, 5, 9)]
        mode = "CUDA graphs" if graphs else "eager"
        rows.append(f"| {device} | {dtype} | {mode} | {name} | {batch} | " + " | ".join(cells) + " |")
    assert len(rows) == len(groups) >= 12
    text = _doc("docs/simulation.md")
    missing = [r for r in rows if not any(line.startswith(r) for line in text.splitlines())]
    assert not missing, ("docs/simulation.md: GPU step rows that bench_results/history/gpu-steps.json does not "
                         "give:\n" + "\n".join(missing))


# --- what is identical to the target alone (README, docs/design.md) ------------------------------------------------

def test_the_identity_claims_are_the_measured_ones():
    """The README's and docs/design.md's shares of identical outputs are those of the committed H200 runs: fp32 12 of
    12 for every method and batch; bf16 at batch 1 as many for every speculative method, first differing tokens at
    the positions named; plain decoding at batch 8 and 16 against batch 1 on as many prompts."""
    bf16, fp32 = _json("history/engine-h200-9b-bf16-identity.json"), _json("history/engine-h200-9b-fp32-identity.json")
    assert all(v["identical"] == v["prompts"] == 12 for v in fp32["identity"].values())
    ident = bf16["identity"]
    spec_b1 = [v for k, v in ident.items() if k.startswith("ours") and k.endswith("| batch 1")]
    assert spec_b1 and len({v["identical"] for v in spec_b1}) == 1
    same, prompts = spec_b1[0]["identical"], spec_b1[0]["prompts"]
    positions = sorted({n for v in spec_b1 for n in v["common_prefix"] if n < bf16["config"]["new_tokens"]})
    plain = {ident[f"target-only (our engine) | batch {b} vs target-only batch 1"]["identical"] for b in (8, 16)}
    assert len(plain) == 1
    changed = prompts - plain.pop()
    readme, design = " ".join(_doc("README.md").split()), " ".join(_doc("docs/design.md").split())
    assert f"{same} of {prompts} prompts gave the same {bf16['config']['new_tokens']} tokens at batch 1" in readme
    assert f"batch 8 or 16 on {changed} of {prompts}" in readme
    assert f"{same} of {prompts} prompts identical over {bf16['config']['new_tokens']} tokens" in design
    assert "positions " + ", ".join(map(str, positions[:-1])) + f" and {positions[-1]}" in design
    assert f"batch 1 on {changed} of {prompts} prompts" in design
    assert f"12 of 12 prompts identical over {fp32['config']['new_tokens']} tokens" in design


# --- ratios in the prose ---------------------------------------------------------------------------------------

RATIO_AGAINST = re.compile(r"(\d+\.\d+)x([^()|]{0,80}?)\((\d+(?:\.\d+)?) against (\d+(?:\.\d+)?)")


def _prose_ratios(body: str) -> list[tuple[str, str, str]]:
    prose = " ".join(line for line in body.splitlines() if not line.startswith("|"))
    return [(m.group(1), m.group(3), m.group(4)) for m in RATIO_AGAINST.finditer(" ".join(prose.split()))]


def test_the_prose_ratios_are_their_figures_ratios():
    """A ratio the prose states with its figures ("1.05x the shipped configuration (208.0 against 198.5 tok/s)") is
    their ratio within rounding, and both figures are in the tables of its section (rendered from its JSON)."""
    from tests.test_docs_results import _ratio_ok

    checked = 0
    for body, _ in {(b, 0) for b, _ in _blocks(_doc("docs/benchmarks.md"))}:
        cells = {c.strip() for _, block in _blocks(body) for line in block for c in line.split("|")}
        figures = {f for c in cells for f in re.findall(r"\d+(?:\.\d+)?", c)}
        for ratio, a, b in _prose_ratios(body):
            assert _ratio_ok(ratio, a, b), f"{ratio}x is not {a} / {b} = {float(a) / float(b):.4f}"
            assert {a, b} <= figures, f"{a} or {b} is in no table of its section"
            checked += 1
    assert checked >= 2
    assert _prose_ratios("x 1.10x the controller (111.8 against 104.2 tok/s)") == [("1.10", "111.8", "104.2")]
    assert not _ratio_ok("1.10", "111.8", "104.2")


# --- every ratio in the docs, against the JSON its line or section cites ------------------------------------------

RATIO_DOCS = ["README.md"] + [f"docs/{n}.md" for n in ("benchmarks", "design", "simulation", "operations",
                                                         "model_card")]
RATIO = re.compile(r"(?<![\w.])(\d+\.\d+)(?:-(\d+\.\d+))?x\b")  # 1.23x, or a range 0.97-1.03x
CITED = re.compile(r"bench_results/[\w./-]+\.json|models/[\w-]+\.json")
# A ratio need not be in a JSON where its paragraph says what it is instead: a run whose data was not kept, named by
# its date or commit; a paper's figure; a simulated or datasheet-scaled one.
NOT_KEPT_RUN = re.compile(r"not kept.*(\d{4}-\d{2}-\d{2}|\b[0-9a-f]{7,40}\b)|(\d{4}-\d{2}-\d{2}|\b[0-9a-f]{7,40}\b)"
                          r".*not kept")
PAPER = re.compile(r"\bpapers?\b|\(CoSine|CoSine paper|arXiv", re.IGNORECASE)
SIMULATED = re.compile(r"simulat|datasheet", re.IGNORECASE)


def _values(obj, key: str = "", out: dict | None = None) -> dict[str, list[float]]:
    """Every number of a JSON, by the key it is under."""
    out = {} if out is None else out
    if isinstance(obj, dict):
        for k, v in obj.items():
            _values(v, k, out)
    elif isinstance(obj, list):
        for v in obj:
            _values(v, key, out)
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        out.setdefault(key, []).append(float(obj))
    return out


# ms: a GPU step's, against another's; drafting cost per drafted token: ours against vLLM's (issue 58's goal)
RATES = ("tokens_per_s", "throughput_tok_s", "goodput_tok_s", "ms", "draft_ms_per_drafted_token")
# rows a speed-up compares: at the same batch, load and profile (a step: of the same model, graphed or not)
SAME = ("batch", "concurrency", "profile", "rate", "model", "graphs", "device")


def _rows(obj) -> list[list[dict]]:
    """Every list of rows (dicts) in a JSON."""
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _rows(v)]
    if isinstance(obj, list):
        own = [obj] if obj and all(isinstance(r, dict) for r in obj) else []
        return own + [t for v in obj for t in _rows(v)]
    return []


_FIGURES: dict[tuple[str, bool], list[float]] = {}


def _figures(path: str, range_end: bool) -> list[float]:
    """A JSON's numbers and the speed-ups between its rows (one row's tokens/s over another's at the same batch,
    concurrency, profile and rate; one repeat's over target-only's same repeat), sorted; for the end of a range also a row's
    slowest repeat over another's fastest and its fastest over the other's slowest (the range over repeats)."""
    if (path, range_end) not in _FIGURES:
        data = json.loads((ROOT / path).read_text())
        found = {v for vs in _values(data).values() for v in vs}
        pairs = [(x, x) for x in RATES] + ([(f"{x}_min", f"{x}_max") for x in RATES] if range_end else [])
        for rows in _rows(data):
            for a in rows:
                for b in rows:
                    if all(a.get(k) == b.get(k) for k in SAME):
                        found |= {a[x] / b[y] for x, y in pairs for x, y in ((x, y), (y, x))
                                  if isinstance(a.get(x), (int, float)) and isinstance(b.get(y), (int, float))
                                  and b[y]}
        runs = data.get("tokens_per_s_per_run") if isinstance(data, dict) else None
        for a, ours in (runs or {}).items():  # "method | batch 8": each repeat's over target-only's same repeat
            for b, base in runs.items():
                if b.startswith("target-only") and a.split(" | ")[1:] == b.split(" | ")[1:] and len(ours) == len(base):
                    found |= {x / y for x, y in zip(ours, base) if y}
        _FIGURES[(path, range_end)] = sorted(found)
    return _FIGURES[(path, range_end)]


def _in(figure: str, paths: set[str], range_end: bool = False) -> bool:
    """`figure`, to its printed decimals, is a number or a speed-up of one of `paths`."""
    import bisect

    value, slack = float(figure), 0.5 * 10 ** -_decimals(figure) + 1e-9
    for p in paths:
        values = _figures(p, range_end)
        i = bisect.bisect_left(values, value - slack)
        if i < len(values) and values[i] <= value + slack:
            return True
    return False


def _decimals(figure: str) -> int:
    return len(figure.split(".")[1]) if "." in figure else 0


def _units(text: str) -> list[tuple[set[str], str]]:
    """(the JSON files its section and the sections above it cite, the text) of every table row, paragraph and list
    item of a markdown text (a wrapped line is read with the rest of its paragraph), code blocks left out."""
    lines = text.splitlines()
    sections, fence = [], False
    for i, line in enumerate(lines):  # (heading level, first line) of each section
        if line.startswith("```"):
            fence = not fence
        if not fence and re.match(r"#{1,6} ", line):
            sections.append((len(line) - len(line.lstrip("#")), i))
    bounds = [(lvl, start, (sections[j + 1][1] if j + 1 < len(sections) else len(lines)))
              for j, (lvl, start) in enumerate(sections)] or [(0, 0, len(lines))]
    if bounds[0][1] > 0:
        bounds.insert(0, (0, 0, bounds[0][1]))
    out, stack = [], []
    for lvl, start, end in bounds:
        body = lines[start:end]
        own = {p for line in body for p in CITED.findall(line) if (ROOT / p).is_file()}
        stack = [(l, c) for l, c in stack if l < lvl] + [(lvl, own)]
        cited = set().union(*(c for _, c in stack))
        fence, para = False, []
        for line in body[1:] + [""]:
            if line.startswith("```"):
                fence = not fence
                continue
            if fence:
                continue
            if line.startswith("|"):
                out.append((cited, line))
            elif line.strip() and not line.lstrip().startswith("- "):
                para.append(line.strip())
                continue
            if para:
                out.append((cited, " ".join(para)))
            para = [line.strip()] if line.lstrip().startswith("- ") else []
    return out


def _unchecked_ratios(rel: str) -> list[str]:
    bad = []
    for cited, unit in _units(_doc(rel)):
        if NOT_KEPT_RUN.search(unit) or PAPER.search(unit) or SIMULATED.search(unit):
            continue
        here = cited | {p for p in CITED.findall(unit) if (ROOT / p).is_file()}
        for m in RATIO.finditer(unit):
            missing = [f for f in m.groups() if f and not _in(f, here, range_end=m.group(2) is not None)]
            if missing:
                bad.append(f"{rel}: {m.group(0)} in: {unit[:160]}")
    return bad


@pytest.mark.parametrize("rel", RATIO_DOCS)
def test_every_ratio_is_in_the_json_its_line_or_section_cites(rel):
    """Every ratio (1.23x, 0.97-1.03x) is a number of, or a ratio of two same-named numbers of, a committed JSON
    that its line or section names, to the decimals printed; or its paragraph says it is a paper's, a simulated one,
    or a run's whose data was not kept (with the run's date or commit). docs/benchmarks-history.md is the history."""
    bad = _unchecked_ratios(rel)
    assert not bad, "ratios that no JSON their text cites holds (cite it, or say what they are):\n" + "\n".join(bad)


def test_the_ratio_check_catches_a_figure_no_json_holds(tmp_path, monkeypatch):
    me = sys.modules[__name__]
    (tmp_path / "bench_results").mkdir()
    (tmp_path / "bench_results" / "r.json").write_text(json.dumps({"rows": [
        {"batch": 1, "tokens_per_s": 30.0}, {"batch": 1, "tokens_per_s": 20.0, "s": 1.234},
        {"batch": 8, "tokens_per_s": 17.0}]}))
    (tmp_path / "d.md").write_text("# A\n\nRaw data: bench_results/r.json.\n\n## B\n\nOurs 1.50x and 1.23x; "
                                   "and 1.2-1.5x.\n\nThen 1.70x here.\n\nA paper's 2.13x. Simulated 3.10x.\n\n"
                                   "A run of 2026-11-22, its data not kept: 4.44x.\n\nAnd 5.55x not kept.\n\n"
                                   "Across batches 1.76x.\n")
    monkeypatch.setattr(me, "ROOT", tmp_path)
    monkeypatch.setattr(me, "_FIGURES", {})
    assert [b.split(" in: ")[0] for b in _unchecked_ratios("d.md")] == ["d.md: 1.70x", "d.md: 5.55x", "d.md: 1.76x"]
