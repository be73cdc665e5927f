"""Step-latency and price models for `cosine simulate`: GPU steps calibrated on the step times this project measured,
this machine's served graph fitted from a trace (`fit`).

Every model step is linear, as in SmartSpec and this project's goodput controller: a verify step processing n tokens
takes `verify.a + verify.b * n` ms, a drafter step for n requests `draft.a + draft.b * n` ms, and every call from the
speculation cluster's central node to a drafter and back costs `hop_ms`.

A GPU step of the torch engine (the drafters) for B requests and T tokens of a model with L layers costs

    fixed + L * per_layer + B * per_request + (T - B) * per_token + weight bytes / (bandwidth * BW_EFFICIENCY)
          + 2 * params * T / (peak FLOPS * FLOPS_EFFICIENCY)

`fixed`, `per_layer`, `per_request` and `per_token` are the engine's own costs (Python, kernel launches or graph
replays, host copies), fitted per measured device and mode (eager, CUDA graphs) on the bench target's and a
drafter's steps on an H100 and an H200 (`GPU_STEPS`). Those models are launch-bound, so their steps cannot tell the
bandwidth and FLOPS terms apart from the rest: those come from the datasheets (`GPUS`) at assumed efficiencies, which
is how the costs scale to the A100, RTX 3090 and RTX 2080 Ti. The engine costs carry over unchanged: they are
host-side and per-kernel costs (the H100's and the H200's eager fits, engines of two different days, put a 0.5B
drafter's step on an A100 within 4% of each other). The newest engine's fits (H200) are the ones used.

The paper's verifier is vLLM with 4-way tensor parallelism: its 32B/70B steps are bound by reading the weights, a
regime none of the measured steps reaches, so the verify step stays derived from the datasheet (weights read at
BW_EFFICIENCY, FLOPs at FLOPS_EFFICIENCY, two all-reduces per layer). docs/simulation.md lists every assumption.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from pydantic import BaseModel, Field

from model_family.paths import REPO_ROOT


def calibration_file(name: str, root: Path = REPO_ROOT) -> Path:
    """A GPU run the simulator is calibrated on: the one committed under bench_results/ (with its provenance) if
    there is one, else the earlier run kept in bench_results/history/ (written before results recorded provenance;
    gpu-steps.json transcribed from runs whose JSON was not kept)."""
    measured = root / "bench_results" / name
    return measured if measured.is_file() else root / "bench_results" / "history" / name


GPU_STEPS = calibration_file("gpu-steps.json")
# `cosine bench steps` on one H100: the paper's own models (random weights of their configs), bf16
MEASURED_STEPS = calibration_file("steps-h100.json")
PRICES = {"A100-80GB": 1.80, "RTX3090": 0.25, "RTX2080Ti": 0.15, "CPU": 0.0}  # USD per GPU-hour (inputs)
ALLREDUCE_MS = 0.015  # one tensor-parallel all-reduce of a decode step's activations over NVLink (assumption)


class GPU(BaseModel):
    bandwidth_gbs: float
    fp32_tflops: float  # non-tensor (PyTorch leaves TF32 matmuls off)
    half_tflops: float  # dense tensor cores, 16-bit inputs with FP32 accumulate
    half: str  # the 16-bit type its tensor cores take: bf16, or fp16 where bf16 is missing
    source: str


GPUS = {
    "H100-SXM": GPU(bandwidth_gbs=3350, fp32_tflops=67, half_tflops=989, half="bf16",
                    source="NVIDIA H100 datasheet (SXM: 3.35 TB/s HBM3; BF16 1,979 TFLOPS with sparsity)"),
    "H200": GPU(bandwidth_gbs=4800, fp32_tflops=67, half_tflops=989, half="bf16",
                source="NVIDIA H200 datasheet (SXM: 4.8 TB/s HBM3e; BF16 1,979 TFLOPS with sparsity)"),
    "A100-80GB": GPU(bandwidth_gbs=2039, fp32_tflops=19.5, half_tflops=312, half="bf16",
                     source="NVIDIA A100 datasheet (80GB SXM: 2,039 GB/s HBM2e)"),
    "RTX3090": GPU(bandwidth_gbs=936, fp32_tflops=35.6, half_tflops=71, half="bf16",
                   source="NVIDIA Ampere GA102 whitepaper, appendix A (BF16 tensor with FP32 accumulate)"),
    "RTX2080Ti": GPU(bandwidth_gbs=616, fp32_tflops=13.4, half_tflops=53.8, half="fp16",
                     source="NVIDIA Turing whitepaper, appendix (reference card; FP16 tensor with FP32 accumulate; "
                            "Turing has no bf16)"),
}


class Shape(BaseModel):
    """A decoder's shape: what its steps read and compute."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool  # the LM head is the embedding matrix
    qkv_bias: bool = False

    @property
    def layer_params(self) -> int:
        head_dim = self.hidden // self.heads
        kv = 2 * self.kv_heads * head_dim
        return (self.hidden * (self.hidden + kv) + (self.hidden + kv) * self.qkv_bias + self.hidden * self.hidden
                + 3 * self.hidden * self.intermediate + 2 * self.hidden)

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    @property
    def read_params(self) -> int:
        """The weights a step reads: every layer and the LM head (an embedding row is gathered, not read whole)."""
        return self.read_params_at(self.layers)

    def read_params_at(self, layers: int) -> int:
        """The weights a step of the model's first `layers` layers reads (a measured slice)."""
        return layers * self.layer_params + self.vocab * self.hidden


