"""Sampled workloads: the sampling settings every system of a benchmark runs at, and how their outputs are checked.

Greedy outputs are compared token for token. Sampled ones cannot be (every engine draws its random numbers its own
way), so they are checked by distribution: every sampled token's randomised probability integral transform (PIT)
under the target's own distribution given the output so far, `u = P(tokens ranked above it) + V * p(token)` with
V uniform and the tokens ranked by probability. Whatever the prompts and however repetitive the text, the u of a
system that samples from the target's distribution are independent and uniform on [0, 1) (each is uniform given
everything before it), so the chi-square test of their counts in equal bins (scipy's `chisquare`, as the tests of
our rejection sampling use it) has a valid p-value over every position of every output; a system that samples
from another distribution (another temperature, a lost top-p, a biased acceptance rule) puts them elsewhere.

The reference distribution is computed with the model the bench target was widened from (`widened_from` in its
family.json): the widening computes the same function (model_family/bench_target.py) at a fraction of the cost.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

P_FLOOR = 1e-3  # below this a row is flagged: the threshold of the tests of our rejection sampling
BINS = 20


def add_arguments(parser) -> None:
    """`--temperature`, `--top-p` and `--seed` of a benchmark that compares systems at the same settings."""
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0: greedy, outputs compared token for token; > 0: every system samples at this "
                             "temperature with the same seeds, outputs compared by distribution")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (with --temperature > 0)")
    parser.add_argument("--seed", type=int, default=0, help="the first request's seed (each request has its own)")


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError("--temperature must be >= 0 and --top-p in (0, 1]")

    @classmethod
    def from_args(cls, args) -> Sampling:
        return cls(getattr(args, "temperature", 0.0), getattr(args, "top_p", 1.0), getattr(args, "seed", 0))

    @classmethod
    def of(cls, recorded: dict) -> Sampling:
        """The settings a result recorded (`as_dict`)."""
        return cls(recorded["temperature"], recorded["top_p"], recorded["seed"])

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def seeds(self, n: int, run: int) -> list[int] | None:
        """The seeds of `n` requests of run `run` (0: the warm-up, r + 1: repeat r): the same for every system,
        different between runs (a repeat adds samples, it does not redraw the same ones); None when greedy."""
        return None if self.greedy else [self.seed + run * 10_000 + i for i in range(n)]

    def for_requests(self, n: int, run: int) -> dict:
        """What a benchmark worker (benchmarks/workers.py) is sent: the settings and the seeds of `n` requests of
        run `run` (0: the warm-up)."""
        return {"temperature": self.temperature, "top_p": self.top_p, "seeds": self.seeds(n, run)}

    def describe(self) -> str:
        return "greedy" if self.greedy else f"T = {self.temperature:g}, top_p {self.top_p:g}, seed {self.seed}"

    def as_dict(self) -> dict:
        return asdict(self) | {"greedy": self.greedy}


def hf_sampling(temperature: float, top_p: float) -> dict:
    """`generate`'s arguments for HF assisted generation at these settings. HF adds top-k 50 to any sampling it is
    not told otherwise about (its generation defaults), which no other system here applies: `top_k=0` turns it off."""
    if temperature == 0:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": 0}


def reference_model(model_dir: Path):
    """The model whose distribution the outputs of `model_dir` are checked against: the one it was widened from
    (same function, cheaper), else itself."""
    import torch
    from transformers import AutoModelForCausalLM

    meta = model_dir / "family.json"
    source = json.loads(meta.read_text()).get("widened_from") if meta.exists() else None
    path = model_dir.parent / source if source else model_dir
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def pit_values(model, prompts: list[list[int]], outputs: list[list[int]], sampling: Sampling,
               rng: np.random.Generator) -> np.ndarray:
    """The randomised PIT of every output token under `model`'s distribution at the sampling settings."""
    import torch

    from engines.sampling import SamplingParams, target_probs

    params = SamplingParams(temperature=sampling.temperature, top_p=sampling.top_p)
    out = []
    with torch.no_grad():
        for prompt, output in zip(prompts, outputs):
            if not output:
                continue
            ids = torch.tensor([list(prompt) + list(output)])
            logits = model(input_ids=ids).logits[0, len(prompt) - 1:len(prompt) - 1 + len(output)]
            probs = target_probs(logits, params).double()
            x = torch.tensor(output)
            px = probs.gather(-1, x[:, None])
            vocab = torch.arange(probs.shape[-1])
            above = (probs > px) | ((probs == px) & (vocab < x[:, None]))  # ranked by probability, then by id
            u = (probs * above).sum(-1) + torch.from_numpy(rng.random(len(output))) * px[:, 0]
            out.append(u.clamp(0, 1 - 1e-12).numpy())
    return np.concatenate(out) if out else np.zeros(0)


def distribution_pvalue(model, prompts: list[list[int]], runs: list[list[list[int]]], sampling: Sampling,
                        bins: int = BINS) -> dict:
    """The chi-square test of the PIT of every token of `runs` (each a run's outputs, one per prompt) against
    uniform: {"p": p-value, "tokens": tokens tested}."""
    from scipy.stats import chisquare

    rng = np.random.default_rng(sampling.seed)
    u = np.concatenate([pit_values(model, prompts, outputs, sampling, rng) for outputs in runs])
    if len(u) < 5 * bins:
        return {"p": None, "tokens": int(len(u))}
    counts = np.histogram(u, bins=bins, range=(0.0, 1.0))[0]
    return {"p": float(chisquare(counts).pvalue), "tokens": int(len(u))}


def check_cell(row: dict, identity: str = "identical") -> str:
    """The output-check cell of a row: token identity (its field `identity`) when greedy, the distribution test's
    p-value when sampled."""
    if row.get("distribution_p") is not None:
        flag = "" if row["distribution_p"] >= P_FLOOR else " FAILED"
        return f"p = {row['distribution_p']:.3g}{flag}"
    same = row.get(identity)
    return "-" if same is None else "yes" if same else "NO"


def check_header(result: dict, greedy: str) -> str:
    """The output-check column's header: `greedy` unless the result was sampled."""
    recorded = result.get("config", {}).get("sampling")
    return greedy if not recorded or recorded["greedy"] else "output: chi-square p vs the target's distribution"


def text_columns(result: dict) -> tuple[str, str, Callable[[dict], str]]:
    """The text-statistics columns of a result's table: (header cells, separator cells, a row's cells), all empty
    for a result recorded before the statistics were (its table as it was printed then)."""
    from model_family.text_stats import stats_cells

    if not any("text" in r for r in result["rows"]):
        return "", "", lambda row: ""
    return (" distinct tokens per output | repeated 4-gram share |", "---|---|",
            lambda row: " {} | {} |".format(*stats_cells(row.get("text"))))
