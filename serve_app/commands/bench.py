"""`cosine bench ...`: benchmarks that print tables and write JSON; each runs `main(args)` of its module in
benchmarks/."""

from __future__ import annotations

import importlib

from benchmarks.sampled import add_arguments as add_sampling_arguments
from benchmarks.steps import add_arguments as add_steps_arguments
from model_family.paths import REPO_ROOT

REPEATS_HELP = "timed runs of every {}, interleaved; the median counts (after one warm-up run each)"


def _runs(module: str):
    """The handler of a benchmark: benchmarks.<module>'s main(args)."""
    def run(args) -> int:
        return importlib.import_module(f"benchmarks.{module}").main(args)
    return run


def _prompt_options(p, per_domain: int, new_tokens: int) -> None:
    p.add_argument("--per-domain", type=int, default=per_domain, help="held-out prompts per domain")
    p.add_argument("--new-tokens", type=int, default=new_tokens)


def add_parser(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks that print tables and write JSON")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    _engine(bsub)
    st = bsub.add_parser("steps", help="step costs of the paper's models (random weights of their real configs) "
                         "through our engine, eager and with CUDA graphs, on this machine's GPU")
    add_steps_arguments(st)
    st.set_defaults(func=_runs("steps"))
    _collaborative(bsub)
    _serve(bsub)
    _anchors(bsub)
    _rounds(bsub)
    _load(bsub)
    _soak(bsub)
    _breakdown(bsub)
    _control_plane(bsub)


def _engine(bsub) -> None:
    e = bsub.add_parser("engine", help="speculative engines vs target-only and HF assisted generation")
    _prompt_options(e, 2, 128)
    e.add_argument("--k", type=int, default=4)
    e.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    e.add_argument("--no-hf", action="store_true", help="skip Hugging Face assisted generation")
    e.add_argument("--repeats", type=int, default=3, help=REPEATS_HELP.format("method"))
    e.add_argument("--device", default="cpu", help="where the models run: cpu, or cuda on a GPU machine")
    e.add_argument("--methods", nargs="+", help="run only the methods whose names contain one of these (and "
                   "target-only, the reference), e.g. 'Minions' 'chain, generic'; 'HF' for HF assisted generation")
    e.add_argument("--pool", nargs="+", choices=["auto", "on", "off"], default=["auto"],
                   help="speculation.pool_drafters for our methods (auto, the default: on a GPU, off on a CPU); on "
                   "and off: side by side, with the pool's ratio per batch")
    e.add_argument("--overlap", nargs="+", choices=["auto", "on", "off"], default=["auto"],
                   help="speculation.colocated_overlap for our methods (auto, the default: drafting overlaps "
                   "verification on a GPU, not on a CPU); several: side by side")
    e.add_argument("--draft-timeout-ms", type=float, help="the verifier's wait for a round's drafts, fixed "
                   "(speculation.draft_timeout_ms); default: the config's, relative to the verify step, as shipped")
    e.add_argument("--target-scale", type=int, nargs=2, metavar=("FACTOR", "LAYERS"), help="instead of the bench "
                   "target, the trained target widened FACTOR times and deepened to LAYERS (identity layers), built "
                   "on the device: a target of realistic cost on a GPU (16 16: 7.3B parameters); no HF rows then")
    e.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="every model's weights (bfloat16 on a GPU, as served)")
    add_sampling_arguments(e)
    e.add_argument("--slow-drafting", type=float, default=5.0, metavar="FACTOR", help="the methods with drafting "
                   "slowed on purpose make every round this many recent verify steps longer (the guard's benchmark)")
    e.add_argument("--json", default="bench_results/engine.json")
    e.set_defaults(func=_runs("engine"))


def _collaborative(bsub) -> None:
    co = bsub.add_parser("collaborative", help="CoS vs token-by-token collaborative decoding (ensemble, "
                         "contrastive)")
    _prompt_options(co, 1, 96)
    co.add_argument("--k", type=int, default=4, help="the partner's draft length")
    co.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    co.add_argument("--repeats", type=int, default=3, help=REPEATS_HELP.format("configuration"))
    co.add_argument("--partner", default="drafter-generic", help="the partner model of the bench target")
    co.add_argument("--json", default="bench_results/collaborative.json")
    co.set_defaults(func=_runs("collaborative"))


def _serve(bsub) -> None:
    sv = bsub.add_parser("serve", help="the running application: speculation variants side by side")
    sv.add_argument("--url", default="http://127.0.0.1:8000")
    sv.add_argument("--model", default="cosine-target")
    _prompt_options(sv, 2, 128)
    sv.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    sv.add_argument("--repeats", type=int, default=3, help=REPEATS_HELP.format("variant"))
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
    sv.set_defaults(func=_runs("serve"))