# the models the paper ran (their config.json on the Hugging Face Hub) and the two this project measured on GPUs
SHAPES = {
    "llama-68m": Shape(layers=2, hidden=768, intermediate=3072, heads=12, kv_heads=12, vocab=32000, tied=False),
    "qwen2.5-0.5b": Shape(layers=24, hidden=896, intermediate=4864, heads=14, kv_heads=2, vocab=151936, tied=True,
                          qkv_bias=True),
    "r1-distill-qwen-32b": Shape(layers=64, hidden=5120, intermediate=27648, heads=40, kv_heads=8, vocab=152064,
                                 tied=False, qkv_bias=True),
    "r1-distill-llama-70b": Shape(layers=80, hidden=8192, intermediate=28672, heads=64, kv_heads=8, vocab=128256,
                                  tied=False),
    "bench-target": Shape(layers=4, hidden=1536, intermediate=4096, heads=24, kv_heads=24, vocab=8192, tied=False),
    "drafter-generic": Shape(layers=2, hidden=128, intermediate=352, heads=4, kv_heads=4, vocab=8192, tied=True),
}


def measured_efficiencies(path: Path = MEASURED_STEPS) -> tuple[float, float]:
    """(share of peak bandwidth, share of peak 16-bit FLOPS) that the paper's verifiers' steps reach on the device
    they were measured on: their graphed steps with the logits left on the device (what vLLM pays), fitted as
    weight bytes / (bandwidth * e_bw) + 2 * params * tokens / (FLOPS * e_flops) by least squares on relative
    error. Their slices' weight reads are bandwidth-bound, so e_bw is the read's; e_flops is the marginal cost of a
    token, which the read partly hides (it can exceed 1)."""
    data = json.loads(Path(path).read_text())
    gpu = GPUS[_GPU_OF[data["device"]]]
    rows = [s for s in data["steps"]
            if s["graphs"] and s.get("layers_run") and data["models"][s["model"]]["role"] == "verifier"]
    feats, ms = [], []
    for s in rows:
        read = SHAPES[s["model"]].read_params_at(s["layers_run"])
        feats.append([2 * read / (gpu.bandwidth_gbs * 1e6), 2 * read * s["tokens"] / (gpu.half_tflops * 1e9)])
        ms.append(s["device_ms"])
    inv_bw, inv_flops = _nnls(feats, ms, ms)
    return round(1 / inv_bw, 3), round(1 / inv_flops, 3)


_GPU_OF = {"NVIDIA H100 80GB HBM3": "H100-SXM", "NVIDIA H200": "H200"}  # device name -> datasheet entry


class EngineCosts(BaseModel):
    """The torch engine's own step costs on one device and mode, fitted on measured steps (ms)."""

    gpu: str
    graphs: bool
    fixed: float
    per_layer: float
    per_request: float
    per_vocab_row: float = 0.0  # per request per 8,192 logits (computed and copied to the host); fitted only where
    # the measured models' vocabularies differ (the paper's drafters: 152k and 32k; the bench models share 8,192)
    per_token: float  # per token beyond a request's first (verify steps)
    points: list[dict] = Field(default_factory=list, description="the measured steps with the model's prediction")


