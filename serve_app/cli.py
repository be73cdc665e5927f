"""The `cosine` command line."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from model_family import DOMAINS
from model_family.paths import REPO_ROOT, model_path, models_dir
from model_family.sources import ModelUnavailable, resolve_model, shipped

RECIPE_STEPS = ("corpora", "tokenizer", "target", "distill", "drafters", "matrix")
# Wall-clock minutes of each step measured on a 2-core x86-64 CPU (see docs/model_card.md).
STEP_MINUTES = {"corpora": 1, "tokenizer": 0.5, "target": 44, "distill": 20, "drafters": 20, "matrix": 3}


def _models_train(args) -> int:
    from model_family import recipe

    steps = RECIPE_STEPS if args.steps == ["all"] else args.steps
    data, models = Path(args.data_dir), Path(args.models_dir)
    eta = sum(STEP_MINUTES[s] for s in steps)
    print(f"recipe steps {', '.join(steps)}: about {eta:.0f} min on a 2-core CPU", flush=True)
    for s in steps:
        t = time.time()
        print(f"== {s} (about {STEP_MINUTES[s]} min)", flush=True)
        if s == "corpora":
            recipe.step_corpora(data, args.seed)
        elif s == "tokenizer":
            recipe.step_tokenizer(data, models, args.seed)
        elif s == "target":
            recipe.step_target(data, models, args.seed)
        elif s == "distill":
            recipe.step_distill_sets(data, models, args.seed, device=args.device)
        elif s == "drafters":
            recipe.step_drafters(data, models, args.seed, device=args.device)
        elif s == "matrix":
            recipe.step_heldout_samples(data, models)
            _print_matrix(recipe.step_acceptance_matrix(models, Path(args.matrix_json)))
            recipe.step_model_card(data, models, REPO_ROOT / "docs", Path(args.matrix_json),
                                   models / "latency.json")
        print(f"== {s} done in {(time.time() - t) / 60:.1f} min", flush=True)
    return 0


def _print_matrix(matrix: dict) -> list[str]:
    from model_family.model_card import format_matrix
    from model_family.recipe import check_acceptance

    print(f"mean accepted length per verification (k={matrix['k']}, greedy, bonus token included)")
    print(format_matrix(matrix))
    problems = check_acceptance(matrix)
    print("acceptance criteria: " + ("met" if not problems else "NOT met:\n  " + "\n  ".join(problems)))
    return problems


def _models_card(args) -> int:
    from model_family.recipe import step_model_card

    m = models_dir()
    out = step_model_card(Path(args.data_dir), m, REPO_ROOT / "docs", m / "acceptance_matrix.json",
                          m / "latency.json")
    print(f"wrote {out}")
    return 0


def _models_acceptance(args) -> int:
    if args.target or args.drafter or args.prompts_file:
        return _acceptance_any(args)
    from model_family.recipe import step_acceptance_matrix

    matrix = step_acceptance_matrix(models_dir(), Path(args.json), k=args.k, n_prompts=args.prompts,
                                    new_tokens=args.new_tokens)
    print(f"wrote {args.json}")
    return 1 if _print_matrix(matrix) and args.strict else 0


def _acceptance_any(args) -> int:
    """The matrix for any target, drafters and prompt file (benchmarks/acceptance.py)."""
    from benchmarks.acceptance import acceptance_matrix, format_matrix

    if not (args.target and args.drafter and args.prompts_file):
        raise SystemExit("cosine: error: --target, --drafter NAME=MODEL (one or more) and --prompts-file go together")
    drafters = {}
    for d in args.drafter:
        name, sep, ref = d.partition("=")
        if not sep or not name or not ref:
            raise SystemExit(f"cosine: error: --drafter {d!r}: expected NAME=MODEL (a shipped name, directory or id)")
        drafters[name] = ref
    try:  # a bad prompt file, or a drafter no engine runs: one line, like a model that cannot be had
        result = acceptance_matrix(args.target, drafters, Path(args.prompts_file), k=args.k,
                                   new_tokens=args.new_tokens, device=args.device, dtype=args.dtype)
    except ValueError as e:
        print(f"cosine: error: {e}", file=sys.stderr)
        return 2
    print(f"mean accepted length per verification (k={args.k}, greedy, bonus token included; * best per domain)")
    print(format_matrix(result))
    Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")
    return 0


def _models_ablate(args) -> int:
    from model_family.ablation import ablate, append_result

    result = ablate(Path(args.data_dir), models_dir(), args.domains, args.steps, args.lr, args.loss,
                    args.extra_generated, model_path(args.init), eval_at=tuple(args.eval_at))
    append_result(Path(args.json), result)
    print(json.dumps(result, indent=2))
    return 0


def _models_bench_target(args) -> int:
    from model_family.bench_target import build_bench_target

    out = build_bench_target(model_path("target"), Path(args.out) if args.out else models_dir() / "bench-target",
                             args.factor)
    print(f"wrote {out} ({json.loads((out / 'family.json').read_text())['params'] / 1e6:.1f}M parameters)")
    return 0


def _models_latency(args) -> int:
    from model_family.latency import format_latencies, measure_family

    rows = measure_family(models_dir(), context=args.context, repeats=args.repeats)
    print(f"per-token latency on this machine ({args.context}-token context, batch 1, median of {args.repeats})")
    print(format_latencies(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


def _generate(args) -> int:
    """Plain decoding with transformers, or speculative decoding (the service's loop, in process) with --drafter."""
    import torch
    from transformers import AutoTokenizer

    from engines.verifier import load_causal_lm
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
        model = load_causal_lm(str(path), "cpu")
        outs, seconds = [], []
        for p in ids:
            t = time.time()
            with torch.no_grad():
                out = model.generate(torch.tensor([p]), max_new_tokens=args.max_tokens,
                                     do_sample=args.temperature > 0, temperature=args.temperature or None,
                                     top_p=None, top_k=None, pad_token_id=tok.pad_token_id)
            outs.append((out[0, len(p):].tolist(), None))
            seconds.append(time.time() - t)
    for (domain, prompt), (new, stats), dt in zip(prompts, outs, seconds):
        print(f"--- [{domain}] prompt: ...{prompt[-120:]!r}")
        print(f"+++ {args.model}: {tok.decode(new)!r}")
        extra = ""
        if stats:
            extra = (f", drafter {', '.join(stats['drafters_used'])}, mean accepted length "
                     f"{stats['mean_acceptance_length']:.2f}, acceptance rate {stats['draft_acceptance_rate']:.2f}")
        print(f"    ({len(new)} tokens in {dt:.2f} s, {len(new) / dt:.0f} tok/s{extra})", flush=True)
    return 0


def _speculative(prompts: list[list[int]], args, domains: list[str]):
    """Each prompt alone through the service's draft/verify loop, in this process."""
    import asyncio

    from config import AppConfig
    from engines.sampling import SamplingParams
    from model_family import DOMAINS
    from speculation.inprocess import build_loop, generate_all
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cosine", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

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
    g.set_defaults(func=_generate)

    m = sub.add_parser("models", help="the model family: train, derive, measure")
    msub = m.add_subparsers(dest="models_command", required=True)
    card = msub.add_parser("card", help="render docs/model_card.md from what the recipe recorded")
    card.add_argument("--data-dir", default=str(REPO_ROOT / "data"))
    card.set_defaults(func=_models_card)
    t = msub.add_parser("train", help="the full recipe from package names to weights")
    t.add_argument("--steps", nargs="+", default=["all"], choices=("all",) + RECIPE_STEPS)
    t.add_argument("--data-dir", default=str(REPO_ROOT / "data"))
    t.add_argument("--models-dir", default=str(REPO_ROOT / "models"))
    t.add_argument("--matrix-json", default=str(REPO_ROOT / "models" / "acceptance_matrix.json"))
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--device", default="cpu", help="where the distill and drafters steps run: cpu, or cuda on a "
                   "GPU machine (the other steps run on the CPU)")
    t.set_defaults(func=_models_train)

    a = msub.add_parser("acceptance-matrix", help="every drafter x every domain, greedy chain speculation (the "
                        "shipped family, or --target/--drafter/--prompts-file: any models on your prompts)")
    a.add_argument("--k", type=int, default=4)
    a.add_argument("--prompts", type=int, default=24, help="held-out prompts per domain")
    a.add_argument("--new-tokens", type=int, default=64)
    a.add_argument("--json", default="acceptance_matrix.json")
    a.add_argument("--strict", action="store_true", help="exit 1 when the acceptance criteria are not met")
    a.add_argument("--target", help="any target (shipped name, directory or Hugging Face id) instead of the shipped "
                   "family's; with --drafter and --prompts-file")
    a.add_argument("--drafter", action="append", help="NAME=MODEL, a candidate drafter (repeat the option)")
    a.add_argument("--prompts-file", help='JSON lines: {"domain": ..., "prompt": ...} or {"domain": ..., '
                   '"messages": [...]}')
    a.add_argument("--device", default="cpu", help="with --target: cpu or cuda")
    a.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    a.set_defaults(func=_models_acceptance)

    ab = msub.add_parser("ablate", help="one distillation recipe change: domain drafters' margin over a generic "
                         "drafter fine-tuned with the same budget (needs `train --steps corpora distill` first)")
    ab.add_argument("--domains", nargs="+", default=["code", "dialogue"], choices=DOMAINS)
    ab.add_argument("--steps", type=int, default=800, help="fine-tuning steps of every drafter")
    ab.add_argument("--lr", type=float, default=1.5e-3)
    ab.add_argument("--loss", default="fkl", choices=("fkl", "tvd", "top1"))
    ab.add_argument("--extra-generated", type=int, default=0,
                    help="more greedy target continuations per measured domain, beside the recipe's set")
    ab.add_argument("--init", default="drafter-generic", help="the drafter every run starts from")
    ab.add_argument("--eval-at", nargs="*", type=int, default=[],
                    help="also measure after these numbers of steps (the learning curve of the margin)")
    ab.add_argument("--data-dir", default=str(REPO_ROOT / "data"))
    ab.add_argument("--json", default=str(REPO_ROOT / "models" / "recipe_ablation.json"),
                    help="appends one record per run (the model card renders this file)")
    ab.set_defaults(func=_models_ablate)

    b = msub.add_parser("bench-target", help="derive the cost-realistic widened target")
    b.add_argument("--factor", type=int, default=4)
    b.add_argument("--out", help="output directory (default: models/bench-target)")
    b.set_defaults(func=_models_bench_target)

    lat = msub.add_parser("latency", help="per-token decode latency of every model on this machine")
    lat.add_argument("--context", type=int, default=256)
    lat.add_argument("--repeats", type=int, default=30)
    lat.add_argument("--json")
    lat.set_defaults(func=_models_latency)

    s = sub.add_parser("serve", help="run a Serve config on this machine: ready check, URLs, Ctrl-C stops it")
    s.add_argument("config", nargs="?", default=str(REPO_ROOT / "examples" / "local.yaml"))
    s.add_argument("--port", type=int, help="HTTP port (default: the config's http_options.port)")
    s.add_argument("--dashboard-port", type=int, default=8265)
    s.add_argument("--ready-timeout", type=float, default=900.0, help="seconds to wait for the first answer")
    s.add_argument("--api-key", help="require `Authorization: Bearer KEY` from clients (sets COSINE_API_KEY for "
                   "the ingress; default: that variable from this environment, else no authentication)")
    s.set_defaults(func=_serve)

    pr = sub.add_parser("profile", help="step latencies of a config's verifier and drafters on this machine: the "
                        "goodput controller's starting models (speculation.controller.*_seed_ms)")
    pr.add_argument("config", nargs="?", default=str(REPO_ROOT / "examples" / "local.yaml"))
    pr.set_defaults(func=_profile)

    pk = sub.add_parser("package", help="this project's code as one zip for a Serve config's runtime_env "
                        "(working_dir), so that every node of a cluster runs it (docs/deploy.md)")
    pk.add_argument("--out", default=".", help="the zip's path, or a directory for cosine-serve.zip")
    pk.set_defaults(func=_package)

    c = sub.add_parser("config", help="the configuration schema (every tunable, with descriptions)")
    csub = c.add_subparsers(dest="config_command", required=True)
    csub.add_parser("schema", help="JSON Schema of the Serve application's args").set_defaults(func=_config_schema)
    csub.add_parser("docs", help="the Markdown reference (docs/config.md)").set_defaults(func=_config_docs)
    cv = csub.add_parser("validate", help="validate a Serve config file's application args")
    cv.add_argument("file")
    cv.set_defaults(func=_config_validate)

    bench = sub.add_parser("bench", help="benchmarks that print tables and write JSON")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    e = bsub.add_parser("engine", help="speculative engines vs target-only and HF assisted generation")
    e.add_argument("--per-domain", type=int, default=2, help="held-out prompts per domain")
    e.add_argument("--new-tokens", type=int, default=128)
    e.add_argument("--k", type=int, default=4)
    e.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    e.add_argument("--no-hf", action="store_true", help="skip Hugging Face assisted generation")
    e.add_argument("--repeats", type=int, default=3, help="timed runs of every method, interleaved; the median "
                                                         "counts (after one warm-up run each)")
    e.add_argument("--device", default="cpu", help="where the models run: cpu, or cuda on a GPU machine")
    e.add_argument("--methods", nargs="+", help="run only the methods whose names contain one of these (and "
                   "target-only, the reference), e.g. 'Minions' 'chain, generic'; 'HF' for HF assisted generation")
    e.add_argument("--pool", nargs="+", choices=["auto", "off"], default=["off"], help="speculation.pool_drafters "
                   "for our methods; both: side by side, with the pool's ratio per batch")
    e.add_argument("--target-scale", type=int, nargs=2, metavar=("FACTOR", "LAYERS"), help="instead of the bench "
                   "target, the trained target widened FACTOR times and deepened to LAYERS (identity layers), built "
                   "on the device: a target of realistic cost on a GPU (16 16: 7.3B parameters); no HF rows then")
    e.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="every model's weights (bfloat16 on a GPU, as served)")
    e.add_argument("--json", default="bench_results/engine.json")
    e.set_defaults(func=_bench_engine)
    from benchmarks.steps import add_arguments as add_steps

    st = bsub.add_parser("steps", help="step costs of the paper's models (random weights of their real configs) "
                         "through our engine, eager and with CUDA graphs, on this machine's GPU")
    add_steps(st)
    st.set_defaults(func=_bench_steps)
    co = bsub.add_parser("collaborative", help="CoS vs token-by-token collaborative decoding (ensemble, "
                         "contrastive)")
    co.add_argument("--per-domain", type=int, default=1, help="held-out prompts per domain")
    co.add_argument("--new-tokens", type=int, default=96)
    co.add_argument("--k", type=int, default=4, help="the partner's draft length")
    co.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    co.add_argument("--repeats", type=int, default=3, help="timed runs of every configuration, interleaved; the "
                    "median counts (after one warm-up run each)")
    co.add_argument("--partner", default="drafter-generic", help="the partner model of the bench target")
    co.add_argument("--json", default="bench_results/collaborative.json")
    co.set_defaults(func=_bench_collaborative)
    sv = bsub.add_parser("serve", help="the running application: speculation variants side by side")
    sv.add_argument("--url", default="http://127.0.0.1:8000")
    sv.add_argument("--model", default="cosine-target")
    sv.add_argument("--per-domain", type=int, default=2)
    sv.add_argument("--new-tokens", type=int, default=128)
    sv.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    sv.add_argument("--repeats", type=int, default=3, help="timed runs of every variant, interleaved; the median "
                                                           "counts (after one warm-up run each)")
    sv.add_argument("--suite", choices=["cosine", "chains", "collaborative"], default="cosine",
                    help="the variants for the deployed config: cosine (examples/bench.yaml), chains "
                         "(examples/chains.yaml), collaborative (examples/collaborative.yaml)")
    sv.add_argument("--variants", nargs="+", help="run only these variants of the suite (names as printed; "
                                                  "default: all)")
    sv.add_argument("--config", help="the Serve config the graph runs (e.g. examples/bench.yaml): also run every "
                                     "variant through the same loop in this process and print served / in-process")
    sv.add_argument("--json", default="bench_results/serve.json")
    sv.add_argument("--metrics-url", help="Ray's metrics agent, e.g. http://127.0.0.1:8080/metrics: sample the "
                                          "Prometheus metrics during the run into the JSON")
    sv.add_argument("--plot-dir", help="render the sampled metrics as PNG here (needs the docs extra)")
    sv.set_defaults(func=_bench_serve)
    an = bsub.add_parser("anchors", help="ours with the vLLM verifier vs vLLM target-only, vLLM draft_model and "
                                         "ngram speculation and HF assisted generation, side by side")
    an.add_argument("--config", default="examples/bench.yaml", help="our configuration (served and in process)")
    an.add_argument("--per-domain", type=int, default=2, help="held-out prompts per domain")
    an.add_argument("--new-tokens", type=int, default=128)
    an.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    an.add_argument("--repeats", type=int, default=3, help="timed runs of every system, interleaved; the median "
                                                           "counts (after one warm-up run each)")
    an.add_argument("--no-served", action="store_true", help="skip ours through Ray Serve")
    an.add_argument("--k", type=int, default=4, help="draft tokens per step for every method (ours: the maximum)")
    an.add_argument("--port", type=int, default=8011, help="loopback port of the served graph (and port + 1 for "
                                                           "its dashboard)")
    an.add_argument("--json", default="bench_results/anchors.json")
    an.set_defaults(func=_bench_anchors)

    rd = bsub.add_parser("rounds", help="ours in process with the goodput controller's draft lengths against fixed "
                         "ones: tokens/s and, from the loop's trace, draft depth and acceptance round by round")
    rd.add_argument("--config", default="examples/bench.yaml", help="our configuration")
    rd.add_argument("--per-domain", type=int, default=2, help="held-out prompts per domain")
    rd.add_argument("--new-tokens", type=int, default=128)
    rd.add_argument("--concurrency", type=int, default=1)
    rd.add_argument("--k", type=int, default=8, help="the controller's maximum and the longer fixed length (the "
                                                     "shorter: k / 2)")
    rd.add_argument("--repeats", type=int, default=3, help="timed runs of every system, interleaved")
    rd.add_argument("--json", default="bench_results/rounds.json")
    rd.set_defaults(func=_bench_rounds)

    ld = bsub.add_parser("load", help="Poisson arrivals light load to saturation through HTTP: fixed k, "
                         "the controllers, the autoscaler (goodput, TPOT, drafter replica-seconds per rate)")
    ld.add_argument("--config", default=str(REPO_ROOT / "examples" / "bench.yaml"))
    ld.add_argument("--systems", default="k=0,k=2,k=4,k=6,hill_climb,goodput,goodput+deployments,goodput+autoscaler")
    ld.add_argument("--rates", default="0.25,0.5,1,2", help="requests/s, comma-separated")
    ld.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per rate")
    ld.add_argument("--repeats", type=int, default=3)
    ld.add_argument("--max-tokens", type=int, default=128)
    ld.add_argument("--port", type=int, default=8031, help="HTTP port of the system under test (+1: dashboard)")
    ld.add_argument("--json", default="bench_results/load.json")
    ld.add_argument("--plot", help="write the plot here (needs matplotlib: pip install -e .[docs])")
    ld.set_defaults(func=_bench_load)

    sk = bsub.add_parser("soak", help="a long mixed run (streaming or not, clients hanging up, bursts above "
                         "saturation) against the served graph: errors by kind, latency, replica memory and "
                         "leftover requests at start and end")
    sk.add_argument("--config", default=str(REPO_ROOT / "examples" / "local.yaml"))
    sk.add_argument("--duration", type=float, default=1800.0, help="seconds of arrivals")
    sk.add_argument("--rate", type=float, default=1.0, help="requests/s in the calm part of each cycle")
    sk.add_argument("--overload-rate", type=float, default=8.0, help="requests/s in the burst of each cycle")
    sk.add_argument("--period", type=float, default=120.0, help="seconds per cycle")
    sk.add_argument("--overload-share", type=float, default=0.25, help="share of each cycle in the burst")
    sk.add_argument("--hang-up-share", type=float, default=0.1, help="share of clients that hang up midway")
    sk.add_argument("--max-requests", type=int, default=20000)
    sk.add_argument("--max-tokens", type=int, default=64)
    sk.add_argument("--port", type=int, default=8041, help="HTTP port of the graph (+1: its dashboard)")
    sk.add_argument("--json", default="bench_results/soak.json")
    sk.set_defaults(func=_bench_soak)

    from simulate.report import add_parser as add_simulate

    add_simulate(sub, str(REPO_ROOT / "examples" / "local.yaml"))
    return p


