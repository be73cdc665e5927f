"""`cosine simulate` on the command line: runs a study, prints its table, writes JSON and (optionally) plots."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.provenance import with_provenance
from model_family.paths import REPO_ROOT

DEFAULT_TRACE = REPO_ROOT / "simulate" / "traces" / "local.jsonl"


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def _floats(text: str | None) -> dict[str, float] | None:
    return {k: float(v) for k, v in (x.split("=") for x in text.split(","))} if text else None


def write_result(result: dict, path: str) -> None:
    """The result JSON with its provenance (benchmarks/provenance.py)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(with_provenance(result), indent=1))
    print(f"wrote {path}")


def validation_table(result: dict) -> str:
    lines = ["| concurrency | latency model fitted on | throughput tok/s: measured (min-max) | simulated | error "
             "| ms/token: measured (min-max) | simulated | error |", "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        t, m = r["throughput_tok_s"], r["latency_ms_per_token"]
        lines.append(f"| {r['concurrency']} | {r['fitted_on']} | {t['measured']:.1f} ({t['measured_min']:.1f}-"
                     f"{t['measured_max']:.1f}) | {t['simulated']:.1f} | {t['error']:+.1%} | {m['measured']:.1f} "
                     f"({m['measured_min']:.1f}-{m['measured_max']:.1f}) | {m['simulated']:.1f} | {m['error']:+.1%} |")
    return "\n".join(lines)


def out_of_sample_table(result: dict) -> str:
    """One row per run: measured throughput, latency per token and verify step; then each simulated from the even
    half of the run's own steps and from the runs beside it, with its error."""
    lines = ["| run | measured: tok/s, ms/token, verify ms | from the even half of its steps: tok/s, ms/token, verify "
             "ms | from the runs beside it: tok/s, ms/token, verify ms |", "|---|---|---|---|"]
    keys = (("throughput_tok_s", 1), ("latency_ms_per_token", 2), ("verify_ms", 2))
    runs: dict[tuple, dict] = {}
    for r in result["rows"]:
        runs.setdefault((r["repeats"][0], r["concurrency"]), {})["half" if r["half"] == 0 else "beside"] = r
    for (rep, conc), by in sorted(runs.items()):
        measured = ", ".join(f"{by['half'][k]['measured']:.{d}f}" for k, d in keys)
        sims = [", ".join(f"{by[w][k]['simulated']:.{d}f} ({by[w][k]['error']:+.1%})" for k, d in keys)
                for w in ("half", "beside")]
        lines.append(f"| concurrency {conc}, repeat {rep} | {measured} | {sims[0]} | {sims[1]} |")
    return "\n".join(lines)


def reproduction_tables(result: dict) -> str:
    out = ["| profile | batch | system | tok/s | x no-spec | ms/token | accepted length | target passes/token |",
           "|---|---|---|---|---|---|---|---|"]
    base = {(r["profile"], r["batch"]): r for r in result["offline"] if r["system"] == "no-spec"}
    for r in result["offline"]:
        b = base[(r["profile"], r["batch"])]
        out.append(f"| {r['profile']} | {r['batch']} | {r['system']} | {r['throughput_tok_s']:.0f} | "
                   f"{r['throughput_tok_s'] / b['throughput_tok_s']:.2f} | {r['service_ms_per_token']:.1f} | "
                   f"{r['mean_accepted_length']:.2f} | {r['target_passes_per_token']:.3f} |")
    out += ["", "| profile | arrivals | system | ms/token | TTFT ms | tok/s | drafter GPU-h | $ per 1M tokens |",
            "|---|---|---|---|---|---|---|---|"]
    for r in result["online"]:
        out.append(f"| {r['profile']} | {r['rate']} | {r['system']} | {r['latency_ms_per_token']:.1f} | "
                   f"{r['ttft_ms']:.0f} | {r['throughput_tok_s']:.0f} | {r['drafter_gpu_hours']:.2f} | "
                   f"{r['usd_per_million_tokens']:.2f} |")
    return "\n".join(out)


def _usd(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def sizing_table(result: dict) -> str:
    slo = result.get("slo_ms_per_token")
    out = [f"profile {result['profile']}, {result['rate']:.2f} requests/s, mix {result['mix'] or 'as traced'}, "
           f"prices {result['prices']}, goodput: tokens of requests "
           + (f"within {slo:g} ms per token" if slo else "(no SLO: every token)"), "",
           "| system | drafter GPU | GPUs | tok/s | goodput tok/s | ms/token | $ per 1M good tokens | good tokens per $ |",
           "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        out.append(f"| {r['system']} | {r['kind'] or '-'} | {r['gpus']} | {r['throughput_tok_s']:.0f} | "
                   f"{r['goodput_tok_s']:.0f} | {r['latency_ms_per_token']:.1f} | "
                   f"{_usd(r['usd_per_million_good_tokens'])} | {r['good_tokens_per_usd']:.0f} |")

    def named(b: dict) -> str:
        where = f"{b['gpus']} x {b['kind']} ({b['per_verifier_gpu']:.2f} per verifier GPU)" if b["gpus"] else \
            "no drafter GPUs"
        return f"{b['system']}, {where}: {b['good_tokens_per_usd']:.0f} good tokens per $"

    out.append(f"\nbest goodput per dollar: {named(result['best'])}")
    out.append(f"best with drafter GPUs: {named(result['best_remote'])}")
    return "\n".join(out)


def plot_reproduction(result: dict, path: Path) -> None:
    import matplotlib

    from simulate.studies import SYSTEMS

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    profiles = sorted({r["profile"] for r in result["offline"]})
    fig, axes = plt.subplots(2, len(profiles), figsize=(5.5 * len(profiles), 7), squeeze=False)
    for j, prof in enumerate(profiles):
        rows = [r for r in result["offline"] if r["profile"] == prof]
        for system in SYSTEMS[:3]:
            xs = [r["batch"] for r in rows if r["system"] == system]
            axes[0][j].plot(xs, [r["throughput_tok_s"] for r in rows if r["system"] == system], "o-", label=system)
            axes[1][j].plot(xs, [r["service_ms_per_token"] for r in rows if r["system"] == system], "o-",
                            label=system)
        axes[0][j].set_title(f"{prof}: offline, {result['prompts']} prompts")
        axes[0][j].set_ylabel("throughput, tokens/s")
        axes[1][j].set_ylabel("latency, ms per token")
        for ax in (axes[0][j], axes[1][j]):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("batch size")
            ax.grid(alpha=0.3)
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def plot_sizing(result: dict, path: Path) -> None:
    import matplotlib

    from simulate.studies import DRAFTER_KINDS

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for kind in DRAFTER_KINDS:
        rows = [r for r in result["rows"] if r["kind"] == kind]
        ax.plot([r["gpus"] for r in rows], [r["good_tokens_per_usd"] / 1e6 for r in rows], "o-",
                label=f"cosine, {kind}")
    for r in result["rows"]:
        if r["system"] != "cosine":
            ax.axhline(r["good_tokens_per_usd"] / 1e6, ls="--", color="grey" if r["system"] == "no-spec" else "black",
                       label=r["system"])
    ax.set_xlabel("drafter GPUs per verifier (4 x A100)")
    ax.set_ylabel("million good tokens per USD")
    slo = result.get("slo_ms_per_token")
    ax.set_title(f"{result['profile']}: {result['rate']:.2f} requests/s"
                 + (f", goodput within {slo:g} ms/token" if slo else ""))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def remote_pays_table(result: dict) -> str:
    out = [f"{result['profile']}, {result['prompts']} prompts offline: throughput cosine (drafters on GPUs of their "
           f"own) / vanilla (the generic drafter on the verifier's GPUs)", "",
           "| batch | drafter step fixed ms | " + " | ".join(f"hop {h:g} ms" for h in sorted(
               {g["hop_ms"] for g in result["grid"]})) + " |"]
    out.append("|---" * (2 + len({g["hop_ms"] for g in result["grid"]})) + "|")
    for b, a in sorted({(g["batch"], g["draft_ms"]) for g in result["grid"]}):
        cells = [g for g in result["grid"] if (g["batch"], g["draft_ms"]) == (b, a)]
        ratios = [f"{g['ratio']:.2f}" for g in sorted(cells, key=lambda g: g["hop_ms"])]
        out.append(f"| {b} | {a:g} | " + " | ".join(ratios) + " |")
    out += ["", "| batch | domain drafters sharpened | accepted length cosine / vanilla | margin | throughput ratio |",
            "|---|---|---|---|---|"]
    for m in result["margin"]:
        out.append(f"| {m['batch']} | {m['share']:.0%} | {m['accepted']:.2f} / {m['vanilla_accepted']:.2f} | "
                   f"{m['margin']:.2f}x | {m['ratio']:.2f} |")
    return "\n".join(out)


def plot_remote_pays(result: dict, path: Path) -> None:
    import matplotlib
    import numpy as np

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({g["batch"] for g in result["grid"]})
    steps = sorted({g["draft_ms"] for g in result["grid"]})
    hops = sorted({g["hop_ms"] for g in result["grid"]})
    fig, axes = plt.subplots(1, len(batches) + 1, figsize=(5.2 * (len(batches) + 1), 4.4))
    for ax, b in zip(axes, batches):
        grid = np.array([[next(g["ratio"] for g in result["grid"] if (g["batch"], g["draft_ms"], g["hop_ms"])
                               == (b, a, h)) for a in steps] for h in hops])
        im = ax.imshow(grid, origin="lower", cmap="RdBu", vmin=0.5, vmax=1.5, aspect="auto")
        for i in range(len(hops)):
            for j in range(len(steps)):
                ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=7)
        ax.set_xticks(range(len(steps)), [f"{a:.3g}" for a in steps], fontsize=8)
        ax.set_yticks(range(len(hops)), [f"{h:g}" for h in hops])
        ax.set_xlabel("drafter step, fixed cost (ms)")
        ax.set_ylabel("hop, central node to drafter and back (ms)")
        ax.set_title(f"batch {b}: throughput cosine / vanilla", fontsize=10)
        ref = (steps.index(result["draft"]["a"]), hops.index(result["hop_ms"]))
        ax.add_patch(plt.Rectangle((ref[0] - 0.5, ref[1] - 0.5), 1, 1, fill=False, lw=2, color="black"))
    fig.colorbar(im, ax=axes[:len(batches)], shrink=0.8)
    ax = axes[-1]
    for b in batches:
        ms = [m for m in result["margin"] if m["batch"] == b]
        ax.plot([m["margin"] for m in ms], [m["ratio"] for m in ms], "o-", label=f"batch {b}")
    ax.axhline(1.0, color="grey", ls="--")
    ax.set_xlabel("accepted length, cosine / vanilla (domain drafters sharpened)")
    ax.set_ylabel("throughput cosine / vanilla")
    ax.set_title(f"at the calibrated step ({result['draft']['a']:.2f} ms) and hop ({result['hop_ms']:g} ms)",
                 fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.suptitle(f"{result['profile']}: where drafters on GPUs of their own pay (boxed: the calibrated profile)")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    print(f"wrote {path}")


def tiers_table(result: dict) -> str:
    out = [f"{result['prompts']} prompts offline per point: throughput by `speculation.drafting_tier`", "",
           "| profile | batch | colocated tok/s | deployments tok/s | auto tok/s | auto / better fixed | auto's rounds "
           "on the deployments | accepted length (colocated / deployments / auto) |", "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        c, d, a = (r[t] for t in ("colocated", "deployments", "auto"))
        out.append(f"| {r['profile']} | {r['batch']} | {c['throughput_tok_s']:.0f} | {d['throughput_tok_s']:.0f} | "
                   f"{a['throughput_tok_s']:.0f} | {r['auto_ratio']:.3f} | {a['remote_round_share']:.0%} | "
                   f"{c['mean_accepted_length']:.2f} / {d['mean_accepted_length']:.2f} / "
                   f"{a['mean_accepted_length']:.2f} |")
    return "\n".join(out)


def plot_tiers(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    profiles = list(dict.fromkeys(r["profile"] for r in result["rows"]))
    fig, axes = plt.subplots(2, len(profiles), figsize=(5 * len(profiles), 6.5), squeeze=False,
                             gridspec_kw={"height_ratios": [3, 1.4]})
    for j, prof in enumerate(profiles):
        rows = [r for r in result["rows"] if r["profile"] == prof]
        xs = [r["batch"] for r in rows]
        for tier, style in (("colocated", "s--"), ("deployments", "^--"), ("auto", "o-")):
            axes[0][j].plot(xs, [r[tier]["throughput_tok_s"] for r in rows], style, label=tier)
        axes[0][j].set_title(prof, fontsize=10)
        axes[0][j].set_ylabel("throughput, tokens/s")
        axes[1][j].bar([str(x) for x in xs], [r["auto"]["remote_round_share"] for r in rows], color="grey")
        axes[1][j].set_ylim(0, 1)
        axes[1][j].set_ylabel("auto: rounds remote")
        axes[1][j].set_xlabel("batch size")
        for k, r in enumerate(rows):
            axes[1][j].text(k, 0.05, f"{r['auto_ratio']:.2f}x", ha="center", fontsize=8, color="white")
        axes[0][j].set_xscale("log", base=2)
        axes[0][j].grid(alpha=0.3)
        axes[0][j].legend(fontsize=8)
    fig.suptitle(f"drafting_tier per load, {result['prompts']} prompts offline (bars: auto's share of rounds on the "
                 "drafter deployments, and auto / the better fixed tier)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(args) -> int:
    """Runs the study, prints its table, writes its JSON, then its plot (if asked)."""
    from benchmarks.metrics import require_plotting
    from simulate import studies, validation

    require_plotting(bool(getattr(args, "plot", None)))
    plot = None
    if args.study == "record":
        adaptive = {"as-configured": None, "on": True, "off": False}[args.adaptive]
        for path in validation.record(args.config, Path(args.trace), Path(args.out), _ints(args.concurrencies),
                                   args.repeats, adaptive, log=_log):
            print(f"wrote {path}")
        return 0
    if args.study == "validate" and args.recorded:
        run_args, runs = validation.recorded(Path(args.recorded))
        requests = validation.recorded_replay(run_args, runs)
        result = {"recorded": args.recorded, "rows": validation.out_of_sample(run_args, runs, requests),
                  "runs": [{k: v for k, v in r.items() if k != "trace"} for r in runs]}
        table = out_of_sample_table(result)
    elif args.study == "validate":
        result = validation.validate(args.config, args.per_domain, args.new_tokens,
                                     _ints(args.concurrencies), args.repeats, args.port,
                                     Path(args.save_trace) if args.save_trace else None, log=_log)
        table = validation_table(result)
    else:
        run_args = studies.app_args(args.config)
        _log(f"replaying {args.trace} with the drafters of {args.config} ...")
        requests = studies.load_replay([args.trace], run_args)
        if args.study == "tiers":
            result = studies.tiers(run_args, requests, args.profiles.split(","), _ints(args.batches), args.prompts,
                                   log=_log)
            table, plot = tiers_table(result), plot_tiers
        elif args.study == "remote":
            result = studies.remote_pays(run_args, requests, args.profile, prompts=args.prompts, log=_log)
            table, plot = remote_pays_table(result), plot_remote_pays
        elif args.study == "reproduce":
            result = studies.reproduce(run_args, requests, args.profiles.split(","), args.prompts,
                                       online_s=args.online_s, log=_log)
            table, plot = reproduction_tables(result), plot_reproduction
        else:
            result = studies.size(run_args, requests, args.profile, args.rate, _floats(args.mix),
                                  _ints(args.counts), args.duration,
                                  _floats(args.prices), args.slo_ms_per_token, log=_log)
            table, plot = sizing_table(result), plot_sizing
    print(table)
    write_result(result, args.json)
    if plot is not None and getattr(args, "plot", None):
        plot(result, Path(args.plot))
    return 0


def _log(msg: str) -> None:
    print(msg, flush=True)


def add_parser(sub, default_config: str) -> None:
    s = sub.add_parser("simulate", help="the CoSine cluster as a discrete-event simulation running this project's "
                       "routing, fusion, controller and autoscaler: validate, reproduce the paper, size drafters")
    ssub = s.add_subparsers(dest="study", required=True)
    v = ssub.add_parser("validate", help="run the served graph for real with a trace, simulate the same runs, "
                        "compare throughput and time per token")
    v.add_argument("--config", default=default_config)
    v.add_argument("--per-domain", type=int, default=3, help="held-out prompts per domain")
    v.add_argument("--new-tokens", type=int, default=128)
    v.add_argument("--concurrencies", default="1,4")
    v.add_argument("--repeats", type=int, default=3)
    v.add_argument("--port", type=int, default=8041, help="loopback HTTP port (+1: dashboard)")
    v.add_argument("--save-trace", help="keep the recorded requests (with their domains) for replays")
    v.add_argument("--recorded", help="instead of serving: the runs `cosine simulate record` wrote (e.g. "
                   "simulate/traces/inprocess), each predicted from half its own steps and from the runs beside it")
    v.add_argument("--json", default="bench_results/simulate-validate.json")
    rec = ssub.add_parser("record", help="closed-loop runs of the config's verify loop in this process (torch engine, "
                          "no Ray), a trace per run, for `validate --recorded`")
    rec.add_argument("--config", default=default_config)
    rec.add_argument("--trace", default=str(DEFAULT_TRACE), help="the recorded requests whose prompts are sent")
    rec.add_argument("--out", default="simulate/traces/inprocess")
    rec.add_argument("--concurrencies", default="1,2,4")
    rec.add_argument("--repeats", type=int, default=3)
    rec.add_argument("--adaptive", choices=["as-configured", "on", "off"], default="as-configured",
                     help="speculation.adaptive for the runs (off: always k, no decision depends on timings)")
    for name, helptext in (("reproduce", "the paper's offline and online settings on its two model pairs"),
                           ("size", "goodput per dollar by drafter GPU kind and count per verifier"),
                           ("remote", "where drafters on GPUs of their own pay: throughput against vanilla "
                                      "speculation over drafter step cost, hop and acceptance margin"),
                           ("tiers", "speculation.drafting_tier per load: colocated, deployments and auto (the "
                                     "chooser of speculation/tiers.py) at each batch size")):
        r = ssub.add_parser(name, help=helptext)
        r.add_argument("--config", default=default_config, help="the application whose drafters are replayed")
        r.add_argument("--trace", default=str(DEFAULT_TRACE), help="recorded requests (speculation.record_trace)")
        r.add_argument("--json", default=f"bench_results/simulate-{name}.json")
        r.add_argument("--plot", help="write a plot here (needs matplotlib: pip install -e .[docs])")
        if name == "reproduce":
            r.add_argument("--profiles", default="paper-llama,paper-qwen")
            r.add_argument("--prompts", type=int, default=512, help="offline requests per point (the paper: 8192)")
            r.add_argument("--online-s", type=float, default=600.0, help="simulated seconds per online run")
        elif name == "tiers":
            r.add_argument("--profiles", default="paper-qwen,paper-qwen-eager,paper-llama")
            r.add_argument("--batches", default="1,2,4,8,16")
            r.add_argument("--prompts", type=int, default=128, help="offline requests per point")
        elif name == "remote":
            r.add_argument("--profile", default="paper-qwen", choices=["paper-qwen", "paper-llama"])
            r.add_argument("--prompts", type=int, default=64, help="offline requests per point")
        else:
            r.add_argument("--profile", default="paper-qwen")
            r.add_argument("--rate", type=float, help="requests/s (default: 90%% of target-only capacity)")
            r.add_argument("--mix", help="domain weights, e.g. code=3,legal=1 (default: the trace's)")
            r.add_argument("--counts", default="1,2,4,7,14", help="drafter GPUs per verifier to try")
            r.add_argument("--duration", type=float, default=600.0, help="simulated seconds per point")
            r.add_argument("--prices", help="USD per GPU-hour, e.g. RTX3090=0.3,A100-80GB=2.1")
            r.add_argument("--slo-ms-per-token", type=float, help="goodput counts only requests whose latency per "
                           "token from sending is within this (default: every request)")
    s.set_defaults(func=main)
