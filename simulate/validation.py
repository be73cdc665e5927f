"""`cosine simulate validate`: the simulator checked against measured runs. Live: the served graph of a config run
for real with a trace recorded, then the same runs simulated from the trace. Recorded: closed-loop runs of the
verify loop in this process (`cosine simulate record`), each predicted from a latency model fitted on the others or
on half of its own steps."""

from __future__ import annotations

import gc
import json
import statistics
import tempfile
from pathlib import Path

import yaml

from config import AppConfig
from simulate.cluster import Simulation, Workload
from simulate.hardware import Hardware, fit
from simulate.replay import ReplayRequest, annotate
from simulate.studies import app_args
from speculation.trace import Trace


# ---------------------------------------------------------------------------------------------- a served run
def _served_runs(config: str, args: dict, work: Path, per_domain: int, new_tokens: int, concurrencies, repeats: int,
                 port: int, log) -> tuple[list, list[dict], list[str]]:
    """The served graph of `config` run for real (a warm-up, then `repeats` rounds of every concurrency) with a trace
    recorded in `work`: the held-out prompts sent (domain, token ids), the measured runs (each with its lines of the
    trace) and the trace's lines."""
    from transformers import AutoTokenizer

    from benchmarks.common import ServedApp, heldout_prompts
    from model_family.sources import resolve_model

    trace_path = work / "trace.jsonl"
    serve_cfg = yaml.safe_load(Path(config).read_text())
    serve_cfg["applications"][0]["args"]["speculation"] = dict(args.get("speculation", {}),
                                                               record_trace=str(trace_path))
    (work / "serve.yaml").write_text(yaml.safe_dump(serve_cfg))
    tok = AutoTokenizer.from_pretrained(resolve_model(args.get("tokenizer") or args["verifier"]["model"]))
    prompts = heldout_prompts(tok, per_domain, 64)
    ids = [p for _, p in prompts]

    def lines() -> int:
        return len(trace_path.read_text().splitlines()) if trace_path.exists() else 0

    log(f"starting the served graph of {config} (trace: {trace_path})")
    served = ServedApp(str(work / "serve.yaml"), port, port + 1)
    runs = []
    try:
        served.run(ids[:4], 2, 16, None)  # warm-up
        for rep in range(repeats):
            for c in concurrencies:
                start = lines()
                res = served.run(ids, c, new_tokens, None)
                tokens = [len(o) for o in res["outputs"]]
                runs.append({"concurrency": c, "repeat": rep, "lines": (start, lines()),
                             "throughput_tok_s": sum(tokens) / res["wall"],
                             "latency_ms_per_token": 1000 * statistics.fmean(
                                 s / max(n, 1) for s, n in zip(res["seconds"], tokens)),
                             "client_seconds": res["seconds"]})
                log(f"  measured: concurrency {c}, repeat {rep + 1}/{repeats}: "
                    f"{runs[-1]['throughput_tok_s']:.1f} tok/s, {runs[-1]['latency_ms_per_token']:.1f} ms/token")
    finally:
        served.stop()
    return prompts, runs, trace_path.read_text().splitlines()


