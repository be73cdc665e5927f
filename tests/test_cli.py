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