def _steps(gpu_steps: Path, measured: Path) -> list[dict]:
    """Every measured step the engine costs are fitted on, with its weights' bytes: the bench models' steps
    (gpu-steps.json, float32) and the paper's drafters' graphed steps (steps-h100.json, bf16, the whole step as a
    drafter pays it, logits copied to the host). The latter's eager rows are left out: their `device_ms` was timed
    with autograd on (the file's `defects`), and a drafter on a GPU runs graphed."""
    rows = [s | {"dtype_bytes": 4} for s in json.loads(Path(gpu_steps).read_text())["steps"]]
    data = json.loads(Path(measured).read_text())
    rows += [s | {"gpu": _GPU_OF[data["device"]], "dtype_bytes": 2} for s in data["steps"]
             if s["graphs"] and data["models"][s["model"]]["role"] == "drafter"]
    return rows


def _rows(model: str, requests: float) -> float:
    """A step's requests in rows of 8,192 logits."""
    return requests * SHAPES[model].vocab / 8192


def _datasheet_ms(gpu: GPU, shape: Shape, dtype_bytes: int, tokens: int, tp: int = 1) -> float:
    """A step's GPU terms: its weights read once and its FLOPs for `tokens`, split over `tp` GPUs, at the stated
    efficiencies."""
    read = dtype_bytes * shape.read_params / tp / (gpu.bandwidth_gbs * 1e9 * BW_EFFICIENCY)
    peak = (gpu.fp32_tflops if dtype_bytes == 4 else gpu.half_tflops) * 1e12
    flops = 2 * shape.read_params * tokens / tp / (peak * FLOPS_EFFICIENCY)
    return 1000 * (read + flops)


def _nnls(features: list[list[float]], y: list[float], ms: list[float]) -> np.ndarray:
    """Non-negative least squares on relative error: each step weighted by 1 / its measured `ms`, so a 0.2 ms step
    counts as much as a 4 ms one."""
    from scipy.optimize import nnls

    w = 1 / np.array(ms, float)
    return nnls(np.array(features, float) * w[:, None], np.array(y, float) * w)[0]


def calibrate(path: Path = GPU_STEPS, measured: Path = MEASURED_STEPS) -> dict[tuple[str, bool], EngineCosts]:
    """Engine costs per (GPU, graphs) from the measured steps, minus their datasheet bandwidth and FLOPS terms.
    One-token steps (a drafter's kind) fit fixed, per-layer and per-request costs; the multi-token verify steps then
    fit the per-token cost on what those leave."""
    every = _steps(path, measured)
    out = {}
    for key in sorted({(s["gpu"], s["graphs"]) for s in every}):
        steps = [s for s in every if (s["gpu"], s["graphs"]) == key]
        gpu = GPUS[key[0]]

        def engine_ms(s):  # the step's time beyond its datasheet terms
            return s["ms"] - _datasheet_ms(gpu, SHAPES[s["model"]], s["dtype_bytes"], s["tokens"])

        one = [s for s in steps if s["new_tokens"] == 1]
        vocabs = len({SHAPES[s["model"]].vocab for s in one}) > 1
        feats = [[1, SHAPES[s["model"]].layers, s["batch"]] + ([_rows(s["model"], s["batch"])] if vocabs else []) for s in one]
        fixed, per_layer, per_request, *rest = _nnls(feats, [engine_ms(s) for s in one], [s["ms"] for s in one])
        per_vocab_row = rest[0] if rest else 0.0
        base = {id(s): fixed + per_layer * SHAPES[s["model"]].layers + per_request * s["batch"]
                + per_vocab_row * _rows(s["model"], s["batch"]) for s in steps}
        more = [s for s in steps if s["new_tokens"] > 1]
        per_token = _nnls([[s["tokens"] - s["batch"]] for s in more], [engine_ms(s) - base[id(s)] for s in more],
                          [s["ms"] for s in more])[0] if more else 0.0
        costs = EngineCosts(gpu=key[0], graphs=key[1], fixed=fixed, per_layer=per_layer, per_request=per_request,
                            per_vocab_row=per_vocab_row, per_token=per_token)
        costs.points = [{k: s[k] for k in ("model", "batch", "new_tokens", "ms")}
                        | {"model_ms": round(engine_step_ms(costs, key[0], s["model"], s["batch"], s["tokens"],
                                                            s["dtype_bytes"]), 3)}
                        for s in steps]
        out[key] = costs
    return out


