"""`cosine models ...`: the model family: train it from package names to weights, derive, measure, document."""

from __future__ import annotations

import json
import time
from pathlib import Path

from model_family import DOMAINS
from model_family.paths import REPO_ROOT, model_path, models_dir

RECIPE_STEPS = ("corpora", "tokenizer", "target", "distill", "drafters", "matrix")
# Wall-clock minutes of each step measured on a 2-core x86-64 CPU (see docs/model_card.md).
STEP_MINUTES = {"corpora": 1, "tokenizer": 0.5, "target": 44, "distill": 20, "drafters": 20, "matrix": 3}
DATA_DIR = str(REPO_ROOT / "data")


def add_parser(sub) -> None:
    m = sub.add_parser("models", help="the model family: train, derive, measure")
    msub = m.add_subparsers(dest="models_command", required=True)
    card = msub.add_parser("card", help="render docs/model_card.md from what the recipe recorded")
    card.add_argument("--data-dir", default=DATA_DIR)
    card.set_defaults(func=card_command)
    t = msub.add_parser("train", help="the full recipe from package names to weights")
    t.add_argument("--steps", nargs="+", default=["all"], choices=("all",) + RECIPE_STEPS)
    t.add_argument("--data-dir", default=DATA_DIR)
    t.add_argument("--models-dir", default=str(REPO_ROOT / "models"))
    t.add_argument("--matrix-json", default=str(REPO_ROOT / "models" / "acceptance_matrix.json"))
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--device", default="cpu", help="where the distill and drafters steps run: cpu, or cuda on a "
                   "GPU machine (the other steps run on the CPU)")
    t.set_defaults(func=train)
    _add_acceptance(msub)
    _add_ablate(msub)
    b = msub.add_parser("bench-target", help="derive the cost-realistic widened target")
    b.add_argument("--factor", type=int, default=4)
    b.add_argument("--out", help="output directory (default: models/bench-target)")
    b.set_defaults(func=bench_target)
    lat = msub.add_parser("latency", help="per-token decode latency of every model on this machine")
    lat.add_argument("--context", type=int, default=256)
    lat.add_argument("--repeats", type=int, default=30)
    lat.add_argument("--json")
    lat.set_defaults(func=latency)


def _add_acceptance(msub) -> None:
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
    a.set_defaults(func=acceptance)


def _add_ablate(msub) -> None:
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
    ab.add_argument("--data-dir", default=DATA_DIR)
    ab.add_argument("--json", default=str(REPO_ROOT / "models" / "recipe_ablation.json"),
                    help="appends one record per run (the model card renders this file)")
    ab.set_defaults(func=ablate)


def train(args) -> int:
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


def card_command(args) -> int:
    from model_family.recipe import step_model_card

    m = models_dir()
    out = step_model_card(Path(args.data_dir), m, REPO_ROOT / "docs", m / "acceptance_matrix.json",
                          m / "latency.json")
    print(f"wrote {out}")
    return 0


def acceptance(args) -> int:
    if args.target or args.drafter or args.prompts_file:
        return _acceptance_any(args)
    from model_family.recipe import step_acceptance_matrix

    matrix = step_acceptance_matrix(models_dir(), Path(args.json), k=args.k, n_prompts=args.prompts,
                                    new_tokens=args.new_tokens)
    print(f"wrote {args.json}")
    return 1 if _print_matrix(matrix) and args.strict else 0


def _acceptance_any(args) -> int:
    """The matrix for any target, drafters and prompt file (benchmarks/candidates.py)."""
    from benchmarks.candidates import acceptance_matrix, format_matrix

    if not (args.target and args.drafter and args.prompts_file):
        raise ValueError("--target, --drafter NAME=MODEL (one or more) and --prompts-file go together")
    drafters = {}
    for d in args.drafter:
        name, sep, ref = d.partition("=")
        if not sep or not name or not ref:
            raise ValueError(f"--drafter {d!r}: expected NAME=MODEL (a shipped name, directory or id)")
        drafters[name] = ref
    # a bad prompt file, or a drafter no engine runs: a ValueError, one line (serve_app/cli.py)
    result = acceptance_matrix(args.target, drafters, Path(args.prompts_file), k=args.k,
                               new_tokens=args.new_tokens, device=args.device, dtype=args.dtype)
    print(f"mean accepted length per verification (k={args.k}, greedy, bonus token included; * best per domain)")
    print(format_matrix(result))
    Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")
    return 0


def ablate(args) -> int:
    from model_family.ablation import ablate as run_ablation, append_result

    result = run_ablation(Path(args.data_dir), models_dir(), args.domains, args.steps, args.lr, args.loss,
                          args.extra_generated, model_path(args.init), eval_at=tuple(args.eval_at))
    append_result(Path(args.json), result)
    print(json.dumps(result, indent=2))
    return 0


def bench_target(args) -> int:
    from model_family.bench_target import build_bench_target

    out = build_bench_target(model_path("target"), Path(args.out) if args.out else models_dir() / "bench-target",
                             args.factor)
    print(f"wrote {out} ({json.loads((out / 'family.json').read_text())['params'] / 1e6:.1f}M parameters)")
    return 0


def latency(args) -> int:
    from model_family.latency import format_latencies, measure_family

    rows = measure_family(models_dir(), context=args.context, repeats=args.repeats)
    print(f"per-token latency on this machine ({args.context}-token context, batch 1, median of {args.repeats})")
    print(format_latencies(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0