def _anchors(bsub) -> None:
    an = bsub.add_parser("anchors", help="ours with the vLLM verifier vs vLLM target-only, vLLM draft_model, "
                                         "ngram and suffix speculation and HF assisted generation, side by side")
    an.add_argument("--config", default="examples/bench.yaml", help="our configuration (served and in process)")
    an.add_argument("--model-free-config", default="examples/bench-model-free.yaml", help="ours with the "
                    "model-free drafters in the roster (the ours-model-free and served-model-free rows)")
    an.add_argument("--workload", choices=["heldout", "repeated"], default="heldout", help="heldout: held-out "
                    "prompts to continue; repeated: prompts whose answer repeats text they quote "
                    "(benchmarks/repeated.py); either at any --temperature")
    _prompt_options(an, 2, 128)
    an.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    an.add_argument("--repeats", type=int, default=3, help=REPEATS_HELP.format("system"))
    an.add_argument("--no-served", action="store_true", help="skip the served rows (ours through Ray Serve, vllm "
                    "serve target-only and with its draft_model speculation)")
    an.add_argument("--k", type=int, default=4, help="draft tokens per step for every method (ours: the maximum)")
    an.add_argument("--systems", nargs="+", choices=["draft-generic", "draft-domain", "ngram", "suffix", "hf", "ours",
                                                     "served", "ours-model-free", "served-model-free", "vllm-serve",
                                                     "vllm-serve-draft", "served-in-verifier", "served-haproxy"],
                    help="run only these beside vLLM target-only (default: every system but served-in-verifier, "
                         "ours served with ingress.in_verifier, and served-haproxy, the same through `cosine serve "
                         "--haproxy`; suffix needs `make vllm-suffix`)")
    an.add_argument("--port", type=int, default=8011, help="loopback port of the first served graph (port + 1 "
                    "its dashboard; each next server the next free ports: the model-free graph's, vllm serve's)")
    add_sampling_arguments(an)
    an.add_argument("--json", default="bench_results/anchors.json")
    an.set_defaults(func=_runs("anchors"))


def _rounds(bsub) -> None:
    rd = bsub.add_parser("rounds", help="ours in process with the goodput controller's draft lengths against fixed "
                         "ones: tokens/s and, from the loop's trace, draft depth and acceptance round by round")
    rd.add_argument("--config", default="examples/bench.yaml", help="our configuration")
    _prompt_options(rd, 2, 128)
    rd.add_argument("--concurrency", type=int, default=1)
    rd.add_argument("--k", type=int, default=8, help="the controller's maximum and the longer fixed length (the "
                                                     "shorter: k / 2)")
    rd.add_argument("--repeats", type=int, default=3, help="timed runs of every system, interleaved")
    rd.add_argument("--json", default="bench_results/rounds.json")
    rd.set_defaults(func=_runs("rounds"))


def _load(bsub) -> None:
    ld = bsub.add_parser("load", help="Poisson arrivals light load to saturation through HTTP: fixed k, "
                         "the controllers, the autoscaler (goodput, TPOT, drafter replica-seconds per rate)")
    ld.add_argument("--config", default=str(REPO_ROOT / "examples" / "bench.yaml"))
    ld.add_argument("--systems", default="k=0,k=2,k=4,k=6,hill_climb,goodput,goodput+deployments,goodput+autoscaler")
    ld.add_argument("--rates", default="0.25,0.5,1,2", help="requests/s, comma-separated")
    ld.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per rate")
    ld.add_argument("--repeats", type=int, default=3)
    ld.add_argument("--max-tokens", type=int, default=128)
    ld.add_argument("--port", type=int, default=8031, help="HTTP port of the system under test (+1: dashboard)")
    add_sampling_arguments(ld)
    ld.add_argument("--json", default="bench_results/load.json")
    ld.add_argument("--plot", help="write the plot here (needs matplotlib: pip install -e .[docs])")
    ld.set_defaults(func=_runs("load"))


def _soak(bsub) -> None:
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
    sk.set_defaults(func=_runs("soak"))


def _breakdown(bsub) -> None:
    bd = bsub.add_parser("breakdown", help="what our machinery adds to a vLLM step with speculation off: plain vLLM, "
                         "vLLM with our hooks, our loop, served against `vllm serve`, ms per step side by side")
    bd.add_argument("--config", default="examples/bench.yaml", help="our configuration (the guard-off and served rows)")
    bd.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    bd.add_argument("--prompt-lens", type=int, nargs="+", default=[64, 2000])
    bd.add_argument("--new-tokens", type=int, default=40, help="per request (prompt + new tokens + 8 must fit the "
                    "bench target's 2,048 positions)")
    bd.add_argument("--repeats", type=int, default=3, help=REPEATS_HELP.format("cell"))
    bd.add_argument("--served", action="store_true", help="also ours through Ray Serve against `vllm serve`")
    bd.add_argument("--port", type=int, default=8021, help="loopback port of the served graph (port + 1: its "
                                                           "dashboard, port + 2: vllm serve)")
    bd.add_argument("--temperature", type=float, default=0.7)
    bd.add_argument("--top-p", type=float, default=0.95)
    bd.add_argument("--json", default="bench_results/breakdown.json")
    bd.set_defaults(func=_runs("breakdown"))


def _control_plane(bsub) -> None:
    cp = bsub.add_parser("control-plane", help="what Ray's own processes cost the served graph: tokens/s streamed "
                         "with its control plane running against paused, in alternating windows")
    cp.add_argument("--config", default="examples/bench.yaml", help="served with --haproxy and ingress.in_verifier")
    cp.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    cp.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7], help="0: greedy")
    cp.add_argument("--top-p", type=float, default=0.95, help="with a temperature above 0")
    cp.add_argument("--rounds", type=int, default=8, help="pairs of windows (running, paused) per cell")
    cp.add_argument("--window", type=float, default=6.0, help="seconds per window")
    cp.add_argument("--port", type=int, default=8051, help="loopback port of the served graph (+1: its dashboard)")
    cp.add_argument("--json", default="bench_results/control-plane.json")
    cp.set_defaults(func=_runs("control_plane"))