def validate(config: str, per_domain: int = 3, new_tokens: int = 128, concurrencies=(1, 4), repeats: int = 3,
             port: int = 8031, save_trace: Path | None = None, log=print) -> dict:
    """Run the served graph of `config` for real with a trace recorded, then simulate the same runs from the trace.
    The latency model is fitted on every measured run (in sample) and, per concurrency, on the other
    concurrencies' runs only (out of sample); acceptance is replayed."""
    args = app_args(config)
    work = Path(tempfile.mkdtemp(prefix="cosine-validate-"))
    prompts, runs, all_lines = _served_runs(config, args, work, per_domain, new_tokens, concurrencies, repeats, port,
                                            log)
    ids = [p for _, p in prompts]

    def segment(rs: list[dict]) -> Trace:
        path = work / "segment.jsonl"
        path.write_text("\n".join(line for r in rs for line in all_lines[r["lines"][0]:r["lines"][1]]) + "\n")
        t = Trace.load(path)
        # per request: what the client waited beyond the loop's own time (HTTP, tokenization, queueing at ingress)
        t.overhead_ms = 1000 * statistics.fmean(statistics.fmean(r["client_seconds"]) - statistics.fmean(
            q["t1"] - q["t0"] for q in _requests_of(all_lines, r)) for r in rs)
        return t

    first = Trace.load(*[_write(work / "first.jsonl", all_lines[runs[0]["lines"][0]:runs[0]["lines"][1]])])
    by_prompt = {tuple(r["prompt"]): r for r in first.requests}
    domains = {tuple(p): d for d, p in prompts}
    ordered = [dict(by_prompt[tuple(p)], domain=domains[tuple(p)]) for p in ids]
    requests = annotate(ordered, AppConfig.model_validate(args))
    if save_trace:
        save_trace.parent.mkdir(parents=True, exist_ok=True)
        save_trace.write_text("".join(json.dumps({"kind": "request", **r}) + "\n" for r in ordered))
    rows = []
    for c in concurrencies:
        measured = [r for r in runs if r["concurrency"] == c]
        for fitted_on in ("all", "others"):
            pool = runs if fitted_on == "all" else [r for r in runs if r["concurrency"] != c]
            if not pool:
                continue
            seg = segment(pool)
            hw = fit(seg).model_copy(update={"request_overhead_ms": max(seg.overhead_ms, 0.0)})
            cfg = AppConfig.model_validate(dict(args, speculation=dict(args.get("speculation", {}),
                                                                       record_trace=None)))
            pred = Simulation(cfg, hw, requests).run(Workload("closed", count=len(requests), concurrency=c)).summary()
            row = {"concurrency": c, "fitted_on": fitted_on}
            for key in ("throughput_tok_s", "latency_ms_per_token"):
                values = [r[key] for r in measured]
                row[key] = {"measured": statistics.median(values), "measured_min": min(values),
                            "measured_max": max(values), "simulated": pred[key]}
                row[key]["error"] = pred[key] / row[key]["measured"] - 1
            row["hardware"] = hw.model_dump()
            rows.append(row)
            log(f"  concurrency {c}, latency model fitted on {fitted_on}: throughput "
                f"{row['throughput_tok_s']['simulated']:.1f} vs {row['throughput_tok_s']['measured']:.1f} tok/s "
                f"({row['throughput_tok_s']['error']:+.1%}), latency {row['latency_ms_per_token']['simulated']:.1f} "
                f"vs {row['latency_ms_per_token']['measured']:.1f} ms/token ({row['latency_ms_per_token']['error']:+.1%})")
    return {"config": str(config), "prompts": len(ids), "new_tokens": new_tokens, "repeats": repeats,
            "rows": rows, "runs": [{k: v for k, v in r.items() if k != "client_seconds"} for r in runs]}


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def _requests_of(all_lines: list[str], run: dict) -> list[dict]:
    return [r for r in (json.loads(x) for x in all_lines[run["lines"][0]:run["lines"][1]]) if r["kind"] == "request"]


# ---------------------------------------------------------------------------------------------- recorded runs
RECORDED = Path(__file__).parent / "traces" / "inprocess"  # committed: `cosine simulate record`


