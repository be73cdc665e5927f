"""The `cosine` command line: what its commands print, and every refusal one line on stderr with a non-zero exit
status, never a traceback."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import yaml

from serve_app.cli import main


def test_generate_with_the_target(capsys):
    assert main(["generate", "--model", "target", "--prompt", "def parse(path):", "--max-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "+++ target:" in out and "8 tokens" in out


def test_speculative_generate_reports_acceptance(capsys):
    assert main(["generate", "--prompt", "The patient presented with", "--max-tokens", "12",
                 "--drafter", "biomedical"]) == 0
    out = capsys.readouterr().out
    assert "drafter biomedical" in out and "mean accepted length" in out


def test_profile_prints_the_controllers_seeds(tmp_path, capsys):
    """`cosine profile` fits the configured verifier engine (here the torch one) and a drafter step, and prints
    them as config the controller accepts."""
    from config import AppConfig

    cfg = {"applications": [{"name": "cosine", "import_path": "serve_app.graph:build_app", "args": {
        "verifier": {"engine": "torch", "model": "target", "max_batch": 4, "max_len": 512},
        "speculation": {"k": 2}, "drafters": [{"name": "code", "model": "drafter-code"}]}}]}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["profile", str(path)]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    seeds = printed["speculation"]["controller"]
    # each fit prices a step of one token (one request) above zero; its intercept alone may fit to zero where the
    # machine is busy (the fit keeps it non-negative: a fresh-clone suite run timed the drafter so)
    for name in ("verify_seed_ms", "draft_seed_ms"):
        a, b = seeds[name]
        assert a >= 0 and b >= 0 and a + b > 0, (name, seeds[name])
    AppConfig.model_validate({**cfg["applications"][0]["args"], **printed})


def _cosine(*argv: str, cwd=None) -> subprocess.CompletedProcess:
    """The real command line, as a user runs it (transformers' progress bars off: they are not ours)."""
    env = {**os.environ, "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    return subprocess.run([sys.executable, "-m", "serve_app.cli", *argv], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=300)


def _refused(run: subprocess.CompletedProcess, needle: str) -> None:
    """A refusal: exit status 2, and stderr one line `cosine...: error: ...` saying what, no traceback."""
    assert run.returncode == 2, (run.returncode, run.stderr[-2000:])
    assert "Traceback" not in run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cosine") and ": error: " in lines[0], run.stderr
    assert needle in lines[0], lines[0]


@pytest.mark.slow  # a subprocess
def test_a_target_the_torch_verifier_cannot_run_is_refused_in_one_line(tmp_path):
    """`cosine generate --drafter` with a Gemma2 target (random weights, the shipped tokenizer): the torch verifier
    refuses it (ValueError), and the command says so in one line instead of a traceback."""
    from transformers import AutoModelForCausalLM, Gemma2Config

    from model_family.paths import model_path

    target = tmp_path / "gemma2"
    config = Gemma2Config(vocab_size=8192, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                          pad_token_id=0, bos_token_id=0, eos_token_id=2)
    AutoModelForCausalLM.from_config(config).save_pretrained(target)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(model_path("target") / f, target / f)
    _refused(_cosine("generate", "--model", str(target), "--drafter", "code", "--prompt", "hi", "--max-tokens", "4"),
             "'gemma2'")


@pytest.mark.slow  # five subprocesses, over ~10 s
def test_bad_configs_and_command_lines_are_refused_in_one_line(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"applications": [{"name": "cosine", "args": {"speculation": {"k": -1}}}]}))
    (tmp_path / "list.yaml").write_text("- just a list\n")
    cases = [(("profile", str(bad)), "speculation.k: Input should be greater than or equal to 0"),
             (("config", "validate", str(tmp_path / "missing.yaml")), "missing.yaml"),
             (("serve", str(tmp_path / "list.yaml")), "no applications"),
             (("models", "acceptance-matrix", "--target", "target"), "go together"),
             (("bench", "engine", "--k", "four"), "invalid int value")]
    # independent processes, mostly spent importing: run side by side (the suite's own process leaves cores idle)
    with ThreadPoolExecutor(len(cases)) as pool:
        runs = list(pool.map(lambda case: _cosine(*case[0]), cases))
    for run, (_, needle) in zip(runs, cases):
        _refused(run, needle)


def test_refusals_through_main(capsys, tmp_path):
    """main(argv) returns the exit status of a refusal, its one line on stderr."""
    assert main(["config", "validate", str(tmp_path / "missing.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("cosine: error: ") and "missing.yaml" in err


def test_a_plot_without_matplotlib_is_refused_before_the_run(capsys, tmp_path, monkeypatch):
    """`--plot` needs the docs extra: where matplotlib is missing the run is refused before it starts, in one line
    (it once wrote its JSON, then ended in a traceback)."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    out = tmp_path / "tiers.json"
    assert main(["simulate", "tiers", "--json", str(out), "--plot", str(tmp_path / "tiers.png")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install -e '.[docs]'" in err and not out.exists()
