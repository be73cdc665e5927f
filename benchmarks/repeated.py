"""The repeated-context workload (`cosine bench anchors --workload repeated`): prompts whose answer repeats text
quoted in the prompt, as agent traffic does (code being changed, retrieved passages quoted back, records filled in
from a source), built deterministically from the same held-out texts as the greedy and sampled workloads
(`benchmarks.common.heldout_prompts`, never trained on).

Each held-out text's first `quote_len` tokens are quoted in one of three requests, and the prompt ends with the
quoted text's first `HEAD` tokens as the start of the answer, so that a model that copies copies from there:
- `edit` (the code domain): a change to make to the code, the code, then the changed code begun;
- `quote` (the other domains' even texts): a passage to summarise quoting it word for word, the summary begun;
- `record` (their odd texts): a document and a JSON record of it to complete, its `text` field begun.

The workload counts only where the target does copy: `workload_stats` gives, over the target's outputs, the share
of each output's 4-grams that occur in its prompt (`model_family.text_stats.copied_ngram_share`; the issue's bar:
a median of at least 0.3), beside the outputs' own text statistics.
"""

from __future__ import annotations

import json

from model_family import DOMAINS
from model_family.text_stats import copied_share_stats, text_stats

HEAD = 8  # tokens of the quoted text that begin the answer
COPY_BAR = 0.3  # the median copied 4-gram share below which the target does not copy enough for the workload


def _request(kind: str, domain: str, i: int, quote: str, head: str) -> str:
    if kind == "edit":
        return (f"Apply this change to the code below and print the whole file again: add a comment line "
                f"`# reviewed` at its end, change nothing else.\n\n```\n{quote}\n```\n\nThe whole file:\n```\n{head}")
    if kind == "quote":
        return (f"Summarise the passage below, quoting its sentences word for word.\n\nPassage:\n\"{quote}\"\n\n"
                f"Summary, quoting it: \"{head}")
    return (f"Complete the JSON record of the document below; its \"text\" field holds the document verbatim.\n\n"
            f"Document:\n{quote}\n\nRecord: {{\"id\": \"{domain}-{i}\", \"domain\": \"{domain}\", \"text\": "
            f"{json.dumps(head)[:-1]}")


def kind_of(domain: str, i: int) -> str:
    return "edit" if domain == "code" else ("quote", "record")[i % 2]


def repeated_prompts(tokenizer, per_domain: int, quote_len: int = 64) -> list[tuple[str, list[int]]]:
    """(domain, prompt ids) for `per_domain` held-out texts of every domain, in the order of `heldout_prompts`."""
    from model_family.samples import heldout_texts

    texts = heldout_texts()
    out = []
    for d in DOMAINS:
        for i, t in enumerate(texts[d][:per_domain]):
            ids = tokenizer(t, add_special_tokens=False).input_ids
            quote, head = tokenizer.decode(ids[:quote_len]), tokenizer.decode(ids[:HEAD])
            out.append((d, tokenizer(_request(kind_of(d, i), d, i, quote, head), add_special_tokens=False).input_ids))
    return out


def workload_stats(prompts: list[list[int]], outputs: list[list[int]]) -> dict:
    """The outputs' text statistics, how much of each output its prompt holds (copied 4-gram share), and whether
    the target copies enough for the workload to count (median at least COPY_BAR)."""
    copied = copied_share_stats(prompts, outputs)
    return {**(text_stats(outputs) or {}), "copied_4gram_share": copied,
            "copies_enough": copied is not None and copied["median"] >= COPY_BAR}