def record(config: str, requests_from: Path, out: Path = RECORDED, concurrencies=(1, 2, 4), repeats: int = 3,
           adaptive: bool | None = None, log=print) -> list[Path]:
    """Closed-loop runs of the config's verify loop in this process (assembly/loop.py: the torch engine
    as verifier, the drafters on threads of their own; no Ray, no HTTP), the runs interleaved. Writes the
    application args used (`args.json`) and a gzipped trace per run (`c{C}-r{R}.jsonl.gz`: concurrency C, repeat
    R). Each run gets a loop of its own, warmed up, so that it starts from the state a simulated run starts from (a
    fresh controller). The prompts (and their domains) are `requests_from`'s; `adaptive` overrides
    speculation.adaptive (false: always k and no guard, so every decision is the replay's, not the timings')."""
    import asyncio
    import gzip

    import torch

    from engines.sampling import SamplingParams
    from assembly.loop import build_loop

    prompts = Trace.load(requests_from).requests
    domain = {tuple(r["prompt"]): r.get("domain") for r in prompts}
    params = SamplingParams(max_tokens=max(len(r["output"]) for r in prompts), ignore_eos=True)
    work = Path(tempfile.mkdtemp(prefix="cosine-record-"))
    # one torch thread everywhere (the verifier's steps, and the prompt prefills the torch engine runs on this,
    # the event loop's, thread): on a shared machine ops fanned out over every core stalled whenever another
    # process held one of them (measured here: 0.3-0.4 s per prefill, repeats of a run 1.8x apart)
    torch.set_num_threads(1)
    args = app_args(config)
    speculation = dict(args.get("speculation", {}), record_trace=None)
    if adaptive is not None:
        speculation["adaptive"] = adaptive
        if not adaptive:  # nor the guard's verdicts, nor auto's choice (by the controller's models)
            speculation["guard"] = {"enabled": False}
            if speculation.get("drafting_tier") == "auto":
                speculation["drafting_tier"] = "deployments"
    args = dict(args, verifier=dict(args["verifier"], engine="torch", threads=1), speculation=speculation)

    async def run(loop, ids: list[list[int]], concurrency: int, p: SamplingParams) -> None:
        gate = asyncio.Semaphore(concurrency)

        async def one(prompt):
            async with gate:
                async for _ in loop.generate(prompt, p):
                    pass

        await asyncio.gather(*(one(x) for x in ids))

    async def one_run(path: Path, concurrency: int) -> list[dict]:
        loop = build_loop(AppConfig.model_validate(dict(args, speculation=dict(speculation, record_trace=str(path)))))
        await run(loop, [r["prompt"] for r in prompts[:4]], 2, SamplingParams(max_tokens=16, ignore_eos=True))
        start = len(path.read_text().splitlines())
        await run(loop, [r["prompt"] for r in prompts], concurrency, params)
        await loop.stop()
        loop.trace.close()
        for server in loop.drafting.servers.values():
            server.executor.shutdown(wait=True)
        gc.unfreeze()  # build_loop froze the heap: this run's loop, engine and drafters must go when it is dropped
        lines = [json.loads(x) for x in path.read_text().splitlines()[start:]]
        for x in lines:
            x.update({k: round(v, 6) for k, v in x.items() if isinstance(v, float)})  # microseconds
            if x["kind"] == "request":
                x["domain"] = domain[tuple(x["prompt"])]
        return lines

    out.mkdir(parents=True, exist_ok=True)
    (out / "args.json").write_text(json.dumps(args, indent=1) + "\n")
    written = []
    for rep in range(repeats):
        for c in concurrencies:
            lines = asyncio.run(one_run(work / f"c{c}-r{rep}.jsonl", c))
            written.append(out / f"c{c}-r{rep}.jsonl.gz")
            text = "".join(json.dumps(x, separators=(",", ":")) + "\n" for x in lines)
            written[-1].write_bytes(gzip.compress(text.encode(), mtime=0))
            log(f"  concurrency {c}, repeat {rep + 1}/{repeats}: {measured(_load_gz(written[-1]))}")
    return written


def _load_gz(path: Path) -> Trace:
    import gzip

    t = Trace()
    for line in gzip.decompress(path.read_bytes()).decode().splitlines():
        rec = json.loads(line)
        {"request": t.requests, "step": t.steps, "draft": t.drafts}[rec.pop("kind")].append(rec)
    return t


