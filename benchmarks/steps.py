"""`cosine bench steps`: what one step of the paper's models costs through our engine, on this machine's device.

The CoSine paper's pairs (a DeepSeek-R1-Distill-Qwen-32B or -Llama-70B verifier; Qwen2.5-0.5B or LLaMA-68M drafters)
with random weights of their real configurations: a model's shape alone sets what its step reads and computes, so
no hub download is needed. Each model is built on the device in bf16 and stepped by `LlamaRunner` as the verifier
and the drafters step it, eager (every kernel launched from Python) and replayed from CUDA graphs, for a grid of
batch sizes and new tokens per request after `context` cached tokens:
- `ms`: the runner's whole step, logits copied to the host included (what our loop pays);
- `device_ms`: the same step without that copy (what an engine that samples on the device, vLLM, pays).
The verifiers are measured in two slices of their first layers each (the 70B fits no 80 GB GPU, the 32B leaves
too little beside it) and the full depth extrapolated linearly from them (`extrapolated: true`). Each model runs in
a process of its own (a failure or an out-of-memory costs that model only) and within a time budget; the JSON is the input of the simulator's GPU profiles
(simulate/hardware.py). Random weights make the outputs meaningless and the costs real.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.provenance import with_provenance

# config.json of each model on the Hugging Face Hub, the fields that set the cost (rope scaling and the like
# change no step's cost and are left out)
MODELS = {
    "r1-distill-qwen-32b": dict(model_type="qwen2", hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
                                num_attention_heads=40, num_key_value_heads=8, vocab_size=152064,
                                max_position_embeddings=131072, rope_theta=1e6, rms_norm_eps=1e-5,
                                tie_word_embeddings=False, source="deepseek-ai/DeepSeek-R1-Distill-Qwen-32B"),
    "r1-distill-llama-70b": dict(model_type="llama", hidden_size=8192, intermediate_size=28672,
                                 num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                                 vocab_size=128256, max_position_embeddings=131072, rope_theta=5e5,
                                 rms_norm_eps=1e-5, tie_word_embeddings=False,
                                 source="deepseek-ai/DeepSeek-R1-Distill-Llama-70B"),
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                         max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True,
                         source="Qwen/Qwen2.5-0.5B"),
    "llama-68m": dict(model_type="llama", hidden_size=768, intermediate_size=3072, num_hidden_layers=2,
                      num_attention_heads=12, num_key_value_heads=12, vocab_size=32000, max_position_embeddings=2048,
                      rms_norm_eps=1e-6, tie_word_embeddings=False, source="JackFram/llama-68m"),
}
ROLES = {"r1-distill-qwen-32b": "verifier", "r1-distill-llama-70b": "verifier", "qwen2.5-0.5b": "drafter",
         "llama-68m": "drafter"}
VERIFY_GRID = {"batch": (1, 4, 8, 16), "new_tokens": (1, 4, 8, 16)}
DRAFT_GRID = {"batch": (1, 2, 4, 8, 16, 32), "new_tokens": (1,)}
# the verifiers' layers measured (two slices of each, in processes of their own), the full depth extrapolated: the
# 70B's 80 layers fit no 80 GB GPU, and the 32B's 64 leave too little beside them for a cache and graphs
SLICES = {"r1-distill-qwen-32b": (24, 48), "r1-distill-llama-70b": (12, 24)}


def _config(name: str, layers: int | None = None, scale: float = 1.0):
    from transformers import AutoConfig

    fields = {k: v for k, v in MODELS[name].items() if k not in ("model_type", "source")}
    if layers:
        fields["num_hidden_layers"] = layers
    if scale != 1.0:  # the tests' tiny stand-ins: the same architecture, 4 heads of 16, other widths scaled
        kv = 4 if fields["num_key_value_heads"] == fields["num_attention_heads"] else 2
        fields |= {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": kv, "head_dim": 16,
                   "intermediate_size": max(64, int(fields["intermediate_size"] * scale)),
                   "vocab_size": max(256, int(fields["vocab_size"] * scale)),
                   "num_hidden_layers": layers or min(fields["num_hidden_layers"], 2)}
    return AutoConfig.for_model(MODELS[name]["model_type"], **fields)


def _params(cfg) -> int:
    """The model's parameter count, from an instance without storage (no 32B allocated to count it)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return round(1000 * statistics.median(times), 4)


