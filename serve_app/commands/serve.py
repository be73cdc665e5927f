"""`cosine serve`, `cosine profile`, `cosine package`: a Serve config run on this machine, its step costs measured
here, and this project's code packed for a cluster."""

from __future__ import annotations

import os
from pathlib import Path

from model_family.paths import REPO_ROOT
from model_family.sources import resolve_model
from serve_app.package import build_package

LOCAL_CONFIG = str(REPO_ROOT / "examples" / "local.yaml")


def add_parser(sub) -> None:
    s = sub.add_parser("serve", help="run a Serve config on this machine: ready check, URLs, Ctrl-C stops it")
    s.add_argument("config", nargs="?", default=LOCAL_CONFIG)
    s.add_argument("--port", type=int, help="HTTP port (default: the config's http_options.port)")
    s.add_argument("--dashboard-port", type=int, default=8265)
    s.add_argument("--ready-timeout", type=float, default=900.0, help="seconds to wait for the first answer")
    s.add_argument("--api-key", help="require `Authorization: Bearer KEY` from clients (sets COSINE_API_KEY for "
                   "the ingress; default: that variable from this environment, else no authentication)")
    s.add_argument("--haproxy", action="store_true", help="HAProxy answers on the HTTP port in place of Serve's "
                   "proxy actor (Ray Serve's HAProxy ingress: the HAProxy ray[serve] bundles, else `haproxy` on PATH; "
                   "docs/operations.md)")
    s.set_defaults(func=serve)

    pr = sub.add_parser("profile", help="step latencies of a config's verifier and drafters on this machine: the "
                        "goodput controller's starting models (speculation.controller.*_seed_ms)")
    pr.add_argument("config", nargs="?", default=LOCAL_CONFIG)
    pr.set_defaults(func=profile)

    pk = sub.add_parser("package", help="this project's code as one zip for a Serve config's runtime_env "
                        "(working_dir), so that every node of a cluster runs it (docs/deploy.md)")
    pk.add_argument("--out", default=".", help="the zip's path, or a directory for cosine-serve.zip")
    pk.set_defaults(func=package)


def serve(args) -> int:
    from serve_app.launch import serve_forever

    if args.api_key:
        os.environ["COSINE_API_KEY"] = args.api_key  # inherited by the Ray processes serve_forever starts
    return serve_forever(Path(args.config), args.port, args.dashboard_port, args.ready_timeout, args.haproxy)


def profile(args) -> int:
    """Fits t(tokens) of the configured verifier engine and t(requests) of a lockstep drafter step, and prints
    them as the controller's seeds (it refits both online; the seeds price the first rounds)."""
    from speculation.profiling import profile_verifier
    from config import AppConfig
    from engines.build import build_verifier_engine
    from engines.verifier import load_causal_lm
    from serve_app.launch import read_serve_config
    from speculation.profiling import fit_draft_latency

    app = read_serve_config(Path(args.config))["applications"][0]
    cfg = AppConfig.model_validate(app.get("args") or {})
    engine = build_verifier_engine(cfg)
    try:
        k, b = cfg.speculation.k, cfg.verifier.max_batch
        verify = profile_verifier(engine, batches=sorted({1, max(1, b // 2), b}), ks=sorted({0, k // 2, k}))
    finally:
        getattr(engine, "shutdown", lambda: None)()
    draft = None
    models = [d.model for d in cfg.drafters if not d.model_free]
    if models:
        draft = fit_draft_latency(load_causal_lm(str(resolve_model(models[0])), "cpu"), b)
    print(f"# measured by `cosine profile {args.config}`: t = a + b * n in ms (n: tokens in a verify step; "
          "requests in a drafter step)")
    print("speculation:\n  controller:")
    print(f"    verify_seed_ms: [{1000 * verify.a:.3f}, {1000 * verify.b:.3f}]")
    if draft is not None:
        print(f"    draft_seed_ms: [{1000 * draft.a:.3f}, {1000 * draft.b:.3f}]")
    return 0


def package(args) -> int:
    out = build_package(Path(args.out)).resolve()
    print(f"{out} ({out.stat().st_size // 1024} KiB). Copy it to the same path on every node, or upload it, and set "
          f"in the Serve config:\n  runtime_env: {{working_dir: \"file://{out}\"}}  (or https://... / s3://...)")
    return 0
