"""The drafter recipe on either device: distillation is deterministic and learns, a run resumes from a checkpoint
saved on any device, and the distill sets do not depend on the batch sizes the target runs at."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from model_family.distill import LOSSES, DistillSet, build_distill_set, distill_drafter

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]
VOCAB, K = 64, 4


def _config() -> LlamaConfig:
    return LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)


def _set(seed: int, n: int = 8, length: int = 9) -> DistillSet:
    """Random soft labels: K distinct ids per position, probabilities sorted as the target's top-K are."""
    rng = np.random.default_rng(seed)
    ids = np.argsort(rng.random((n, length - 1, VOCAB)), axis=-1)[..., :K]
    p = -np.sort(-rng.dirichlet(np.ones(K + 1), size=(n, length - 1))[..., :K], axis=-1)
    return DistillSet(rng.integers(0, VOCAB, size=(n, length)).astype(np.uint16), ids.astype(np.uint16),
                      p.astype(np.float16))


SETS = [_set(0), _set(1)]


def _train(device: str, steps: int = 6, checkpoint=None, cut_at: int | None = None):
    def on_step(done: int, model) -> None:
        if done == cut_at:
            raise KeyboardInterrupt  # the session ends here

    model, stats = distill_drafter(_config(), SETS, steps, 4, 1e-2, 0, "tiny", loss="top1", checkpoint=checkpoint,
                                   checkpoint_every=2, on_step=on_step, device=device)
    assert next(model.parameters()).device.type == device
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}, stats


def _same(a: dict, b: dict, exact: bool) -> None:
    for name in a:
        if exact:
            assert torch.equal(a[name], b[name]), name
        else:
            torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-5, msg=name)


def _top1_loss(state: dict) -> float:
    model = LlamaForCausalLM(_config())
    model.load_state_dict(state)
    s = SETS[0]
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.from_numpy(s.tokens[:, :-1].astype(np.int64))).logits, -1)
    ids = torch.from_numpy(s.topk_ids.astype(np.int64))
    return LOSSES["top1"](torch.from_numpy(s.topk_p.astype(np.float32)), logp.gather(-1, ids)).item()


@pytest.mark.parametrize("device", DEVICES)
def test_distillation_is_deterministic_and_learns(device):
    first, stats = _train(device, steps=20)
    again, _ = _train(device, steps=20)
    _same(first, again, exact=device == "cpu")
    assert stats["steps"] == 20 and stats["tokens"] == 20 * 4 * 8
    torch.manual_seed(0)
    start = LlamaForCausalLM(_config()).state_dict()  # distill_drafter's initialisation (seed 0)
    assert all(torch.isfinite(v).all() for v in first.values())
    assert _top1_loss(first) < _top1_loss(start) - 0.1


@pytest.mark.parametrize("saved_on, resumed_on", [("cpu", "cpu"), pytest.param("cuda", "cuda", marks=CUDA),
                                                  pytest.param("cuda", "cpu", marks=CUDA),
                                                  pytest.param("cpu", "cuda", marks=CUDA)])
def test_distillation_resumes_from_a_checkpoint_saved_on_any_device(tmp_path, saved_on, resumed_on):
    straight, _ = _train(resumed_on)
    ckpt = tmp_path / "tiny.ckpt"
    with pytest.raises(KeyboardInterrupt):
        _train(saved_on, checkpoint=ckpt, cut_at=5)  # checkpoints after steps 2 and 4, then dies in step 5
    assert ckpt.exists()
    resumed, _ = _train(resumed_on, checkpoint=ckpt)
    assert not ckpt.exists()
    _same(straight, resumed, exact=saved_on == resumed_on == "cpu")


@pytest.mark.parametrize("device", DEVICES)
def test_distill_set_does_not_depend_on_batch_sizes(device):
    torch.manual_seed(0)
    target = LlamaForCausalLM(_config()).eval().to(device)
    stream = np.random.default_rng(0).integers(0, VOCAB, size=500).astype(np.uint16)

    def build(batch: int, label_batch: int) -> DistillSet:
        return build_distill_set(target, stream, 7, 3, 4, 12, seed=3, desc="tiny", batch=batch,
                                 label_batch=label_batch)

    small, large = build(2, 3), build(100, 100)
    assert small.tokens.shape == (10, 12) and small.topk_ids.shape == (10, 11, 16)
    assert np.array_equal(small.tokens, large.tokens)
    assert np.array_equal(small.topk_ids[..., 0], large.topk_ids[..., 0])  # the argmax: what top1 learns
    np.testing.assert_allclose(small.topk_p.astype(np.float32), large.topk_p.astype(np.float32), atol=2e-3)
    if device != "cpu":  # prompts and text windows are drawn on the CPU: the same rows as a CPU build
        cpu = build_distill_set(target.cpu(), stream, 7, 3, 4, 12, seed=3, desc="tiny")
        assert np.array_equal(small.tokens[:, :4], cpu.tokens[:, :4])
        assert np.array_equal(small.tokens[7:], cpu.tokens[7:])


def test_drafters_step_refuses_a_distill_set_of_other_sizes(tmp_path):
    from model_family import recipe

    assert recipe.drafter_recipe()["loss"] == recipe.DISTILL_LOSS
    path = recipe.distill_set_path(tmp_path, "code")
    assert f"g{recipe.N_GENERATED}-t{recipe.N_TEXT}" in path.name
    _set(0, n=3, length=recipe.DISTILL_SEQ).save(path)
    with pytest.raises(ValueError, match="remove it"):
        recipe._load_distill_set(tmp_path, "code")
