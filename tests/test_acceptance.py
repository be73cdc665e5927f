"""The acceptance-matrix machinery: simulation of greedy chain speculation and the criteria check."""

from __future__ import annotations

import copy

import pytest
import torch

from model_family import DOMAINS
from model_family.acceptance import measure, target_continuations
from model_family.recipe import check_acceptance


def test_target_drafting_for_itself_accepts_everything(target, domain_prompt_ids):
    prompts = torch.tensor(domain_prompt_ids["code"])
    seqs = target_continuations(target, prompts, 21)
    acc = measure(target, seqs, prompts.shape[1], k=4)
    # 21 new tokens per prompt = 4 full rounds of 5 plus one last token.
    assert acc.acceptance_rate == 1.0
    assert acc.verifications == 2 * 5
    assert abs(acc.mean_accepted_length - 21 / 5) < 1e-9


def test_a_drafter_that_never_agrees_commits_one_token_per_round(target, domain_prompt_ids):
    class Contrarian(torch.nn.Module):
        """The target with a negated LM head: proposes its least likely token, never accepted."""

        def __init__(self):
            super().__init__()
            self.model = target.model

        def lm_head(self, hidden):
            return -target.lm_head(hidden)

    prompts = torch.tensor(domain_prompt_ids["legal"][:1])
    seqs = target_continuations(target, prompts, 8)
    acc = measure(Contrarian(), seqs, prompts.shape[1], k=4)
    assert acc.acceptance_rate == 0.0 and acc.mean_accepted_length == 1.0 and acc.verifications == 8


def _matrix(own: float, generic: float, other: float) -> dict:
    rows = {}
    for name in list(DOMAINS) + ["generic"]:
        rows[name] = {d: {"mean_accepted_length": own if name == d else (generic if name == "generic" else other),
                          "acceptance_rate": 0.5, "verifications": 1} for d in DOMAINS}
    return {"k": 4, "drafters": rows}


def test_criteria_check_accepts_a_specialised_family_and_flags_violations():
    assert check_acceptance(_matrix(own=2.6, generic=2.0, other=1.5)) == []
    assert any("1.15 x generic" in p for p in check_acceptance(_matrix(own=2.2, generic=2.0, other=1.5)))
    assert any("drafter-" in p for p in check_acceptance(_matrix(own=2.6, generic=2.0, other=2.7)))
    assert any("< 1.8" in p for p in check_acceptance(_matrix(own=2.6, generic=1.7, other=1.5)))
    broken = copy.deepcopy(_matrix(own=2.6, generic=2.0, other=1.5))
    broken["drafters"]["code"]["code"]["mean_accepted_length"] = 1.9
    assert check_acceptance(broken)


@pytest.mark.slow
def test_the_matrix_for_any_target_measures_drafters_through_the_drafter_engine(models, tmp_path, heldout):
    """`cosine models acceptance-matrix --target --drafter --prompts-file`: a user's prompts (JSON lines with a
    domain), the target drafting for itself accepts every drafted token, a domain drafter less; a bad prompt file is
    one line naming the line."""
    import json
    import subprocess
    import sys

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"domain": d, "prompt": heldout[d][5][:200]}) for d in ("code", "legal"))
                       + "\n" + json.dumps({"domain": "chat", "messages": [{"role": "user", "content": "Hi"}]}))
    out = tmp_path / "matrix.json"
    run = subprocess.run([sys.executable, "-m", "serve_app.cli", "models", "acceptance-matrix", "--target", "target",
                          "--drafter", "self=target", "--drafter", f"code={models / 'drafter-code'}",
                          "--prompts-file", str(prompts), "--k", "4", "--new-tokens", "16", "--json", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["domains"] == ["chat", "code", "legal"]
    me, code = result["drafters"]["self"], result["drafters"]["code"]
    for d in result["domains"]:
        assert me["domains"][d]["acceptance_rate"] == 1.0
        assert me["domains"][d]["mean_accepted_length"] >= code["domains"][d]["mean_accepted_length"]
    assert 1.0 < code["domains"]["code"]["mean_accepted_length"] < me["domains"]["code"]["mean_accepted_length"]
    assert me["runner"] == "LlamaRunner" and me["ms_per_drafted_token"] > 0
    assert "| self |" in run.stdout
    prompts.write_text('{"domain": "code"}\n')
    bad = subprocess.run([sys.executable, "-m", "serve_app.cli", "models", "acceptance-matrix", "--target", "target",
                          "--drafter", "self=target", "--prompts-file", str(prompts), "--json", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and f"{prompts}:1:" in bad.stderr and "Traceback" not in bad.stderr
