"""Drafters of other architectures than Llama draft exactly what transformers would: proposals, probabilities,
rollback and batching, on tiny random-weight models built from each architecture's transformers config. The fast
runner only where it is proven equal here (Llama, Qwen2, Qwen3, Mistral), transformers' own forward for the rest;
models that cannot draft are refused, and the KV budget sizes the request slots."""

from __future__ import annotations

import pytest
import torch
from transformers import (AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig, GPTNeoXConfig, LlamaConfig,
                          LlamaModel, MistralConfig, Phi3Config, Qwen2Config, Qwen3Config, T5Config,
                          T5ForConditionalGeneration)

from engines.cascade import CascadeDrafterEngine
from engines.drafter import DrafterEngine
from engines.drafter_runners import make_drafter_runner
from engines.interface import CacheFull, DrafterRunner, DraftingEngine
from engines.runner import LlamaRunner
from engines.transformers_runner import TransformersRunner

VOCAB, K, MAX_LEN = 8192, 6, 128
# weights wider than transformers' default init (0.02), so that next-token distributions are not nearly flat and
# greedy choices are not near-ties (every reference below checks its logit margins)
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=None, initializer_range=0.5)
GQA = dict(BASE, num_key_value_heads=2)
GEMMA = dict(GQA, head_dim=16, sliding_window=16, initializer_range=0.03)  # Gemma scales its embeddings up itself
CONFIGS = {  # (config, the runner "auto" picks)
    "llama": (LlamaConfig(**GQA), LlamaRunner),
    "qwen2": (Qwen2Config(**GQA), LlamaRunner),
    "qwen3": (Qwen3Config(**GQA, head_dim=16), LlamaRunner),
    "mistral": (MistralConfig(**GQA), LlamaRunner),
    # a window shorter than max_len: the fast runner would attend past it
    "mistral-window16": (MistralConfig(**dict(GQA, sliding_window=16)), TransformersRunner),
    "gemma2": (Gemma2Config(**GEMMA), TransformersRunner),
    "gemma3": (Gemma3TextConfig(**GEMMA), TransformersRunner),
    "phi3": (Phi3Config(**GQA), TransformersRunner),
    "gpt_neox": (GPTNeoXConfig(**BASE), TransformersRunner),
}
ARCHS = list(CONFIGS)
MIN_MARGIN = 1e-3  # logits of the greedy token and the runner-up, in every reference step
PROB_ATOL = 1e-5  # the proposals' probabilities against transformers' softmax (fp32)
# requests stepped together against each alone: a batched matmul may sum in another order (transformers 5.19's Phi-3
# differed by 1.3e-5 from its own one-request step)
BATCHED_PROB_ATOL = 5e-5


