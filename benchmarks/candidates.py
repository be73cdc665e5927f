"""`cosine models acceptance-matrix --target ID --drafter NAME=ID ... --prompts FILE`: candidate drafters for any
target, measured on the user's own prompts before they are deployed.

Each prompt's greedy continuation by the target is computed once (transformers' `generate`); each drafter then
drafts through the drafter engine the service runs (the same runner choice, dtype and vocabulary limit), as a
greedy chain drafter would: it drafts k tokens from the committed context, the prefix that equals the target's
continuation plus one target token is committed, repeat. Greedy verification is deterministic, so this is exactly
the mean accepted length the served graph would measure with that drafter alone at draft length k.

The prompt file is JSON lines: {"domain": "...", "prompt": "..."} (or "messages": [...] with the target's chat
template applied). Drafters are checked against the target's vocabulary first, as at startup.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from engines.drafter import DrafterEngine
from engines.verifier import load_causal_lm
from model_family import compat
from model_family.sources import resolve_model


def read_prompts(path: Path, tokenizer) -> list[tuple[str, list[int]]]:
    """(domain, prompt token ids) per line of a JSON-lines file; a bad line is an error naming it."""
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            domain = str(row["domain"])
            if "messages" in row:
                text = tokenizer.apply_chat_template(row["messages"], tokenize=False, add_generation_prompt=True)
            else:
                text = str(row["prompt"])
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{n}: each line must be JSON with 'domain' and 'prompt' (or 'messages'): "
                             f"{e}") from None
        ids = tokenizer(text, add_special_tokens=False).input_ids
        if not ids:
            raise ValueError(f"{path}:{n}: the prompt is empty")
        out.append((domain, ids))
    if not out:
        raise ValueError(f"{path}: no prompts")
    return out


@torch.no_grad()
def target_continuation(target, prompt: list[int], new_tokens: int, eos: tuple[int, ...]) -> list[int]:
    out = target.generate(torch.tensor([prompt], device=target.device), max_new_tokens=new_tokens, do_sample=False,
                          top_p=None, top_k=None, temperature=None, eos_token_id=list(eos) or None,
                          pad_token_id=eos[0] if eos else 0)
    return out[0, len(prompt):].tolist()


def chain_speculation(engine: DrafterEngine, rid: str, prompt: list[int], truth: list[int],
                      k: int) -> tuple[int, int, int]:
    """Greedy chain speculation of `engine` against the target's continuation `truth`: (verifications, accepted
    draft tokens, drafted tokens)."""
    pos = verifications = accepted = drafted = 0
    while pos < len(truth):
        kk = min(k, len(truth) - pos - 1)
        match = 0
        if kk > 0:
            engine.sync(rid, prompt + truth[:pos])
            chain = engine.draft([rid], kk)[rid]
            for p, t in zip(chain, truth[pos:pos + kk]):
                if p.token != t:
                    break
                match += 1
        accepted, drafted, verifications = accepted + match, drafted + kk, verifications + 1
        pos += match + 1
    engine.release(rid)
    return verifications, accepted, drafted


def acceptance_matrix(target: str, drafters: dict[str, str], prompts_file: Path, k: int = 4, new_tokens: int = 64,
                      device: str = "cpu", dtype: str = "auto", log=print) -> dict:
    """Mean accepted length (bonus token included) and acceptance rate of every drafter on every domain of the
    prompt file, with each drafter's drafting time per round and per drafted token on this machine (one request at
    a time: an upper bound on what a batched replica spends per request)."""
    target_dir = resolve_model(target)
    tok = compat.load_tokenizer(target_dir)
    for name, ref in drafters.items():
        for warning in compat.check_vocabulary(f"drafter {name}", ref, compat.load_tokenizer(resolve_model(ref)), tok,
                                               target):
            log(f"warning: {warning}")
    prompts = read_prompts(prompts_file, tok)
    eos = compat.eos_token_ids(target_dir, tok)
    model = load_causal_lm(str(target_dir), device, dtype)
    log(f"target {target}: greedy continuations of {len(prompts)} prompts ({new_tokens} tokens each)")
    truths = [target_continuation(model, p, new_tokens, eos) for _, p in prompts]
    del model
    vocab = compat.shared_vocab_size(tok, target_dir)
    domains = sorted({d for d, _ in prompts})
    rows = {}
    for name, ref in drafters.items():
        engine = DrafterEngine(str(resolve_model(ref)), name=name, max_requests=1,
                               max_len=max(len(p) + len(t) for (_, p), t in zip(prompts, truths)) + k + 1,
                               device=device, dtype=dtype, vocab_limit=vocab)
        per: dict[str, list[tuple[int, int, int]]] = {d: [] for d in domains}
        t = time.perf_counter()
        for i, ((domain, prompt), truth) in enumerate(zip(prompts, truths)):
            per[domain].append(chain_speculation(engine, f"p{i}", prompt, truth, k))
        seconds = time.perf_counter() - t
        cells = {}
        for d, runs in per.items():
            v, a, n = (sum(x[j] for x in runs) for j in range(3))
            cells[d] = {"mean_accepted_length": round((a + v) / max(v, 1), 3),
                        "acceptance_rate": round(a / max(n, 1), 3), "verifications": v}
        rounds = sum(x[0] for runs in per.values() for x in runs)
        tokens = sum(x[2] for runs in per.values() for x in runs)
        kind = type(engine.runner).__name__
        rows[name] = {"model": ref, "runner": kind, "domains": cells,
                      "mean": round(statistics.mean(c["mean_accepted_length"] for c in cells.values()), 3),
                      "ms_per_round": round(1000 * seconds / max(rounds, 1), 3),
                      "ms_per_drafted_token": round(1000 * seconds / max(tokens, 1), 3)}
        log(f"drafter {name} ({ref}, {kind}): mean accepted length {rows[name]['mean']:.2f}")
    return {"target": target, "k": k, "new_tokens": new_tokens, "prompts": str(prompts_file), "device": device,
            "domains": domains, "drafters": rows}


def format_matrix(result: dict) -> str:
    domains = result["domains"]
    lines = ["| drafter | " + " | ".join(domains) + " | mean |", "|---" * (len(domains) + 2) + "|"]
    for name, row in result["drafters"].items():
        best = {d: max(r["domains"][d]["mean_accepted_length"] for r in result["drafters"].values()) for d in domains}
        cells = [f"{row['domains'][d]['mean_accepted_length']:.2f}" + (" *" if row["domains"][d][
            "mean_accepted_length"] == best[d] else "") for d in domains]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {row['mean']:.2f} |")
    return "\n".join(lines)
