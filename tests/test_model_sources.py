"""Models by Hugging Face id, from a real hub cache (huggingface_hub's layout, offline), and the startup checks that
refuse what cannot serve together: a model that cannot be had, a drafter of another vocabulary."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from config import AppConfig
from engines.build import check_models
from model_family import compat
from model_family.compat import IncompatibleModels
from model_family.sources import ModelUnavailable, resolve_model
from tests.helpers.hub_cache import offline_env, publish


@pytest.fixture
def hub(tmp_path, monkeypatch) -> Path:
    """An offline node whose hub cache holds the shipped target and code drafter under ids."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def _swapped_vocab(src: Path, dst: Path, a: int = 100, b: int = 200) -> Path:
    """A copy of the checkpoint `src` whose tokenizer gives ids `a` and `b` each other's strings."""
    shutil.copytree(src, dst)
    tj = json.loads((dst / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    sa, sb = next(s for s, i in vocab.items() if i == a), next(s for s, i in vocab.items() if i == b)
    vocab[sa], vocab[sb] = b, a
    (dst / "tokenizer.json").write_text(json.dumps(tj))
    return dst


def test_an_id_resolves_to_its_snapshot_and_a_revision_pins_it(hub, models):
    first = publish(hub, "acme/drafter", models / "drafter-code")
    second = publish(hub, "acme/drafter", models / "drafter-legal")  # main moves on
    assert resolve_model("acme/drafter") == hub / "models--acme--drafter" / "snapshots" / second
    assert resolve_model(f"acme/drafter@{first}") == hub / "models--acme--drafter" / "snapshots" / first
    assert (resolve_model("acme/drafter") / "model.safetensors").read_bytes() == \
        (models / "drafter-legal" / "model.safetensors").read_bytes()
    # shipped names and directories resolve as before
    assert resolve_model("target") == models / "target"
    assert resolve_model(str(models / "drafter-code")) == models / "drafter-code"


def test_a_model_that_cannot_be_had_says_which_where_and_what_to_do(hub):
    with pytest.raises(ModelUnavailable) as e:
        resolve_model("acme/missing")
    msg = str(e.value)
    assert "'acme/missing'" in msg and str(hub) in msg and "HF_HUB_OFFLINE" in msg and "hf download" in msg
    with pytest.raises(ModelUnavailable, match="no such directory"):
        resolve_model("./not/here")


def test_startup_refuses_a_drafter_of_another_vocabulary(hub, models, tmp_path):
    publish(hub, "acme/target", models / "target")
    publish(hub, "acme/odd-drafter", _swapped_vocab(models / "drafter-code", tmp_path / "odd"))
    cfg = AppConfig(verifier={"model": "acme/target"}, drafters=[{"name": "code", "model": "acme/odd-drafter"}])
    with pytest.raises(IncompatibleModels) as e:
        check_models(cfg)
    msg = str(e.value)
    assert "drafter code" in msg and "'acme/odd-drafter'" in msg and "2 of 8192" in msg and "id 100" in msg


def test_startup_accepts_a_larger_drafter_vocabulary_and_limits_its_proposals(hub, models, tmp_path):
    """A drafter with the target's tokens and more (padded embeddings, extra added tokens) serves; the ids it may
    propose are those the target has."""
    big = tmp_path / "big"
    shutil.copytree(models / "drafter-code", big)
    tj = json.loads((big / "tokenizer.json").read_text())
    tj["added_tokens"].append({"id": 8192, "content": "<|extra|>", "single_word": False, "lstrip": False,
                               "rstrip": False, "normalized": False, "special": True})
    (big / "tokenizer.json").write_text(json.dumps(tj))
    publish(hub, "acme/target", models / "target")
    publish(hub, "acme/big-drafter", big)
    cfg = AppConfig(verifier={"model": "acme/target"}, drafters=[{"name": "code", "model": "acme/big-drafter"}])
    assert len(compat.load_tokenizer(resolve_model("acme/big-drafter"))) == 8193
    assert check_models(cfg) == 8192
    assert cfg.tokenizer == "acme/target"  # the target's own tokenizer by default


def test_eos_comes_from_generation_config_and_the_tokenizer(models, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(models / "target", d)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    tok = compat.load_tokenizer(d)
    assert compat.eos_token_ids(d, tok) == (2, 7, tok.eos_token_id)
    (d / "generation_config.json").unlink()
    assert compat.eos_token_ids(d, tok) == (tok.eos_token_id,)


def test_drafter_max_len_follows_the_verifier():
    cfg = AppConfig(verifier={"model": "target", "max_len": 4096},
                    drafters=[{"name": "code", "model": "drafter-code"},
                              {"name": "legal", "model": "drafter-legal", "max_len": 512}])
    assert [d.max_len for d in cfg.drafters] == [4096, 512]


def _cli(*args, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "serve_app.cli", *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **env})


@pytest.mark.slow
def test_cli_generates_with_ids_from_the_cache_and_errors_in_one_line(models, tmp_path):
    """`cosine generate --model ID --drafter ID` on an offline node: speculative output equals plain decoding; a
    missing id is one line on stderr, exit status 2."""
    cache = tmp_path / "hub"
    publish(cache, "acme/target", models / "target")
    publish(cache, "acme/drafter", models / "drafter-code")
    env = offline_env(cache)
    common = ["--prompt", "def parse(path):", "--max-tokens", "24"]
    # three independent processes, side by side (the suite's own process leaves cores idle)
    with ThreadPoolExecutor(3) as pool:
        plain, spec, missing = pool.map(
            lambda args: _cli("generate", "--model", "acme/target", *args, *common, env=env),
            [(), ("--drafter", "acme/drafter"), ("--drafter", "acme/nope")])
    assert plain.returncode == 0, plain.stderr[-2000:]
    assert spec.returncode == 0, spec.stderr[-2000:]
    out = [line for line in plain.stdout.splitlines() if line.startswith("+++")]
    assert out and out == [line for line in spec.stdout.splitlines() if line.startswith("+++")]
    assert "mean accepted length" in spec.stdout
    assert missing.returncode == 2
    assert missing.stderr.count("\n") == 1 and "acme/nope" in missing.stderr and "Traceback" not in missing.stderr


def test_renamed_added_tokens_warn_and_ordinary_ones_refuse(models, tmp_path, caplog):
    """The paper's pair: a target that renames the drafters' chat markers (added tokens) serves, with a warning."""
    renamed = tmp_path / "renamed"
    shutil.copytree(models / "drafter-code", renamed)
    for f in ("tokenizer.json", "tokenizer_config.json"):  # the vocabulary, the added token, the special tokens
        (renamed / f).write_text((renamed / f).read_text().replace("<|im_end|>", "<|turn_end|>"))
    cfg = AppConfig(verifier={"model": "target"}, drafters=[{"name": "code", "model": str(renamed)}])
    with caplog.at_level("WARNING"):
        assert check_models(cfg) == 8192
    assert "1 added tokens differ" in caplog.text and "<|turn_end|>" in caplog.text


def test_a_kv_budget_below_one_request_is_a_startup_error(models):
    # the shipped drafter: 2 layers x 4 heads x 32 x 2 (keys, values) x 4 bytes = 2 KiB a token on the CPU
    ok = AppConfig(verifier={"model": "target", "max_len": 2048},
                   drafters=[{"name": "code", "model": "drafter-code", "kv_cache_gib": 4 / 1024}])
    check_models(ok)  # 4 MiB: one request at 2048 tokens, exactly
    small = AppConfig(verifier={"model": "target", "max_len": 2048},
                      drafters=[{"name": "code", "model": "drafter-code", "kv_cache_gib": 3 / 1024}])
    with pytest.raises(IncompatibleModels, match="needs 0.00 GiB|lower max_len or raise kv_cache_gib"):
        check_models(small)


def test_the_graph_builder_refuses_before_binding_any_deployment(hub, models, tmp_path):
    """What `serve deploy` runs first: a bad model fails the application build itself, so no replica of it starts."""
    from serve_app.graph import build_app

    publish(hub, "acme/target", models / "target")
    publish(hub, "acme/odd-drafter", _swapped_vocab(models / "drafter-code", tmp_path / "odd"))
    base = {"verifier": {"engine": "vllm", "model": "acme/target"}}
    with pytest.raises(IncompatibleModels, match="acme/odd-drafter"):
        build_app({**base, "drafters": [{"name": "code", "model": "acme/odd-drafter"}]})
    with pytest.raises(ModelUnavailable, match="acme/absent"):
        build_app({**base, "drafters": [{"name": "code", "model": "acme/absent"}]})
    with pytest.raises(IncompatibleModels, match="kv_cache_gib"):
        build_app({**base, "drafters": [{"name": "code", "model": "drafter-code", "kv_cache_gib": 0.001}]})
    assert build_app({**base, "drafters": [{"name": "code", "model": "drafter-code"}]}) is not None
