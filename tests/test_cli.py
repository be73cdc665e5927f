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
    import yaml

    from config import AppConfig

    cfg = {"applications": [{"name": "cosine", "import_path": "serve_app.graph:build_app", "args": {
        "verifier": {"engine": "torch", "model": "target", "max_batch": 4, "max_len": 512},
        "speculation": {"k": 2}, "drafters": [{"name": "code", "model": "drafter-code"}]}}]}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["profile", str(path)]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    seeds = printed["speculation"]["controller"]
    assert seeds["verify_seed_ms"][0] > 0 and seeds["draft_seed_ms"][0] > 0
    AppConfig.model_validate({**cfg["applications"][0]["args"], **printed})
