"""The shipped model family: loading, tokenization, the bench target's equivalence. vLLM's greedy parity with the
target: tests/test_vllm_verifier.py::test_vllm_target_only_agrees_with_the_reference."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from model_family import DOMAINS
from model_family.distill import greedy_continue
from model_family.recipe import DRAFTERS, check_acceptance


def test_tokenizer_round_trips_every_domain(tokenizer, heldout):
    assert len(tokenizer) == 8192
    for domain in DOMAINS:
        for text in heldout[domain][:10]:
            ids = tokenizer(text, add_special_tokens=False).input_ids
            assert tokenizer.decode(ids) == text, domain
            assert len(ids) < len(text) / 2.5, f"{domain}: tokenizer barely compresses"


def test_chat_template_formats_messages(tokenizer):
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello?"}],
        tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello?<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3


@pytest.mark.parametrize("name", ["target"] + [f"drafter-{d}" for d in DRAFTERS])
def test_model_loads_and_predicts_domain_text(models, tokenizer, heldout, name):
    model = AutoModelForCausalLM.from_pretrained(models / name, dtype=torch.float32).eval()
    assert model.dtype == torch.float32
    params = sum(p.numel() for p in model.parameters())
    if name == "target":
        assert 10e6 <= params <= 20e6
    else:
        assert 1e6 <= params <= 3e6
    # A trained model predicts held-out text of its domain far better than chance (perplexity 8192).
    domain = name.removeprefix("drafter-") if name.removeprefix("drafter-") in DOMAINS else "literature"
    ids = torch.tensor([tokenizer(heldout[domain][0], add_special_tokens=False).input_ids[:128]])
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss
    assert torch.exp(loss) < (400 if name == "target" else 1500)


def test_drafters_are_much_cheaper_than_target(models):
    target = json.loads((models / "target" / "config.json").read_text())
    drafter = json.loads((models / "drafter-generic" / "config.json").read_text())
    # Non-embedding compute per token scales with layers * hidden^2.
    cost = lambda c: c["num_hidden_layers"] * c["hidden_size"] ** 2  # noqa: E731
    assert cost(target) >= 8 * cost(drafter)


@pytest.fixture(scope="module")
def bench_target(tmp_path_factory, models):
    """Built on demand, as a fresh checkout's first `cosine serve` of examples/local.yaml builds it: resolving the
    name builds it whole into place, over what an interrupted build left, once."""
    import os

    from model_family.sources import resolve_model

    root = tmp_path_factory.mktemp("models")
    (root / "target").symlink_to(models / "target")
    (root / "bench-target").mkdir()
    (root / "bench-target" / "model.safetensors").write_bytes(b"half written")
    before = os.environ.get("COSINE_MODELS_DIR")
    os.environ["COSINE_MODELS_DIR"] = str(root)
    try:
        out = resolve_model("bench-target")
        built = (out / "model.safetensors").stat().st_mtime_ns
        assert out == root / "bench-target" and resolve_model("bench-target") == out
        assert (out / "model.safetensors").stat().st_mtime_ns == built  # not built again
        assert [p.name for p in root.iterdir() if p.name.startswith(".")] == []  # nothing left aside
    finally:
        os.environ.pop("COSINE_MODELS_DIR") if before is None else os.environ.update(COSINE_MODELS_DIR=before)
    return AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()


def test_bench_target_is_far_more_expensive(bench_target, models):
    drafter = AutoModelForCausalLM.from_pretrained(models / "drafter-generic", dtype=torch.float32)
    body = lambda m: sum(p.numel() for n, p in m.named_parameters() if ".layers." in n)  # noqa: E731
    assert body(bench_target) >= 100 * body(drafter)


BENCH_TOLERANCE = 1e-4  # max |p_bench - p_target| over the vocabulary, fp32


def _assert_same_distribution(a, b, domain_prompt_ids) -> None:
    for domain, prompts in domain_prompt_ids.items():
        ids = torch.tensor(prompts)
        with torch.no_grad():
            p = torch.softmax(a(input_ids=ids).logits, -1)
            q = torch.softmax(b(input_ids=ids).logits, -1)
        assert (p - q).abs().max().item() < BENCH_TOLERANCE, domain


def test_bench_target_preserves_next_token_distribution(bench_target, target, domain_prompt_ids):
    _assert_same_distribution(target, bench_target, domain_prompt_ids)


# over 10 s on the 2-core CPU (the bench target's greedy decoding): slow
@pytest.mark.slow
def test_bench_target_greedy_equals_target(bench_target, target, domain_prompt_ids):
    # every domain's prompts in one batch (they are all 48 tokens): the bench target's weights read once a step
    domains = [d for d, prompts in domain_prompt_ids.items() for _ in prompts]
    ids = torch.tensor([p for prompts in domain_prompt_ids.values() for p in prompts])
    a = greedy_continue(target, ids, 32)
    b = greedy_continue(bench_target, ids, 32)
    assert [d for d, x, y in zip(domains, a, b) if not torch.equal(x, y)] == []


def test_deepened_target_computes_the_same_function(target, domain_prompt_ids, models):
    """`widen` with more layers than the model's: the appended layers are the identity (zero output projections),
    so the wider, deeper model predicts what the target predicts while costing a full layer each."""
    from model_family.bench_target import realistic_target

    deep = realistic_target(models, 2, 7, "cpu", torch.float32)
    assert deep.config.num_hidden_layers == 7 and deep.config.hidden_size == 2 * target.config.hidden_size
    extra = deep.model.layers[5]
    assert extra.self_attn.q_proj.weight.abs().sum() > 0 and extra.mlp.down_proj.weight.abs().sum() == 0
    _assert_same_distribution(target, deep, domain_prompt_ids)


def test_shipped_acceptance_matrix_meets_criteria(models):
    matrix = json.loads((models / "acceptance_matrix.json").read_text())
    assert set(matrix["drafters"]) == set(DRAFTERS)
    assert check_acceptance(matrix) == []


@pytest.mark.slow
def test_shipped_weights_reproduce_the_acceptance_matrix(models):
    """The committed matrix is what the shipped weights measure: cells recomputed from the weights (the same
    held-out prompts, greedy, deterministic) equal the JSON's, for a domain's own drafter and the generic one
    (one domain: about 25 s)."""
    from model_family.acceptance import held_out_sequences, measure

    domain = "code"
    matrix = json.loads((models / "acceptance_matrix.json").read_text())
    seqs = held_out_sequences(models, [domain], matrix["prompts_per_domain"], matrix["prompt_len"],
                              matrix["new_tokens"])[domain]
    for name in (domain, "generic"):
        drafter = AutoModelForCausalLM.from_pretrained(models / f"drafter-{name}", dtype=torch.float32).eval()
        got = measure(drafter, seqs, matrix["prompt_len"], matrix["k"])
        want = matrix["drafters"][name][domain]
        assert got.verifications == want["verifications"], name
        assert got.mean_accepted_length == pytest.approx(want["mean_accepted_length"], abs=1e-9), name


def test_training_resumes_from_its_checkpoint_exactly(tmp_path):
    """A run cut off mid-model and started again ends with the weights of a run never cut off."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from model_family.train import fit

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)

    def run(checkpoint=None, cut_at=None):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
        calls = []

        def batch_loss(rng: np.random.Generator) -> torch.Tensor:
            if cut_at is not None and len(calls) == cut_at:
                raise KeyboardInterrupt  # the session ends here
            calls.append(1)
            x = torch.from_numpy(rng.integers(0, 64, size=(4, 9)))
            return model(input_ids=x[:, :-1], labels=x[:, :-1]).loss

        fit(model, 10, 1e-2, 0, "tiny", batch_loss, checkpoint=checkpoint, every=3)
        return model

    straight = run()
    ckpt = tmp_path / "tiny.ckpt"
    with pytest.raises(KeyboardInterrupt):
        run(ckpt, cut_at=7)  # checkpoints after steps 3 and 6, then dies in step 7
    assert ckpt.exists()
    resumed = run(ckpt)
    assert not ckpt.exists()  # removed once the model is complete
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name


