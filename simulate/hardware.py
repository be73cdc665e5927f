"""Step-latency and price models for `cosine simulate`: documented inputs, not measurements (except `fit`).

Every model step is linear, as in SmartSpec and this project's goodput controller: a verify step processing n
tokens takes `verify.a + verify.b * n` ms (decode is memory-bound: `a` is reading the weights once; `b` is the
compute per token), a drafter step for n requests `draft.a + draft.b * n` ms, and every call from the speculation
cluster's central node to a drafter and back costs `hop_ms`. The GPU profiles are derived from datasheet
figures with stated efficiencies (see docs/simulation.md for the arithmetic):

- A100-80GB SXM: 2039 GB/s HBM, 312 TFLOPS dense FP16 (NVIDIA A100 datasheet). RTX 3090: 936 GB/s, 71 TFLOPS FP16
  tensor (NVIDIA GA102 whitepaper). RTX 2080 Ti: 616 GB/s (NVIDIA Turing whitepaper).
- weights in FP16; a decode step reads them once at 60% of peak bandwidth; compute at 50% of peak; 4-way tensor
  parallelism adds two all-reduces per layer at ~15 us each; a drafter step in eager PyTorch pays ~0.15 ms of
  kernel launches per layer (small models are launch-bound, not bandwidth-bound).
- the paper's network: consumer GPUs on 100 Mbps Ethernet, the cluster and the A100 server on 10 Gbps at < 1 ms.
  A hop is one RPC each way with a few KB of token ids: 1.5 ms, RPC framework included.
- prices per GPU-hour are operator inputs (on-demand cloud and GPU-marketplace list prices of 2025, rounded);
  change them to yours with `--prices`.

`fit` builds the profile of this machine's served graph from a trace of a real run (speculation.record_trace).
"""

from __future__ import annotations

import numpy as np
from pydantic import BaseModel, Field

PRICES = {"A100-80GB": 1.80, "RTX3090": 0.25, "RTX2080Ti": 0.15, "CPU": 0.0}  # USD per GPU-hour (inputs)


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
    request_overhead_ms: float = Field(0.0, ge=0, description="per request: HTTP, tokenization, admission")
    replica_start_s: float = Field(20.0, ge=0, description="a new drafter replica's start (model load)")
    prices: dict[str, float] = Field(default_factory=lambda: dict(PRICES))

    def cost(self, seconds: float, drafter_gpu_seconds: float) -> float:
        """USD for the verifier's GPUs over `seconds` and the drafters' GPU-seconds."""
        return (self.verifier_gpus * self.prices.get(self.verifier_gpu, 0.0) * seconds
                + self.prices.get(self.drafter_gpu, 0.0) * drafter_gpu_seconds) / 3600


def _tp4(params_b: float, layers: int) -> Linear:
    """A target of `params_b` billion parameters on 4 A100s (tensor parallel)."""
    read_ms = 2 * params_b * 1e9 / 4 / (2039e9 * 0.6) * 1000
    allreduce_ms = layers * 2 * 0.015
    per_token_ms = 2 * params_b * 1e9 / (4 * 312e12 * 0.5) * 1000
    return Linear(a=round(read_ms + allreduce_ms, 2), b=round(per_token_ms, 3))


def drafter_step(params_b: float, layers: int, bandwidth_gbs: float) -> Linear:
    read_ms = 2 * params_b * 1e9 / (bandwidth_gbs * 1e9 * 0.6) * 1000
    return Linear(a=round(read_ms + 0.15 * layers + 0.5, 2), b=0.02)


DRAFTER_SHAPES = {"paper-llama": (0.068, 2), "paper-qwen": (0.494, 24)}  # drafter: billions of parameters, layers

PROFILES = {
    "paper-llama": Hardware(
        name="paper-llama", description="DeepSeek-R1-Distill-Llama-70B on 4x A100-80GB (NVLink), LLaMA-68M drafters "
        "on RTX 2080 Ti nodes", verifier_gpu="A100-80GB", verifier_gpus=4, verify=_tp4(70.6, 80),
        drafter_gpu="RTX2080Ti", draft=drafter_step(0.068, 2, 616), colocated_draft=drafter_step(0.068, 2, 2039),
        hop_ms=1.5),
    "paper-qwen": Hardware(
        name="paper-qwen", description="DeepSeek-R1-Distill-Qwen-32B on 4x A100-80GB (NVLink), Qwen2.5-0.5B drafters "
        "on RTX 3090 nodes", verifier_gpu="A100-80GB", verifier_gpus=4, verify=_tp4(32.8, 64),
        drafter_gpu="RTX3090", draft=drafter_step(0.494, 24, 936), colocated_draft=drafter_step(0.494, 24, 2039),
        hop_ms=1.5),
}


def fit(trace, name: str = "local-fit") -> Hardware:
    """This machine's served graph, from a trace: verify step time in tokens, the drafting round in depth and
    requests, and the loop's and the requests' overheads (what the trace's times leave unexplained)."""
    steps, drafts, requests = trace.steps, trace.drafts, trace.requests
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
    gaps = [1000 * (s1["t"] - s0["t"] - s1["verify_s"] - s1["wait_s"]) for s0, s1 in zip(steps, steps[1:])]
    gaps = [g for g in gaps if 0 <= g < 50]
    return Hardware(name=name, description="this machine's served graph, fitted from a trace",
                    verifier_gpu="CPU", verify=Linear(a=max(a, 0.0), b=max(b, 0.0)), drafter_gpu="CPU",
                    draft_round=draft_round, loop_overhead_ms=float(np.median(gaps)) if gaps else 0.0,
                    replica_start_s=5.0, request_overhead_ms=0.0)