def engine_step_ms(costs: EngineCosts, gpu: str, model: str, requests: int, tokens: int, dtype_bytes: int = 2) -> float:
    """A torch-engine step of `model` on `gpu`: the engine costs of `costs` plus the datasheet terms."""
    shape = SHAPES[model]
    return (costs.fixed + costs.per_layer * shape.layers + costs.per_request * requests
            + costs.per_vocab_row * _rows(model, requests)
            + costs.per_token * (tokens - requests) + _datasheet_ms(GPUS[gpu], shape, dtype_bytes, tokens))


class Linear(BaseModel):
    a: float = Field(..., ge=0, description="ms per step")
    b: float = Field(0.0, ge=0, description="ms per unit (token or request) in the step")

    def __call__(self, n: float) -> float:
        return (self.a + self.b * n) / 1000


class DraftRound(BaseModel):
    """A whole drafting round, fitted where drafters share the verifier's hardware (this machine):
    ms = a + b * depth + c * depth * requests + d * scored, `scored` the context tokens of requests in their
    first round (every drafter reads the prompt to score it for routing)."""

    a: float = Field(..., ge=0)
    b: float = Field(0.0, ge=0)
    c: float = Field(0.0, ge=0)
    d: float = Field(0.0, ge=0)

    def __call__(self, depth: int, requests: int, scored: int) -> float:
        return (self.a + self.b * depth + self.c * depth * requests + self.d * scored) / 1000


class Hardware(BaseModel):
    name: str
    description: str
    verifier_gpu: str
    verifier_gpus: int = Field(1, ge=1, description="GPUs the target is split over")
    verify: Linear = Field(..., description="verify step, n = tokens processed (prompt tokens included)")
    drafter_gpu: str
    draft: Linear | None = Field(None, description="drafter step on its own GPU, n = requests in the step")
    colocated_draft: Linear | None = Field(None, description="a drafter step run on the verifier's GPUs (vanilla "
                                           "speculation, vLLM draft_model)")
    hop_ms: float = Field(0.0, ge=0, description="one call to a drafter and back")
    draft_round: DraftRound | None = Field(None, description="fitted round model (drafters on the verifier's "
                                           "hardware); replaces draft/hop")
    loop_overhead_ms: float = Field(0.0, ge=0, description="per verify iteration, beyond the step and the drafts")
    admit_ms: float = Field(0.0, ge=0, description="per request joining the batch, beyond its prompt tokens in the "
                            "verify step: a prefill the engine runs before the timed step (the torch engine's admit)")
    request_overhead_ms: float = Field(0.0, ge=0, description="per request: HTTP, tokenization, admission")
    replica_start_s: float = Field(20.0, ge=0, description="a new drafter replica's start (model load)")
    prices: dict[str, float] = Field(default_factory=lambda: dict(PRICES))

    def cost(self, seconds: float, drafter_gpu_seconds: float) -> float:
        """USD for the verifier's GPUs over `seconds` and the drafters' GPU-seconds."""
        return (self.verifier_gpus * self.prices.get(self.verifier_gpu, 0.0) * seconds
                + self.prices.get(self.drafter_gpu, 0.0) * drafter_gpu_seconds) / 3600


BW_EFFICIENCY, FLOPS_EFFICIENCY = measured_efficiencies()
ENGINE_COSTS = calibrate()
# the fits the profiles use: eager, the newest engine's (H200, 2026-11-26); with CUDA graphs, the paper's own
# drafters' steps (H100, bf16, 2026-11-27)
REFERENCE = {False: ("H200", False), True: ("H100-SXM", True)}


def drafter_step(model: str, gpu: str, graphs: bool = True) -> Linear:
    """A torch-engine drafter step of `model` on one `gpu` (16-bit weights), t(requests)."""
    costs = ENGINE_COSTS[REFERENCE[graphs]]
    a = engine_step_ms(costs, gpu, model, 0, 0)
    return Linear(a=round(a, 3), b=round(engine_step_ms(costs, gpu, model, 1, 1) - a, 4))


def verify_step(model: str, gpu: str = "A100-80GB", tp: int = 4) -> Linear:
    """vLLM's verify step of `model` over `tp` GPUs, t(tokens): the weights read once, two all-reduces per layer,
    the FLOPs per token (datasheet at the stated efficiencies)."""
    shape, g = SHAPES[model], GPUS[gpu]
    a = _datasheet_ms(g, shape, 2, 0, tp) + (2 * shape.layers * ALLREDUCE_MS if tp > 1 else 0.0)
    return Linear(a=round(a, 2), b=round(_datasheet_ms(g, shape, 2, 1, tp) - _datasheet_ms(g, shape, 2, 0, tp), 3))