def measured(trace: Trace) -> dict:
    """A recorded run's throughput (tokens over the run's wall time), mean latency per token of its requests and
    mean verify step time, from its trace."""
    reqs = trace.requests
    tokens = sum(len(r["output"]) for r in reqs)
    return {"throughput_tok_s": tokens / (max(r["t1"] for r in reqs) - min(r["t0"] for r in reqs)),
            "latency_ms_per_token": 1000 * statistics.fmean((r["t1"] - r["t0"]) / len(r["output"]) for r in reqs),
            "verify_ms": 1000 * statistics.fmean(s["verify_s"] for s in trace.steps)}


def recorded(directory: Path = RECORDED) -> tuple[dict, list[dict]]:
    """The application args the runs were recorded with, and the runs: concurrency, repeat, trace, measurements."""
    runs = []
    for f in sorted(Path(directory).glob("c*-r*.jsonl.gz")):
        c, r = f.name.removesuffix(".jsonl.gz")[1:].split("-r")
        t = _load_gz(f)
        runs.append({"concurrency": int(c), "repeat": int(r), "trace": t, **measured(t)})
    return json.loads((Path(directory) / "args.json").read_text()), runs


def recorded_replay(args: dict, runs: list[dict]) -> list[ReplayRequest]:
    """The recorded runs' requests (every run sends the same prompts and greedy decoding gives the same outputs), in
    the order they were sent, replayed."""
    first = min(runs, key=lambda r: (r["concurrency"], r["repeat"]))["trace"]
    return annotate(sorted(first.requests, key=lambda r: r["t0"]), AppConfig.model_validate(args))


def predict(args: dict, fitted: list[dict], predicted: list[dict], requests: list[ReplayRequest],
            hw: Hardware | None = None, half: int | None = None) -> list[dict]:
    """Fit this machine's latency model on the `fitted` runs (on every other step and drafting round of theirs with
    `half`; or take `hw`), simulate a closed-loop run at each concurrency of the `predicted` runs with the runs'
    application `args`, and compare with their measured median: throughput, latency per token, mean verify step."""
    hw = hw or fit(Trace(*(sum((getattr(r["trace"], k) for r in fitted), []) for k in ("requests", "steps", "drafts"))),
                   half=half)
    cfg = AppConfig.model_validate(args)
    rows = []
    for c in sorted({r["concurrency"] for r in predicted}):
        res = Simulation(cfg, hw, requests).run(Workload("closed", count=len(requests), concurrency=c))
        decoded = res.step_tokens - sum(len(r.prompt) for r in requests)  # the trace's steps exclude prefills
        sim = dict(res.summary(), verify_ms=hw.verify.a + hw.verify.b * decoded / res.steps)
        row = {"concurrency": c, "repeats": sorted(r["repeat"] for r in predicted if r["concurrency"] == c),
               "fitted_on": sorted((r["concurrency"], r["repeat"]) for r in fitted), "half": half,
               "hardware": hw.model_dump()}
        for key in ("throughput_tok_s", "latency_ms_per_token", "verify_ms"):
            m = statistics.median(r[key] for r in predicted if r["concurrency"] == c)
            row[key] = {"measured": m, "simulated": sim[key], "error": sim[key] / m - 1}
        rows.append(row)
    return rows


def out_of_sample(args: dict, runs: list[dict], requests: list[ReplayRequest]) -> list[dict]:
    """Each recorded run predicted twice: from the even steps and drafting rounds of its own trace (the odd ones
    unseen), and from the other concurrencies of its repeat (recorded beside it): the middle concurrency
    interpolated, the outer ones extrapolated."""
    return [row for r in runs for row in (
        predict(args, [r], [r], requests, half=0)
        + predict(args, [x for x in runs if x["repeat"] == r["repeat"] and x["concurrency"] != r["concurrency"]], [r],
                  requests))]
