"""Per-request sampling parameters and the target distribution they define."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# parameters only vLLM's sampler applies, at the value that turns each off
SAMPLER_ONLY = {"min_tokens": 0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
                "logprobs": None, "prompt_logprobs": None, "allowed_token_ids": None, "bad_words": [],
                "structured_outputs": None}


@dataclass
class SamplingParams:
    """OpenAI-style parameters. temperature == 0 means greedy decoding."""

    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # applied by vLLM's sampler only (SAMPLER_ONLY)
    min_tokens: int = 0  # EOS and stop ids are held back until this many tokens (vLLM's min_tokens)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # the target's log-probability of each token, and of this many top tokens
    prompt_logprobs: int | None = None  # the same of each prompt token (from its second), computed in the prefill
    allowed_token_ids: list[int] | None = None  # the target samples among these only (drafts outside are rejected)
    bad_words: list[str] = field(default_factory=list)  # never emitted; vLLM tokenizes them (with and without space)
    # vLLM's StructuredOutputsParams as keyword arguments (json, json_object, regex, choice, grammar, ...): the
    # grammar masks the target's distribution at every position, drafts' included
    structured_outputs: dict | None = None

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError("min_tokens must be in [0, max_tokens]")
        if not (-2 <= self.presence_penalty <= 2 and -2 <= self.frequency_penalty <= 2):
            raise ValueError("presence_penalty and frequency_penalty must be in [-2, 2]")
        if not 0 < self.repetition_penalty < float("inf"):
            raise ValueError("repetition_penalty must be > 0")
        if any(n is not None and n < 0 for n in (self.logprobs, self.prompt_logprobs)):
            raise ValueError("logprobs and prompt_logprobs must be >= 0")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ValueError("allowed_token_ids must not be empty")

    def sampler_only(self) -> list[str]:
        """The parameters set that only vLLM's sampler applies (the torch verifier refuses them)."""
        return [name for name, off in SAMPLER_ONLY.items() if getattr(self, name) != off]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self) -> torch.Generator:
        g = torch.Generator()
        g.manual_seed(self.seed if self.seed is not None else torch.seed())
        return g


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution the request samples from: softmax(logits / T) restricted by top-k and top-p.

    Works on [..., vocab]; returns float32 probabilities (for greedy, a one-hot on the argmax).
    """
    logits = logits.float()
    if params.greedy:
        return F_one_hot(logits.argmax(-1), logits.shape[-1])
    logits = logits / params.temperature
    if params.top_k:
        kth = logits.topk(min(params.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass strictly above each token
        sorted_p = sorted_p.masked_fill(before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def F_one_hot(idx: torch.Tensor, n: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(idx, n).float()