def build(name: str, device: str, layers: int | None = None, scale: float = 1.0):
    """Model `name` (its first `layers` layers, where given) with random weights on `device`: bf16 on a GPU."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device != "cpu" else torch.float32
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(_config(name, layers, scale), dtype=dtype).eval()
    with torch.no_grad():  # never leave it to the library: a GPU reads all-zero weights faster than random ones
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    return model


def measure(model, name: str, graphs: bool, context: int, repeats: int, grid: dict | None = None,
            log=print) -> list[dict]:
    """Steps of `model` over its role's grid, eager or replayed from CUDA graphs."""
    import torch

    from engines.graphs import GRAPH_MAX_NEW
    from engines.runner import LlamaRunner

    grid = grid or (VERIFY_GRID if ROLES[name] == "verifier" else DRAFT_GRID)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    max_b = max(grid["batch"])
    runner = LlamaRunner(model, max_slots=max_b, max_len=context + GRAPH_MAX_NEW + 8, graphs=graphs)
    log(f"  graphs {graphs}: KV cache {runner.kv_cache_bytes / 2**30:.2f} GiB")
    rids = [f"r{i}" for i in range(max_b)]
    prompt = [3 + i % 1000 for i in range(context)]
    for r in rids:
        runner.add(r)
        runner.forward([r], [prompt], hidden_only_last=True)
        runner.commit_all(r, prompt)
    steps = []
    for b in grid["batch"]:
        for n in grid["new_tokens"]:
            ids, inputs = rids[:b], [list(range(5, 5 + n))] * b
            slots = [runner.requests[r] for r in ids]

            def whole():
                for r in ids:
                    runner.rollback(r, context)
                runner.forward(ids, inputs)

            @torch.no_grad()  # as `forward` runs it: no autograd graph kept through the cache
            def on_device():  # the same step, its logits left on the device
                if runner.graphs is not None:
                    runner.graphs.step([s.slot for s in slots], [context] * b, inputs, False)
                else:
                    runner._step(slots, inputs, None, False)
                sync()

            whole()  # warm-up (with graphs: the capture)
            on_device()
            row = {"model": name, "graphs": graphs, "batch": b, "new_tokens": n, "tokens": b * n,
                   "context": context, "ms": _median_ms(whole, repeats), "device_ms": _median_ms(on_device, repeats)}
            steps.append(row)
            log(f"    batch {b:>2} x {n:>2} tokens: {row['ms']:.3f} ms ({row['device_ms']:.3f} on the device)")
    return steps


def _one(args) -> int:
    """One model (or one slice of it) in this process, as the parent runs each: eager, then with CUDA graphs (on a
    GPU)."""
    import torch

    cuda = args.device.startswith("cuda")
    layers = int(args.layers) if args.layers else None
    t = time.perf_counter()
    model = build(args.one, args.device, layers, args.scale)
    gib = f", {torch.cuda.memory_allocated() / 2**30:.1f} GiB on the GPU" if cuda else ""
    print(f"  {args.one}{f', its first {layers} layers' if layers else ''}: built in {time.perf_counter() - t:.1f} s"
          f"{gib}", flush=True)
    rows = []
    for graphs in (False, True) if cuda else (False,):
        for row in measure(model, args.one, graphs, args.context, args.repeats):
            rows.append(row | ({"layers_run": layers} if layers else {}))
        Path(args.part).write_text(json.dumps(rows))  # eager kept if the graphs fail
        gc.collect()  # a graphed runner and its graphs refer to each other
    return 0


def _extrapolate(rows: list[dict], depth: int) -> list[dict]:
    """Steps at the model's full `depth` from the slices' steps, per shape and mode: the on-device step on a line
    through the slices' (layers, device_ms) points; the whole step is that plus the copy of the logits to the host
    (ms - device_ms), which does not grow with depth: the slices' mean copy, never below zero. (Two lines drawn
    separately, one through ms and one through device_ms, multiply the copy's noise by the extrapolation and can put
    the on-device step above the whole one.)"""
    out = []
    for key in sorted({(r["graphs"], r["batch"], r["new_tokens"]) for r in rows}):
        pts = sorted(((r["layers_run"], r) for r in rows if (r["graphs"], r["batch"], r["new_tokens"]) == key),
                     key=lambda p: p[0])
        if len(pts) < 2:  # a slice failed: nothing to draw a line through
            continue
        (l0, r0), (l1, r1) = pts[0], pts[-1]
        device = r1["device_ms"] + (r1["device_ms"] - r0["device_ms"]) * (depth - l1) / (l1 - l0)
        copy = max(0.0, statistics.mean(r["ms"] - r["device_ms"] for _, r in pts))
        out.append({k: v for k, v in r1.items() if k != "layers_run"}
                   | {"ms": round(device + copy, 4), "device_ms": round(device, 4)}
                   | {"extrapolated": True, "from_layers": [l0, l1]})
    return out


