"""`cosine generate`: one model of the family, plain decoding or speculative decoding in this process."""

from __future__ import annotations

import asyncio
import time

from model_family import DOMAINS
from model_family.sources import resolve_model, shipped


def add_parser(sub) -> None:
    g = sub.add_parser("generate", help="generate with one model of the family (plain decoding)")
    g.add_argument("--model", default="target", help="a shipped model (target, bench-target, drafter-<domain>), a "
                   "directory, or a Hugging Face id (org/name[@revision])")
    g.add_argument("--prompt", help="text to continue (default: one held-out prompt per domain)")
    g.add_argument("--chat", action="store_true", help="format the prompt with the chat template")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--drafter", help="speculative decoding with this drafter: a shipped domain (code, ...; auto: "
                   "the prompt's domain), a directory, or a Hugging Face id")
    g.add_argument("--k", type=int, default=4, help="draft length for --drafter")
    g.set_defaults(func=generate)


def generate(args) -> int:
    """Plain decoding with transformers, or speculative decoding (the service's loop, in process) with --drafter."""
    from transformers import AutoTokenizer

    from model_family.samples import domain_prompts

    path = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(path)
    prompts = [("given", args.prompt)] if args.prompt else domain_prompts(per_domain=1)
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
             if args.chat else p for _, p in prompts]
    ids = [tok(t, add_special_tokens=False).input_ids for t in texts]
    if args.drafter:
        outs, seconds = _speculative(ids, args, [d for d, _ in prompts])
    else:
        outs, seconds = _plain(ids, args, str(path), tok.pad_token_id)
    for (domain, prompt), (new, stats), dt in zip(prompts, outs, seconds):
        print(f"--- [{domain}] prompt: ...{prompt[-120:]!r}")
        print(f"+++ {args.model}: {tok.decode(new)!r}")
        extra = ""
        if stats:
            extra = (f", drafter {', '.join(stats['drafters_used'])}, mean accepted length "
                     f"{stats['mean_acceptance_length']:.2f}, acceptance rate {stats['draft_acceptance_rate']:.2f}")
        print(f"    ({len(new)} tokens in {dt:.2f} s, {len(new) / dt:.0f} tok/s{extra})", flush=True)
    return 0


def _plain(prompts: list[list[int]], args, path: str, pad_token_id):
    """Each prompt alone through transformers' generate."""
    import torch

    from engines.verifier import load_causal_lm

    model = load_causal_lm(path, "cpu")
    outs, seconds = [], []
    for p in prompts:
        t = time.time()
        with torch.no_grad():
            out = model.generate(torch.tensor([p]), max_new_tokens=args.max_tokens,
                                 do_sample=args.temperature > 0, temperature=args.temperature or None,
                                 top_p=None, top_k=None, pad_token_id=pad_token_id)
        outs.append((out[0, len(p):].tolist(), None))
        seconds.append(time.time() - t)
    return outs, seconds


def _speculative(prompts: list[list[int]], args, domains: list[str]):
    """Each prompt alone through the service's draft/verify loop, in this process."""
    from config import AppConfig
    from engines.sampling import SamplingParams
    from assembly.loop import build_loop, generate_all
    from speculation.messages import SpeculationOverrides

    # --drafter auto: the prompt's own domain when it is a held-out sample, else the generic drafter; a shipped
    # drafter by its domain; else a model source (an id or a directory)
    if args.drafter == "auto":
        names = [d if d in DOMAINS else "generic" for d in domains]
        models = {n: f"drafter-{n}" for n in names}
    elif shipped(f"drafter-{args.drafter}") is not None:
        names, models = [args.drafter] * len(domains), {args.drafter: f"drafter-{args.drafter}"}
    else:
        names, models = ["drafter"] * len(domains), {"drafter": args.drafter}
    cfg = AppConfig(verifier={"model": args.model, "max_batch": 1},
                    drafters=[{"name": n, "model": models[n]} for n in dict.fromkeys(names)],
                    speculation={"k": args.k, "adaptive": False, "draft_timeout_ms": 60_000})
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)

    async def run():
        loop = build_loop(cfg)
        outs, seconds = [], []
        for p, name in zip(prompts, names):
            t = time.time()
            [g] = await generate_all(loop, [p], [params], [SpeculationOverrides(drafters=[name])])
            seconds.append(time.time() - t)
            outs.append((g.token_ids, g.stats))
        return outs, seconds

    return asyncio.run(run())