def test_distillation_divergences_vanish_only_at_the_target():
    """Both divergences are least where the drafter equals the target's distribution (TVD is zero there) and grow
    as it moves away; TVD counts the mass outside the target's top-K too."""
    from model_family.distill import LOSSES

    torch.manual_seed(0)
    target = torch.softmax(torch.randn(3, 5, 32), -1)
    p, ids = target.topk(8, dim=-1)
    exact = target.log().gather(-1, ids)
    assert LOSSES["tvd"](p, exact).item() < 1e-6
    near = torch.log_softmax(target.log() + 0.3 * torch.randn_like(target), -1).gather(-1, ids)
    far = torch.log_softmax(target.log() + 3.0 * torch.randn_like(target), -1).gather(-1, ids)
    for name in ("fkl", "tvd"):
        assert LOSSES[name](p, exact) < LOSSES[name](p, near) < LOSSES[name](p, far), name
    # a drafter putting all its mass outside the target's top-K is as far as it gets: TVD = the top-K's mass
    outside = torch.full_like(p, -30.0)
    assert abs(LOSSES["tvd"](p, outside).item() - p.sum(-1).mean().item()) < 1e-4


def test_top1_distillation_is_cross_entropy_to_the_targets_argmax():
    """The top1 loss ignores the shape of the target's distribution: it is the drafter's cross-entropy to the
    target's argmax, so it keeps falling as the drafter grows surer of that token, beyond the target itself."""
    import torch.nn.functional as F

    from model_family.distill import LOSSES

    torch.manual_seed(0)
    target = torch.softmax(torch.randn(3, 5, 32), -1)
    p, ids = target.topk(8, dim=-1)
    drafter = torch.log_softmax(torch.randn(3, 5, 32), -1)
    want = F.nll_loss(drafter.reshape(-1, 32), target.argmax(-1).reshape(-1))
    assert torch.allclose(LOSSES["top1"](p, drafter.gather(-1, ids)), want)
    sharper = torch.log_softmax(4 * target.log(), -1)  # same argmax, more mass on it than the target gives
    assert LOSSES["top1"](p, sharper.gather(-1, ids)) < LOSSES["top1"](p, target.log().gather(-1, ids))