def _context(n: int, seed: int) -> list[int]:
    return torch.randint(2, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


CONTEXT = _context(40, 1)


@pytest.fixture(scope="module")
def models() -> dict:
    out = {}
    with torch.random.fork_rng():
        for name, (config, _) in CONFIGS.items():
            torch.manual_seed(0)
            out[name] = AutoModelForCausalLM.from_config(config).eval()
    return out


@torch.no_grad()
def greedy(model, context: list[int]) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' own greedy continuation of `context` (K tokens) and its next-token distributions."""
    out = model.generate(torch.tensor([context]), max_new_tokens=K, do_sample=False, output_logits=True,
                         return_dict_in_generate=True)
    top2 = [lg[0].float().topk(2).values for lg in out.logits]
    assert min(float(t[0] - t[1]) for t in top2) > MIN_MARGIN, "a near-tie: reseed the model or the context"
    return out.sequences[0, len(context):].tolist(), [torch.softmax(lg[0].float(), -1) for lg in out.logits]


def _assert_matches(chain, reference, atol: float = PROB_ATOL) -> None:
    tokens, probs = reference
    assert [p.token for p in chain] == tokens
    for p, q in zip(chain, probs):
        assert p.top_tokens[0] == p.token
        assert abs(p.prob - float(q[p.token])) <= atol
        assert torch.allclose(torch.tensor(p.top_probs), q[p.top_tokens], atol=atol, rtol=0)


def _draft_alone(engine: DrafterEngine, rid: str, context: list[int]):
    engine.sync(rid, context)
    return engine.draft([rid], K, alternatives=True)[rid]


@pytest.mark.parametrize("arch", ARCHS)
def test_proposals_and_probabilities_equal_transformers(models, arch):
    """(a) the drafted chain is transformers' greedy continuation, (b) with transformers' probabilities."""
    engine = DrafterEngine(models[arch], max_requests=4, max_len=MAX_LEN)
    assert type(engine.runner) is CONFIGS[arch][1]
    _assert_matches(_draft_alone(engine, "r", CONTEXT), greedy(models[arch], CONTEXT))


@pytest.mark.parametrize("arch", ARCHS)
def test_rollback_to_a_diverged_context(models, arch):
    """(c) after drafting, a context that diverges inside the prompt, then one that diverges inside the drafted
    tokens: the engine keeps the agreeing cached prefix and drafts transformers' continuation of the new context."""
    model = models[arch]
    engine = DrafterEngine(model, max_requests=4, max_len=MAX_LEN)
    _draft_alone(engine, "r", CONTEXT)
    inside_prompt = CONTEXT[:25] + _context(15, 2)
    engine.sync("r", inside_prompt)
    assert engine.runner.length("r") == 25
    chain = engine.draft(["r"], K)["r"]  # its first K - 1 tokens were fed back, and are cached now
    _assert_matches(chain, greedy(model, inside_prompt))
    drafted = [p.token for p in chain]
    inside_draft = inside_prompt + drafted[:3] + [(drafted[3] + 1) % VOCAB]
    engine.sync("r", inside_draft)
    assert engine.runner.length("r") == len(inside_prompt) + 3
    _assert_matches(engine.draft(["r"], K)["r"], greedy(model, inside_draft))


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_requests_equal_each_alone(models, arch):
    """(d) requests of different lengths (two of the same length: the transformers runner batches those) drafted
    in one engine's batched steps equal each drafted alone, and transformers."""
    model = models[arch]
    contexts = {"a": CONTEXT, "b": _context(23, 3), "c": _context(40, 4), "d": _context(31, 5)}
    together = DrafterEngine(model, max_requests=4, max_len=MAX_LEN)
    for rid, ctx in contexts.items():
        together.sync(rid, ctx)
    chains = together.draft(list(contexts), K)
    for rid, ctx in contexts.items():
        alone = _draft_alone(DrafterEngine(model, max_requests=1, max_len=MAX_LEN), rid, ctx)
        assert [p.token for p in chains[rid]] == [p.token for p in alone]
        assert [p.prob for p in chains[rid]] == pytest.approx([p.prob for p in alone], abs=BATCHED_PROB_ATOL, rel=0)
        _assert_matches(chains[rid], greedy(model, ctx), BATCHED_PROB_ATOL)


def test_both_runners_keep_the_protocols(models):
    for runner in ("fast", "transformers"):
        engine = DrafterEngine(models["qwen3"], max_requests=2, max_len=MAX_LEN, runner=runner)
        assert isinstance(engine, DraftingEngine) and isinstance(engine.runner, DrafterRunner)
        assert type(engine.runner) is {"fast": LlamaRunner, "transformers": TransformersRunner}[runner]


def test_runner_override(models):
    """"transformers" runs a fast-runner architecture through transformers (and equally); "fast" refuses what it
    cannot run, naming the model_type and the way out."""
    engine = DrafterEngine(models["qwen3"], max_requests=2, max_len=MAX_LEN, runner="transformers")
    assert isinstance(engine.runner, TransformersRunner)
    _assert_matches(_draft_alone(engine, "r", CONTEXT), greedy(models["qwen3"], CONTEXT))
    for arch in ("gemma2", "gpt_neox"):
        with pytest.raises(ValueError, match=rf"model_type '{models[arch].config.model_type}'.*runner='transformers'"):
            DrafterEngine(models[arch], max_len=MAX_LEN, runner="fast")
    with pytest.raises(ValueError, match=r"last 16 positions.*max_len <= 16, or \(a drafter\) runner='transformers'"):
        make_drafter_runner(models["mistral-window16"], 2, MAX_LEN, runner="fast")
    assert isinstance(make_drafter_runner(models["mistral-window16"], 2, 16), LlamaRunner)  # the window covers it
    with pytest.raises(ValueError, match="one of auto, fast, transformers"):
        make_drafter_runner(models["llama"], 2, MAX_LEN, runner="vllm")


def test_configurations_the_fast_runner_would_get_wrong_go_to_transformers():
    """A Qwen2 whose second layer attends over a window shorter than max_len, and a Llama whose rotary frequencies
    depend on the sequence length (the fast runner's cos/sin table is built once)."""
    windowed = Qwen2Config(**GQA, use_sliding_window=True, sliding_window=16, max_window_layers=1)
    assert windowed.layer_types == ["full_attention", "sliding_attention"]
    dynamic = LlamaConfig(**GQA, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    for config in (windowed, dynamic):
        model = AutoModelForCausalLM.from_config(config).eval()
        assert isinstance(make_drafter_runner(model, 2, MAX_LEN), TransformersRunner)
        with pytest.raises(ValueError, match="runner='transformers'"):
            make_drafter_runner(model, 2, MAX_LEN, runner="fast")


def test_models_that_cannot_draft_are_refused(tmp_path):
    t5 = T5Config(vocab_size=128, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2)
    with pytest.raises(ValueError, match=r"T5ForConditionalGeneration \(model_type 't5'\) is an encoder-decoder "
                                         r"model.*use a decoder-only causal LM"):
        DrafterEngine(T5ForConditionalGeneration(t5))
    t5.save_pretrained(tmp_path)  # refused from its config alone, before any weights are read
    with pytest.raises(ValueError, match=rf"the model at {tmp_path} \(model_type 't5'\) is an encoder-decoder"):
        DrafterEngine(str(tmp_path))
    headless = LlamaModel(LlamaConfig(**dict(GQA, vocab_size=128)))
    with pytest.raises(ValueError, match=r"LlamaModel \(model_type 'llama'\) is not a causal LM.*AutoModelForCausalLM"):
        DrafterEngine(headless)


def test_cascade_over_the_transformers_runner(models):
    """A Gemma drafter verifying a Llama assistant's guesses (commits of a prefix of a fed chain) drafts its own
    greedy chain."""
    cascade = CascadeDrafterEngine(models["gemma2"], models["llama"], assistant_k=3, max_len=MAX_LEN)
    assert isinstance(cascade.runner, TransformersRunner)
    _assert_matches(_draft_alone(cascade, "r", CONTEXT), greedy(models["gemma2"], CONTEXT))


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_vocab_limit_keeps_proposals_to_the_targets_ids(models, arch):
    """Ids from `vocab_limit` on are never proposed: the chain is the greedy one over the ids below it, with the
    probabilities over those ids."""
    model = models[arch]
    limit = max(greedy(model, CONTEXT)[0])  # takes an id of the unlimited chain away
    chain = _draft_alone(DrafterEngine(model, max_len=MAX_LEN, vocab_limit=limit), "r", CONTEXT)
    context, probs = list(CONTEXT), []
    with torch.no_grad():
        for _ in range(K):
            logits = model(torch.tensor([context])).logits[0, -1, :limit]
            top2 = logits.topk(2).values
            assert float(top2[0] - top2[1]) > MIN_MARGIN
            probs.append(torch.softmax(logits, -1))
            context.append(int(logits.argmax()))
    _assert_matches(chain, (context[len(CONTEXT):], probs))


@pytest.mark.parametrize("graphs", [False, True])
def test_qwen3_fast_runner_steps_equal_the_model(models, graphs):
    """Qwen3's q/k norms in the eager step and in the padded step CUDA graphs replay (run directly on a CPU)."""
    model = models["qwen3"]
    tokens = CONTEXT + _context(5, 6)
    runner = LlamaRunner(model, max_slots=2, max_len=MAX_LEN, graphs=graphs)
    runner.add("r")
    runner.forward(["r"], [CONTEXT], hidden_only_last=True)  # a prefill: eager either way
    runner.commit_all("r", CONTEXT)
    logits = runner.forward(["r"], [tokens[40:]])[0]
    with torch.no_grad():
        expected = model(torch.tensor([tokens])).logits[0, 40:]
    assert torch.allclose(logits, expected, atol=1e-4, rtol=0)  # logits of magnitude ~10: fp32 rounding


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_kv_budget_sizes_the_request_slots(models, arch, caplog):
    """Slots = min(max_requests, budget // one request's keys/values at max_len), on either runner; a budget that
    holds no request is refused, saying what one needs."""
    model = models[arch]
    per_request = 2 * 2 * 2 * 16 * 4 * MAX_LEN  # layers x (k, v) x kv heads x head_dim x fp32 bytes x positions
    caplog.set_level("INFO", logger="engines.drafter")
    engine = DrafterEngine(model, max_requests=8, max_len=MAX_LEN, kv_cache_bytes=3 * per_request + per_request // 2)
    assert engine.max_requests == engine.runner.max_slots == 3
    assert engine.kv_cache_bytes == 3 * per_request
    assert f"3 request slots at max_len {MAX_LEN}, KV cache {3 * per_request} bytes" in caplog.text
    for rid in "abc":
        engine.sync(rid, CONTEXT)
    with pytest.raises(CacheFull):
        engine.sync("d", CONTEXT)
    assert DrafterEngine(model, max_requests=8, max_len=MAX_LEN, kv_cache_bytes=100 * per_request).max_requests == 8
    assert DrafterEngine(model, max_requests=8, max_len=MAX_LEN).max_requests == 8  # no budget: as many as asked
    with pytest.raises(ValueError, match=rf"budget of {per_request - 1} bytes holds no request: one request at "
                                         rf"max_len {MAX_LEN} needs {per_request} bytes.*lower max_len or raise"):
        DrafterEngine(model, max_len=MAX_LEN, kv_cache_bytes=per_request - 1)


def test_runners_share_the_models_fused_weights_and_transformers_still_agrees():
    """q/k/v and gate/up are fused once per model: the modules' own weights become views of the fused matrices
    (no second copy: a 32B model's weights would not fit twice on one 80 GB GPU), a second runner of the same model
    reuses them, and the model's own forward still computes what it computed before."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen2Config(**GQA)).eval()
    ids = torch.tensor([_context(12, 1)])
    with torch.no_grad():
        before = model(ids).logits
    weights = {id(p) for p in model.parameters()}
    bytes_before = sum(p.untyped_storage().nbytes() for p in model.parameters())
    first, second = (LlamaRunner(model, max_slots=1, max_len=MAX_LEN) for _ in range(2))
    for a, b in zip(first.w.gate_up + first.w.qkv, second.w.gate_up + second.w.qkv):
        assert a.weight.data_ptr() == b.weight.data_ptr()  # one fused matrix per layer, whatever the runners
    layer = model.model.layers[0]
    fused = first.w.qkv[0].weight
    assert layer.self_attn.q_proj.weight.data_ptr() == fused.data_ptr()
    assert layer.self_attn.k_proj.weight.data_ptr() == fused[layer.self_attn.q_proj.out_features:].data_ptr()
    assert layer.mlp.up_proj.weight.data_ptr() == first.w.gate_up[0].weight[layer.mlp.gate_proj.out_features:].data_ptr()
    assert {id(p) for p in model.parameters()} == weights  # the same parameters, now views
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    assert sum(storages.values()) == bytes_before  # the fused matrices replaced the weights, none is held twice
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)
    first.add("r")
    assert torch.allclose(first.forward(["r"], [ids[0].tolist()])[0], before[0], atol=1e-4, rtol=0)