def run(models: list[str], out: Path, device: str = "cuda", context: int = 1024, repeats: int = 7,
        budget_s: float = 420, scale: float = 1.0, log=print) -> dict:
    import torch

    gpu = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    result = {"about": __doc__.split("\n\n")[0].replace("\n", " "),
              "device": gpu, "torch": torch.__version__, "dtype": "bfloat16" if device != "cpu" else "float32",
              "date": time.strftime("%Y-%m-%d"), "context": context, "repeats": repeats,
              "models": {}, "steps": []}
    start = time.perf_counter()
    for name in models:
        left = budget_s - (time.perf_counter() - start)
        if left < 20:
            log(f"{name}: skipped, {left:.0f} s of the budget left")
            continue
        depth = MODELS[name]["num_hidden_layers"]
        slices = SLICES.get(name, ())
        cfg = _config(name, scale=scale)
        result["models"][name] = {"role": ROLES[name], "source": MODELS[name]["source"], "params": _params(cfg),
                                  "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size,
                                  "vocab": cfg.vocab_size} | ({"measured_layers": list(slices)} if slices else {})
        log(f"{name} ({result['models'][name]['params'] / 1e9:.2f}B parameters, {ROLES[name]}), "
            f"{left:.0f} s of the budget left")
        rows = []
        for layers in slices or (None,):
            part = out.with_suffix(f".{name}.{layers}.part")
            cmd = [sys.executable, "-m", "benchmarks.steps", "--one", name, "--device", device, "--context",
                   str(context), "--repeats", str(repeats), "--scale", str(scale), "--part", str(part)]
            cmd += ["--layers", str(layers)] if layers else []
            try:
                rc = subprocess.run(cmd, timeout=max(1.0, budget_s - (time.perf_counter() - start))).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
            if rc != 0:
                result["models"][name].setdefault("errors", []).append(f"{layers or depth} layers: exit {rc}")
                log(f"{name}: failed ({rc})")
            if part.exists():
                rows += json.loads(part.read_text())
                part.unlink()
        result["steps"] += _extrapolate(rows, depth) + rows if slices else rows
        # after every model: a later failure loses nothing
        out.write_text(json.dumps(with_provenance(result), indent=1))
    result["seconds"] = round(time.perf_counter() - start, 1)
    result = with_provenance(result)
    out.write_text(json.dumps(result, indent=1))
    return result


def format_table(result: dict) -> str:
    lines = [f"{result['device']}, {result['dtype']}, context {result['context']} tokens; ms per step (median of "
             f"{result['repeats']}), whole step / on the device:", "",
             "| model | graphs | batch | new tokens | ms | device ms |", "|---|---|---|---|---|---|"]
    for s in result["steps"]:
        if s.get("layers_run"):
            continue
        lines.append(f"| {s['model']}{' (extrapolated)' if s.get('extrapolated') else ''} | "
                     f"{'yes' if s['graphs'] else 'no'} | {s['batch']} | {s['new_tokens']} | {s['ms']:.3f} | "
                     f"{s['device_ms']:.3f} |")
    return "\n".join(lines)


def summary_table(result: dict) -> str:
    """The steps as the simulator uses them, one row per model and batch: graphed steps with the logits left on the
    device for the verifiers (vLLM samples there), for the drafters the whole step (our drafters copy the logits to
    the host) graphed and eager; a verifier measured in slices, each slice (`extrapolated` rows have their own)."""
    new_tokens = VERIFY_GRID["new_tokens"]
    lines = ["| model | layers run | batch | " + " | ".join(f"{n} new token{'s' * (n > 1)}" for n in new_tokens)
             + " |", "|---|---|---|" + "---|" * len(new_tokens)]
    by = {}
    for s in result["steps"]:
        layers = ("all, extrapolated" if s.get("extrapolated") else
                  f"{s['layers_run']} of {result['models'][s['model']]['layers']}" if s.get("layers_run") else "all")
        by.setdefault((s["model"], layers, s["batch"]), {})[(s["graphs"], s["new_tokens"])] = s
    for (model, layers, batch), cells in by.items():
        if ROLES[model] != "verifier":
            continue
        row = [f"{cells[(True, n)]['device_ms']:.2f}" if (True, n) in cells else "-" for n in new_tokens]
        lines.append(f"| {model} | {layers} | {batch} | " + " | ".join(row) + " |")
    lines += ["", "| drafter | batch | graphed, whole step | graphed, on the device | eager, whole step |",
              "|---|---|---|---|---|"]
    for (model, layers, batch), cells in by.items():
        if ROLES[model] == "drafter":
            g, e = cells.get((True, 1)), cells.get((False, 1))
            lines.append(f"| {model} | {batch} | {g['ms']:.3f} | {g['device_ms']:.3f} | "
                         f"{e['ms']:.3f} |" if g and e else f"| {model} | {batch} | - | - | - |")
    return "\n".join(lines)


def main(args) -> int:
    if args.one:
        return _one(args)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = run(args.models, out, args.device, args.context, args.repeats, args.budget_s, args.scale)
    print(format_table(result) + "\n\n" + summary_table(result))
    return 0 if result["steps"] else 1


def add_arguments(p) -> None:
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--device", default="cuda")
    p.add_argument("--context", type=int, default=1024, help="cached tokens per request before the step")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--budget-s", type=float, default=420, help="wall-clock budget for all models (a model not "
                   "started within it is skipped)")
    p.add_argument("--scale", type=float, default=1.0, help="widths multiplied by this and at most 2 layers: tiny "
                   "stand-ins of the same architectures (tests, a dry run on a CPU)")
    p.add_argument("--json", default="bench_results/gpu-steps-measured.json")
    for hidden in ("--one", "--layers", "--part"):  # the parent's call of one model in a process of its own
        p.add_argument(hidden, help=argparse.SUPPRESS)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
