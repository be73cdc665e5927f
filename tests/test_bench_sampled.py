"""Sampled workloads: the text statistics beside every benchmark's speed, and the distribution check of sampled
outputs (the PIT chi-square of benchmarks/sampled.py) that replaces token identity when temperature > 0."""

from __future__ import annotations

import argparse

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from benchmarks.sampled import P_FLOOR, Sampling, add_arguments, check_cell, distribution_pvalue
from model_family.text_stats import repeated_ngram_share, stats_cells, text_stats


def test_repeated_4gram_share_on_hand_made_outputs():
    assert repeated_ngram_share([1, 2, 3, 4, 1, 2, 3, 4]) == pytest.approx(1 / 5)  # (1,2,3,4) again at the end
    assert repeated_ngram_share([1, 2, 3, 4, 5, 6, 7, 8]) == 0.0
    assert repeated_ngram_share([7] * 10) == pytest.approx(6 / 7)  # every 4-gram after the first repeats it
    assert repeated_ngram_share([1, 2, 1, 2, 1, 2]) == pytest.approx(1 / 3)  # (1,2,1,2) at 2
    assert repeated_ngram_share([1, 2, 3]) == 0.0  # no 4-gram at all
    assert repeated_ngram_share([1, 2, 3, 1, 2, 3], n=3) == pytest.approx(1 / 4)


def test_text_stats_median_min_max_and_cells():
    stats = text_stats([[1, 2, 3, 4, 1, 2, 3, 4], [5] * 10, [1, 2, 3, 4, 5, 6]])
    assert stats["outputs"] == 3
    assert stats["distinct_tokens"] == {"median": 4, "min": 1, "max": 6}
    assert stats["repeated_4gram_share"] == {"median": 0.2, "min": 0.0, "max": round(6 / 7, 3)}
    assert stats_cells(stats) == ("4 (1-6)", "0.20 (0.00-0.86)")
    assert text_stats([]) is None and stats_cells(None) == ("-", "-")


def test_sampling_flags_and_seeds():
    p = argparse.ArgumentParser()
    add_arguments(p)
    s = Sampling.from_args(p.parse_args(["--temperature", "0.7", "--top-p", "0.95", "--seed", "3"]))
    assert (s.temperature, s.top_p, s.seed, s.greedy) == (0.7, 0.95, 3, False)
    assert s.seeds(3, 0) == [3, 4, 5] and s.seeds(3, 2) == [20_003, 20_004, 20_005]
    assert Sampling.from_args(p.parse_args([])).seeds(4, 1) is None  # greedy: no seeds
    with pytest.raises(ValueError, match="top-p"):
        Sampling(0.7, 0.0)