PAPER_PAIRS = {"paper-llama": ("r1-distill-llama-70b", "llama-68m", "RTX2080Ti"),
               "paper-qwen": ("r1-distill-qwen-32b", "qwen2.5-0.5b", "RTX3090")}


def paper_profile(name: str, graphs: bool = True, drafter_gpu: str | None = None, hop_ms: float = 1.5) -> Hardware:
    """The paper's pair `name` on 4 x A100-80GB (NVLink), its drafters on `drafter_gpu` (the paper's kind by default),
    the torch engine's drafter steps eager or replayed from CUDA graphs (as it runs them on a GPU)."""
    target, drafter, kind = PAPER_PAIRS[name]
    kind = drafter_gpu or kind
    return Hardware(name=name if graphs else f"{name}-eager",
                    description=f"{target} on 4x A100-80GB (vLLM, TP 4), {drafter} drafters on {kind} "
                                f"({'CUDA graphs' if graphs else 'eager'})",
                    verifier_gpu="A100-80GB", verifier_gpus=4, verify=verify_step(target), drafter_gpu=kind,
                    draft=drafter_step(drafter, kind, graphs),
                    colocated_draft=drafter_step(drafter, "A100-80GB", graphs),
                    hop_ms=hop_ms)


PROFILES = {p.name: p for p in (paper_profile(n, graphs) for graphs in (True, False) for n in PAPER_PAIRS)}


def fit(trace, name: str = "local-fit", half: int | None = None) -> Hardware:
    """This machine's served graph, from a trace: verify step time in tokens, the drafting round in depth and
    requests, and the loop's and the requests' overheads (what the trace's times leave unexplained). `half`: fit
    on every other step and drafting round only (0: the even ones, 1: the odd ones), to predict the run from
    timings the fit has not seen; the admission cost, which only the whole run's time reveals, is left out then."""
    every = trace.steps
    steps, drafts = (every, trace.drafts) if half is None else (every[half::2], trace.drafts[half::2])
    x = np.array([s["tokens"] for s in steps], float)
    y = np.array([1000 * s["verify_s"] for s in steps])
    b, a = np.polyfit(x, y, 1) if np.ptp(x) > 0 else (0.0, float(np.median(y)))
    rounds = [d for d in drafts if d["depth"] > 0]
    if rounds:
        from scipy.optimize import nnls

        feats = np.array([[1.0, d["depth"], d["depth"] * d["requests"], d["scored"]] for d in rounds])
        coef, _ = nnls(feats, np.array([1000 * d["seconds"] for d in rounds]))
        draft_round = DraftRound(a=coef[0], b=coef[1], c=coef[2], d=coef[3])
    else:
        draft_round = DraftRound(a=0.0)
    # loop overhead: time between consecutive steps not spent verifying or waiting for drafts (idle gaps excluded)
    gaps = [1000 * (s1["t"] - s0["t"] - s1["verify_s"] - s1["wait_s"]) for s0, s1 in zip(every, every[1:])]
    gaps = [g for i, g in enumerate(gaps, 1) if 0 <= g < 50 and (half is None or i % 2 == half)]
    overhead = float(np.median(gaps)) if gaps else 0.0
    # admission: what the loop's busy time (some request in flight) leaves unexplained, per request, beyond what
    # its prompt tokens cost in a verify step
    admit = 0.0
    if trace.requests and half is None:
        busy, end = 0.0, -np.inf
        for t0, t1 in sorted((r["t0"], r["t1"]) for r in trace.requests):
            busy += max(0.0, t1 - max(t0, end))
            end = max(end, t1)
        loop = sum(s["verify_s"] + s["wait_s"] for s in steps) + overhead * len(steps) / 1000
        prompt = np.mean([len(r["prompt"]) for r in trace.requests])
        admit = max(0.0, 1000 * (busy - loop) / len(trace.requests) - max(b, 0.0) * prompt)
    return Hardware(name=name, description="this machine's served graph, fitted from a trace",
                    verifier_gpu="CPU", verify=Linear(a=max(a, 0.0), b=max(b, 0.0)), drafter_gpu="CPU",
                    draft_round=draft_round, loop_overhead_ms=overhead, admit_ms=admit,
                    replica_start_s=5.0, request_overhead_ms=0.0)