def _bench_soak(args) -> int:
    from benchmarks.soak import main

    return main(args)


def _config_schema(args) -> int:
    from config import AppConfig

    print(json.dumps(AppConfig.model_json_schema(), indent=2))
    return 0


def _config_docs(args) -> int:
    from config import reference_markdown

    print(reference_markdown())
    return 0


def _config_validate(args) -> int:
    import yaml
    from pydantic import ValidationError

    from config import AppConfig

    failed = 0
    for app in (yaml.safe_load(Path(args.file).read_text()) or {}).get("applications", []):
        try:
            AppConfig.model_validate(app.get("args") or {})
            print(f"{app.get('name')}: ok")
        except ValidationError as e:
            failed += 1
            print(f"{app.get('name')}: {e}")
    return 1 if failed else 0


def _profile(args) -> int:
    """Fits t(tokens) of the configured verifier engine and t(requests) of a lockstep drafter step, and prints
    them as the controller's seeds (it refits both online; the seeds price the first rounds)."""
    import yaml

    from autoscale.profiling import profile_verifier
    from speculation.profiling import fit_draft_latency
    from config import AppConfig
    from engines.build import build_verifier_engine
    from engines.verifier import load_causal_lm

    app = (yaml.safe_load(Path(args.config).read_text()) or {})["applications"][0]
    cfg = AppConfig.model_validate(app.get("args") or {})
    engine = build_verifier_engine(cfg)
    try:
        k, b = cfg.speculation.k, cfg.verifier.max_batch
        verify = profile_verifier(engine, batches=sorted({1, max(1, b // 2), b}), ks=sorted({0, k // 2, k}))
    finally:
        getattr(engine, "shutdown", lambda: None)()
    draft = None
    if cfg.drafters:
        draft = fit_draft_latency(load_causal_lm(str(resolve_model(cfg.drafters[0].model)), "cpu"), b)
    print(f"# measured by `cosine profile {args.config}`: t = a + b * n in ms (n: tokens in a verify step; "
          "requests in a drafter step)")
    print("speculation:\n  controller:")
    print(f"    verify_seed_ms: [{1000 * verify.a:.3f}, {1000 * verify.b:.3f}]")
    if draft is not None:
        print(f"    draft_seed_ms: [{1000 * draft.a:.3f}, {1000 * draft.b:.3f}]")
    return 0


def _package(args) -> int:
    from serve_app.package import build_package

    out = build_package(Path(args.out)).resolve()
    print(f"{out} ({out.stat().st_size // 1024} KiB). Copy it to the same path on every node, or upload it, and set "
          f"in the Serve config:\n  runtime_env: {{working_dir: \"file://{out}\"}}  (or https://... / s3://...)")
    return 0


def _serve(args) -> int:
    from serve_app.launch import serve_forever

    import os

    if args.api_key:
        os.environ["COSINE_API_KEY"] = args.api_key  # inherited by the Ray processes serve_forever starts
    return serve_forever(Path(args.config), args.port, args.dashboard_port, args.ready_timeout)


def _bench_anchors(args) -> int:
    from benchmarks.anchors import main as bench_main

    return bench_main(args)


def _bench_rounds(args) -> int:
    from benchmarks.rounds import main as bench_main

    return bench_main(args)


def _bench_load(args) -> int:
    from benchmarks.load import main as bench_main

    return bench_main(args)


def _bench_serve(args) -> int:
    from benchmarks.serve import main as bench_main

    return bench_main(args)


def _bench_collaborative(args) -> int:
    from benchmarks.collaborative import main as bench_main

    return bench_main(args)


def _bench_steps(args) -> int:
    from benchmarks.steps import main as steps_main

    return steps_main(args)


def _bench_engine(args) -> int:
    from benchmarks.engine import main as bench_main

    return bench_main(args)


def main(argv: list[str] | None = None) -> int:
    """A command's failure that the user can fix (a model that cannot be had or does not fit the target, a bad
    configuration) is one line on stderr and exit status 2, not a traceback."""
    from pydantic import ValidationError

    from model_family.compat import IncompatibleModels

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ModelUnavailable, IncompatibleModels) as e:
        print(f"cosine: error: {e}", file=sys.stderr)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'config'}: {err['msg']}" for err in e.errors())
        print(f"cosine: error: invalid configuration: {problems}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