def _model(seed: int = 0, vocab: int = 48, peaked: bool = True) -> LlamaForCausalLM:
    """A tiny random Llama; `peaked`: a few likely tokens at every position, as a trained model has."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128)
    model = LlamaForCausalLM(cfg).eval()
    if peaked:
        with torch.no_grad():
            model.lm_head.weight.mul_(4)
    return model


def _sample(model, prompts: list[list[int]], n: int, temperature: float, top_p: float,
            g: torch.Generator) -> list[list[int]]:
    """`n` tokens after each prompt (all of one length), sampled at these settings."""
    from engines.sampling import SamplingParams, target_probs

    ids = torch.tensor(prompts)
    with torch.no_grad():
        for _ in range(n):
            probs = target_probs(model(input_ids=ids).logits[:, -1], SamplingParams(temperature=temperature,
                                                                                  top_p=top_p))
            ids = torch.cat([ids, torch.multinomial(probs, 1, generator=g)], dim=1)
    return ids[:, len(prompts[0]):].tolist()


def test_distribution_check_passes_the_right_distribution_and_flags_wrong_ones():
    """Outputs sampled from the model at the benchmark's settings pass; the same model sampled at another
    temperature, without the top-p cut, or greedily fails the check."""
    model = _model()
    g = torch.Generator().manual_seed(1)
    prompts = [[i, (3 * i) % 48, (7 * i) % 48] for i in range(12)]
    s = Sampling(0.7, 0.8, seed=5)

    def p_of(temperature, top_p):
        runs = [_sample(model, prompts, 40, temperature, top_p, g) for _ in range(2)]
        return distribution_pvalue(model, prompts, runs, s)

    right = p_of(0.7, 0.8)
    assert right["tokens"] == 2 * 12 * 40 and right["p"] > P_FLOOR
    assert p_of(1.0, 0.8)["p"] < P_FLOOR
    assert p_of(0.7, 1.0)["p"] < P_FLOOR
    assert p_of(0.0, 1.0)["p"] < P_FLOOR
    assert check_cell({"distribution_p": right["p"]}).startswith("p = ")
    assert check_cell({"distribution_p": 1e-9}).endswith("FAILED")
    assert check_cell({"identical": True}) == "yes" and check_cell({"identical": False}) == "NO"


def test_the_headline_puts_each_run_in_its_own_column_labelled_with_its_settings():
    from benchmarks import headline
    from benchmarks.anchors import SERVED, TARGET_ONLY, VLLM_SERVE

    def run(sampling, served):
        rows = [{"system": s, "concurrency": c, "tokens_per_s": t, "tokens_per_s_min": 0.95 * t,
                 "tokens_per_s_max": 1.05 * t} for c in (1, 8)
                for s, t in ((SERVED, served), (TARGET_ONLY, 40.0), ("vLLM draft_model, generic drafter", 100.0))]
        return {"config": {"k": 4} | ({"sampling": sampling.as_dict()} if sampling else {}), "rows": rows,
                "workload": {"distinct_tokens": {"median": 18.0}, "repeated_4gram_share": {"median": 0.724}}}

    lines = headline.anchors_table([run(None, 80.0), run(Sampling(0.7, 0.95), 60.0)])
    assert lines[0] == "| result | k = 4, greedy | k = 4, sampled (T = 0.7, top_p 0.95) |"
    assert lines[2].endswith("| 2.00x (80.0 / 40.0 tok/s; repeats 1.81-2.21x) "
                             "| 1.50x (60.0 / 40.0 tok/s; repeats 1.36-1.66x) |")
    assert lines[3].endswith("| 0.80x (80.0 / 100.0 tok/s, generic drafter; repeats 0.72-0.88x) "
                             "| 0.60x (60.0 / 100.0 tok/s, generic drafter; repeats 0.54-0.66x) |")
    assert lines[-1].endswith("| 18, 0.72 | 18, 0.72 |")
    # a sampled run where vLLM's own speculation samples the wrong distribution says so beside its figure
    wrong = run(Sampling(0.7, 0.95), 60.0)
    for r in wrong["rows"]:
        r["distribution_p"] = 0.0 if r["system"].startswith("vLLM draft_model") else 0.5
    assert headline.anchors_table([wrong])[3].endswith(
        "| 0.60x (60.0 / 100.0 tok/s, generic drafter; its samples fail the distribution test; repeats 0.54-0.66x) |")
    assert "fail" not in headline.anchors_table([run(Sampling(0.7, 0.95), 60.0)])[3]
    # where a run has vllm serve, the served rows are read against it too; a run without it says so
    served = run(Sampling(0.7, 0.95), 60.0)
    served["rows"] += [{"system": VLLM_SERVE, "concurrency": c, "tokens_per_s": 50.0, "tokens_per_s_min": 47.5,
                        "tokens_per_s_max": 52.5} for c in (1, 8)]
    lines = headline.anchors_table([run(None, 80.0), served])
    assert len(lines) == 9 and "`vllm serve`" in lines[4] and "`vllm serve`" in lines[7]
    assert lines[4].endswith("| not in this run | 1.20x (60.0 / 50.0 tok/s; repeats 1.09-1.33x) |")
    assert len(headline.anchors_table([run(None, 80.0)])) == 7


def test_hf_assisted_generation_samples_the_targets_distribution_with_our_arguments():
    """HF assisted generation, as the benchmarks call it (benchmarks.sampled.hf_sampling), samples the target's
    distribution at the benchmark's settings; called without them (HF adds top-k 50 to sampling it is not told
    otherwise about) it samples another, which the check flags. A vocabulary of 256 with no few likely tokens, so that
    the top-p 0.95 set is wider than 50 tokens."""
    from benchmarks.sampled import hf_sampling

    target, assistant = _model(0, 256, peaked=False), _model(1, 256, peaked=False)
    for model in (target, assistant):
        model.generation_config.eos_token_id = None
    prompts = [[i, (3 * i) % 256, (7 * i) % 256] for i in range(8)]
    s = Sampling(0.7, 0.95, seed=3)

    def p_of(kwargs: dict) -> float:
        outputs = []
        for i, p in enumerate(prompts):
            torch.manual_seed(100 + i)
            with torch.no_grad():
                out = target.generate(torch.tensor([p]), assistant_model=assistant, max_new_tokens=16,
                                      pad_token_id=0, **kwargs)
            outputs.append(out[0, len(p):].tolist())
        return distribution_pvalue(target, prompts, [outputs], s)["p"]

    assert p_of(hf_sampling(0.7, 0.95)) > P_FLOOR
    assert p_of({"do_sample": True, "temperature": 0.7, "top_p": 0.95}) < P_FLOOR
