"""The repeated-context workload (benchmarks/repeated.py): its prompts quote held-out text and begin the answer with
it, deterministically; its statistic, the share of an output's 4-grams its prompt holds."""

from __future__ import annotations

import json

from benchmarks.repeated import HEAD, kind_of, repeated_prompts, workload_stats
from model_family import DOMAINS
from model_family.text_stats import copied_ngram_share


def test_copied_share_counts_the_outputs_4grams_found_in_its_prompt():
    prompt = [1, 2, 3, 4, 5, 6]
    assert copied_ngram_share(prompt, [2, 3, 4, 5, 6]) == 1.0
    assert copied_ngram_share(prompt, [2, 3, 4, 5, 9, 9]) == 1 / 3  # (2,3,4,5) yes; (3,4,5,9), (4,5,9,9) no
    assert copied_ngram_share(prompt, [1, 2, 3]) == 0.0  # no 4-gram at all
    copying = workload_stats([prompt, prompt], [[1, 2, 3, 4, 5], [3, 4, 5, 6, 7]])
    assert copying["copied_4gram_share"]["median"] == 0.75 and copying["copies_enough"]
    assert not workload_stats([prompt], [[9, 8, 7, 6, 5]])["copies_enough"]


def test_repeated_prompts_quote_held_out_text_and_begin_the_answer_with_it(tokenizer, heldout):
    prompts = repeated_prompts(tokenizer, per_domain=2, quote_len=48)
    assert prompts == repeated_prompts(tokenizer, per_domain=2, quote_len=48)  # deterministic
    assert [d for d, _ in prompts] == [d for d in DOMAINS for _ in range(2)]
    assert {kind_of(d, i) for d in DOMAINS for i in range(2)} == {"edit", "quote", "record"}
    for j, (d, ids) in enumerate(prompts):
        source = tokenizer(heldout[d][j % 2], add_special_tokens=False).input_ids
        text = tokenizer.decode(ids)
        assert tokenizer.decode(source[:48]) in text  # the quote, whole
        head = tokenizer.decode(source[:HEAD])  # the answer begun: the quote's start (a JSON string in a record)
        assert text.endswith(json.dumps(head)[:-1] if kind_of(d, j % 2) == "record" else head)