def test_training_reports_every_step_to_its_callback():
    """`on_step` sees every step once, in order, with the model being trained (the ablation's learning curve)."""
    from transformers import LlamaConfig

    from model_family.distill import DistillSet, distill_drafter

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    rng = np.random.default_rng(0)
    data = DistillSet(rng.integers(0, 64, size=(6, 9)).astype(np.uint16),
                      rng.integers(0, 64, size=(6, 8, 4)).astype(np.uint16),
                      np.full((6, 8, 4), 0.25, dtype=np.float16))
    seen = []
    model, _ = distill_drafter(config, [data], 5, 2, 1e-2, 0, "tiny",
                               on_step=lambda done, m: seen.append((done, m)))
    assert [done for done, _ in seen] == [1, 2, 3, 4, 5]
    assert all(m is model for _, m in seen)


def test_agreement_splits_copied_tokens_from_new_ones():
    """A continuation token seen earlier in the context counts as a copy; agreement is scored per kind."""
    from types import SimpleNamespace

    from model_family.acceptance import agreement_by_kind, copy_mask

    seq = torch.tensor([[5, 6, 7, 5, 6, 9, 7]])  # prompt 5 6 7; continuation 5 6 9 7: copy, copy, new, copy
    assert copy_mask(seq, 3).tolist() == [[True, True, False, True]]

    def drafter(input_ids):  # right on every token but the second copy (position 4 predicts 1, not 6)
        nxt = seq[:, 1:].clone()
        nxt[0, 3] = 1
        return SimpleNamespace(logits=torch.nn.functional.one_hot(nxt, 10).float())

    got = agreement_by_kind(drafter, seq, 3)
    assert got == {"copy_share": 0.75, "copy": round(2 / 3, 3), "new": 1.0, "all": 0.75}


def test_model_card_renders_an_ablation_run_with_its_learning_curve():
    from model_family.model_card import format_ablation, format_agreement

    point = lambda g, o: {"generic": {"code": g}, "own": {"code": o}, "margin": {"code": round(o / g, 3)}}  # noqa: E731
    kinds = {"copy_share": 0.8, "copy": 0.9, "new": 0.5, "all": 0.82}
    run = {"config": {"domains": ["code"], "steps": 400, "lr": 1e-3, "loss": "top1", "extra_generated": 0},
           "start": {"code": 3.0}, **point(3.5, 3.85), "curve": {"200": point(3.2, 3.6), "100": point(3.1, 3.3)},
           "agreement": {"generic": {"code": kinds}, "own": {"code": {**kinds, "new": 0.7}}}, "seconds": 600}
    rows = format_ablation([run]).splitlines()[2:]
    assert [r.split(" | ")[1] for r in rows] == ["100", "200", "400"]  # the curve in order, the run's end last
    assert rows[-1].endswith("| 3.00 | 3.50 | 3.85 | 1.100x | 10 |")
    assert format_agreement([run]).splitlines()[2] == "| 400, 0.001, top1, 0 | code | 80% | 0.900 | 0.900 | 0.500 | 0.700 |"
