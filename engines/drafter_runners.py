"""Which runner a drafter model runs on, and how many requests its KV cache budget holds.

The fast runner (`runner.LlamaRunner`: its own fused layers over one preallocated cache, CUDA graphs on a GPU)
for the architectures it is tested equal to transformers on, and only where `fast_runner_refusal` finds nothing
that would make it differ (a sliding window shorter than the context, say); transformers' own forward
(`transformers_runner.TransformersRunner`) for every other causal LM. Encoder-decoder models and models without a
causal LM head are refused: a drafter continues one token sequence from its next-token logits.
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoConfig, PreTrainedModel
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from engines.interface import DrafterRunner
from engines.runner import LlamaRunner, fast_runner_refusal, kv_bytes_per_token, resolve_max_len
from engines.transformers_runner import TransformersRunner

RUNNERS = ("auto", "fast", "transformers")
_CAUSAL_LM_CLASSES = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())


def refuse_unless_causal_lm(model_or_path) -> None:
    """ValueError, saying what and how to fix it, unless `model_or_path` (a model object, or the local directory of
    one) is a decoder-only causal LM that transformers loads with AutoModelForCausalLM."""
    if isinstance(model_or_path, (str, Path)):
        config = AutoConfig.from_pretrained(model_or_path)
        what = f"the model at {model_or_path} (model_type {config.model_type!r})"
        causal = config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    elif isinstance(model_or_path, PreTrainedModel):
        config = model_or_path.config
        what = f"{type(model_or_path).__name__} (model_type {config.model_type!r})"
        causal = any(c.__name__ in _CAUSAL_LM_CLASSES for c in type(model_or_path).__mro__)
    else:
        raise ValueError(f"a drafter model is a transformers causal LM or its directory, not a "
                         f"{type(model_or_path).__name__}: load it with AutoModelForCausalLM")
    if config.is_encoder_decoder:
        raise ValueError(f"{what} is an encoder-decoder model, and a drafter continues one token sequence from a "
                         f"decoder's next-token logits: use a decoder-only causal LM (one AutoModelForCausalLM "
                         f"loads: Llama, Qwen, Mistral, Gemma, Phi-3, GPT-NeoX, ...)")
    if not causal:
        raise ValueError(f"{what} is not a causal LM: a drafter needs the model's next-token logits, from its causal "
                         f"LM head; load it with AutoModelForCausalLM (e.g. LlamaForCausalLM, not the headless "
                         f"LlamaModel), or give its directory")


def make_drafter_runner(model, max_slots: int, max_len: int | None, runner: str = "auto",
                        kv_cache_bytes: int | None = None, graphs: bool | None = None) -> DrafterRunner:
    """The runner for a loaded drafter `model`, holding up to `max_slots` requests of up to `max_len` tokens.

    `runner`: "auto" (the fast runner where `fast_runner_refusal` has nothing against the model, e.g. a Llama,
    Mistral, Qwen2 or Qwen3; transformers' forward otherwise), "fast" (ValueError, naming the model_type and why,
    where it cannot) or "transformers". `kv_cache_bytes`: a budget for the requests' keys/values; the slots become
    min(max_slots, the requests it holds at max_len), and ValueError if it holds none (None: `max_slots`).
    `graphs`: the fast runner's steps at padded shapes, CUDA graphs on a GPU (`LlamaRunner`; None: on CUDA)."""
    refuse_unless_causal_lm(model)
    if runner not in RUNNERS:
        raise ValueError(f"runner {runner!r}: one of {', '.join(RUNNERS)}")
    refusal = fast_runner_refusal(model.config, max_len)
    if runner == "fast" and refusal:
        raise ValueError(refusal)
    fast = runner == "fast" or (runner == "auto" and refusal is None)
    if kv_cache_bytes is not None:
        max_slots = slots_within(model, max_slots, max_len, kv_cache_bytes, fast)
    return LlamaRunner(model, max_slots=max_slots, max_len=max_len, graphs=graphs) if fast else \
        TransformersRunner(model, max_slots=max_slots, max_len=max_len)


def slots_within(model, max_slots: int, max_len: int | None, kv_cache_bytes: int, fast: bool) -> int:
    """The requests (at most `max_slots`) whose keys/values at max_len fit `kv_cache_bytes`."""
    config = model.config.get_text_config(decoder=True)
    n = resolve_max_len(config, max_len)
    param = next(model.parameters())
    per_request = kv_bytes_per_token(config, param.dtype) * n
    scratch = 1 if fast and param.device.type == "cuda" else 0  # the CUDA graphs' padding slot (engines/graphs.py)
    fit = kv_cache_bytes // per_request - scratch
    if fit < 1:
        extra = " (and as much again for the CUDA graphs' scratch slot)" if scratch else ""
        raise ValueError(f"a KV cache budget of {kv_cache_bytes} bytes holds no request: one request at max_len {n} "
                         f"needs {per_request} bytes{extra} ({config.model_type}, {param.dtype}); lower max_len or "
                         f"raise the budget")
    return min(max_slots, fit)
