"""The larger target's training path at a tiny size on the CPU: the packed token streams (within their size, every
domain its share, streams intact), a run killed mid-way resuming where its checkpoint left it (steps and losses
continue as if it had never stopped), a run cut at its time budget, and the finished run's report and pieces."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from model_family import DOMAINS, lm_target
from model_family.corpora import write_jsonl
from model_family.paths import model_path
from model_family.train import TrainingCut, fit


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """Six domains of text (the shipped held-out passages stand in for the corpus) packed under a small size."""
    from model_family.samples import heldout_texts

    root = tmp_path_factory.mktemp("lm")
    texts = heldout_texts()
    for d in DOMAINS:
        write_jsonl(root / "data" / d / "train.jsonl", texts[d][10:] * 3)
        write_jsonl(root / "data" / d / "test.jsonl", texts[d][:10])
    out = root / "lm.npz"
    report = lm_target.pack(root / "data", model_path("tokenizer"), out, max_mib=0.25)
    return out, report, root / "data"


def test_pack_keeps_within_its_size_every_domain_and_the_streams_intact(packed, monkeypatch):
    out, report, data = packed
    assert out.stat().st_size == report["bytes"] <= 0.25 * 2**20
    train, test = lm_target.unpack(out)
    full = {d: np.load(data / d / "train.tokens.npy") for d in DOMAINS}
    assert set(train) == set(test) == set(DOMAINS)
    for d in DOMAINS:
        assert np.array_equal(test[d], np.load(data / d / "test.tokens.npy")[:lm_target.TEST_TOKENS])
        assert np.array_equal(train[d], full[d][:len(train[d])]) and len(train[d]) == report["train_tokens"][d]
    # slices of 512 tokens: the budget runs out before the streams do, and the domains get equal shares
    monkeypatch.setattr(lm_target, "SLICE_TOKENS", 512)
    small = lm_target.pack(data, model_path("tokenizer"), out.with_name("small.npz"), max_mib=0.06)
    kept = small["train_tokens"]
    assert small["bytes"] <= 0.06 * 2**20 and all(kept[d] < small["train_tokens_available"][d] for d in DOMAINS)
    assert max(kept.values()) - min(kept.values()) <= 512


def _tiny() -> LlamaConfig:
    from model_family.tokenizer import VOCAB_SIZE

    return LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
                       bos_token_id=0, eos_token_id=[0, 2], pad_token_id=0)


def _train(pack, work, **kw):
    return lm_target.train(pack, work, None, config=_tiny(), steps=4, batch=2, seq_len=16, lr=1e-2, every=2,
                           device="cpu", report=False, log=lambda *_: None, **kw)


def test_a_killed_run_resumes_where_its_checkpoint_left(packed, tmp_path):
    pack = packed[0]
    straight = _train(pack, tmp_path / "straight")

    def killed(done: int) -> None:
        if done == 3:
            raise KeyboardInterrupt  # the machine goes away during step 3's bookkeeping: step 3 is lost

    with pytest.raises(KeyboardInterrupt):
        _train(pack, tmp_path / "cut", on_step=killed)
    state = torch.load(tmp_path / "cut" / "lm-target.ckpt", weights_only=False)
    assert state["step"] == 2
    resumed = _train(pack, tmp_path / "cut")
    assert [r["step"] for r in resumed["loss"]] == [1, 2, 3, 4]  # the lost step's line replaced, not repeated
    assert resumed["loss"] == straight["loss"]  # same data order, same weights: the same losses
    assert json.loads((tmp_path / "cut" / "plan.json").read_text())["steps"] == 4
    assert not (tmp_path / "cut" / "lm-target.ckpt").exists()  # removed once training completed


def test_a_run_cut_at_its_time_budget_saves_its_checkpoint():
    torch.manual_seed(0)
    model = LlamaForCausalLM(_tiny())
    x = torch.randint(0, 100, (2, 9))

    def loss(rng):
        return model(input_ids=x, labels=x).loss

    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        ckpt = Path(d) / "m.ckpt"
        with pytest.raises(TrainingCut) as cut:
            fit(model, 50, 1e-2, 0, "tiny", loss, checkpoint=ckpt, every=100, budget_s=1e-9)
        assert cut.value.steps_done == 1 and torch.load(ckpt, weights_only=False)["step"] == 1


def test_the_finished_model_travels_in_pieces_and_installs(tmp_path):
    """What a lent machine sends back: the model as a tar in pieces of at most PIECE_BYTES, with the report; the
    pieces install as a loadable model with its report in family.json."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(_tiny())
    pieces = lm_target.save(model, tmp_path / "work" / "model", {"steps": 2}, tmp_path / "out")
    assert pieces and all(p.stat().st_size <= lm_target.PIECE_BYTES for p in pieces)
    assert json.loads((tmp_path / "out" / "lm-target-report.json").read_text()) == {"steps": 2}
    installed = lm_target.install(tmp_path / "out", tmp_path / "models" / "lm-target")
    again = LlamaForCausalLM.from_pretrained(installed)
    assert json.loads((installed / "family.json").read_text()) == {"role": "lm-target", "steps": 2}
    assert torch.equal(again.model.embed_tokens.weight, model.model.embed_tokens.weight.half().float())
