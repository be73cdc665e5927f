"""OpenAI-compatible response pieces: ids, usage (with the speculation's statistics under vLLM's names), streamed
chunks, logprobs as vLLM's server writes them, Server-Sent Events and the /metrics text."""

from __future__ import annotations

import json
import time
import uuid


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int, spec: dict | None) -> dict:
    u = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
         "total_tokens": prompt_tokens + completion_tokens}
    if spec is not None:
        u.update(spec)
    return u


def chat_chunk(rid: str, model: str, created: int, delta: dict, finish_reason: str | None, index: int = 0,
               logprobs: dict | None = None, **fields) -> dict:
    """A streamed chat chunk of one choice; `fields`: more of the choice's (vLLM's token_ids)."""
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason,
                         **fields}]}


def completion_chunk(rid: str, model: str, created: int, text: str, finish_reason: str | None, index: int = 0,
                     logprobs: dict | None = None, **fields) -> dict:
    """A streamed completion chunk of one choice; `fields`: more of the choice's (vLLM's token ids)."""
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
                         **fields}]}


def _lp(x: float) -> float:
    return max(x, -9999.0)  # -inf as OpenAI (and vLLM) write it


def _bytes(s: str) -> list[int]:
    return list(s.encode("utf-8", errors="replace"))


def chat_logprobs(token_ids: list[int], logprobs: list[dict[int, float]], top: int, name) -> dict:
    """OpenAI's chat `logprobs` of these tokens, as vLLM's server writes them: `top_logprobs` are the first `top` of
    vLLM's entries (the token's own, then the most likely ones); `name` gives a token's string."""
    return {"content": [
        {"token": name(t), "logprob": _lp(d[t]), "bytes": _bytes(name(t)),
         "top_logprobs": [{"token": name(u), "logprob": _lp(x), "bytes": _bytes(name(u))}
                          for u, x in list(d.items())[:top]]}
        for t, d in zip(token_ids, logprobs)]}


def completion_logprobs(token_ids: list[int], logprobs: list[dict[int, float] | None], top: int, name,
                        offset: int = 0) -> dict:
    """OpenAI's completions `logprobs` of these tokens, as vLLM's server writes them (`top_logprobs`: up to top + 1
    entries, the token's own among them; None for an echoed prompt's first token); `offset`: the text offset of the
    first one."""
    out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t, d in zip(token_ids, logprobs):
        out["tokens"].append(name(t))
        out["token_logprobs"].append(None if d is None else _lp(d[t]))
        out["top_logprobs"].append(None if d is None else {name(u): _lp(x) for u, x in list(d.items())[:top + 1]})
        out["text_offset"].append(offset)
        offset += len(name(t))
    return out


def prompt_logprobs(entries: list[dict[int, tuple[float, int]] | None], name) -> list[dict | None]:
    """vLLM's `prompt_logprobs` of a response: per prompt token, None for the first, then {token id: {logprob, rank,
    decoded_token}} of the token and the most likely ones, as vLLM gave them."""
    return [None if d is None else {str(t): {"logprob": _lp(x), "rank": r, "decoded_token": name(t)}
                                    for t, (x, r) in d.items()} for d in entries]


def now() -> int:
    return int(time.time())


def spec_usage(stats: list[dict | None]) -> dict:
    """The request's speculation statistics under vLLM's names, over its choices (from the verifier's last chunk
    of each)."""
    ss = [s or {} for s in stats]
    total = {k: sum(s.get(k, 0) for s in ss) for k in ("num_draft_tokens", "num_accepted_tokens", "num_drafts",
                                                         "verify_steps")}
    drafts, drafted, accepted = total["num_drafts"], total["num_draft_tokens"], total["num_accepted_tokens"]
    # vLLM's definitions: 1 + accepted / drafts, accepted / drafted
    return {"mean_acceptance_length": round(1 + accepted / drafts if drafts else 1.0, 4),
            "draft_acceptance_rate": round(accepted / drafted if drafted else 0.0, 4),
            **total, "drafters_used": sorted({d for s in ss for d in s.get("drafters_used", [])})}


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def spec_decode_metrics(totals: dict, model: str) -> str:
    """The verifier's counters in Prometheus text under vLLM's names, so that clients made for vLLM
    (`vllm bench serve` reads `{base_url}/metrics`) report acceptance for this server."""
    label = f'model_name="{model}"'
    lines = []
    for name, doc in (("num_drafts", "drafts verified"), ("num_draft_tokens", "draft tokens verified"),
                      ("num_accepted_tokens", "draft tokens accepted"),
                      ("num_accepted_tokens_per_pos", "draft tokens accepted, by position in the draft")):
        metric = f"vllm:spec_decode_{name}_total"
        lines += [f"# HELP {metric} {doc}", f"# TYPE {metric} counter"]
        if name == "num_accepted_tokens_per_pos":
            lines += [f'{metric}{{{label},position="{i}"}} {n}' for i, n in enumerate(totals.get(name, []))]
        else:
            lines.append(f"{metric}{{{label}}} {totals.get(name, 0)}")
    return "\n".join(lines) + "\n"

