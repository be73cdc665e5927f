"""Builds the verifier engine named by the configuration, and checks at startup that its models serve together."""

from __future__ import annotations

import logging

from config import AppConfig, DrafterSpec
from model_family import compat
from model_family.sources import resolve_model

log = logging.getLogger(__name__)


def load_tokenizer(cfg: AppConfig):
    return compat.load_tokenizer(resolve_model(cfg.tokenizer, tokenizer_only=True))


def check_models(cfg: AppConfig, preloaded: set[str] = frozenset()) -> int:
    """Before any replica serves: every model of the configuration can be had (ids resolved on this node: its
    tokenizer and config files only) and every drafter, assistant and partner shares the target's vocabulary.
    Raises `ModelUnavailable` or `IncompatibleModels` with what is wrong and how to fix it. Returns the number of
    token ids drafters may propose (those the target's tokenizer and embedding both have). `preloaded`: drafters
    given as model objects (tests, benchmarks), whose `model` field names no model to check. Model-free drafters
    (n-gram, suffix) propose tokens of the context itself: nothing to check."""
    target_tok = load_tokenizer(cfg)
    drafters = [d for d in cfg.drafters if d.name not in preloaded and not d.model_free] \
        if cfg.speculation.mode != "off" else []
    others = [("collaboration partner", cfg.verifier.collaboration.partner)] if cfg.verifier.collaboration else []
    for d in drafters:
        others.append((f"drafter {d.name}", d.model))
        if d.assistant:
            others.append((f"assistant of drafter {d.name}", d.assistant))
    target = resolve_model(cfg.verifier.model, tokenizer_only=True)
    seen: dict[str, object] = {}
    for role, ref in others:
        if ref not in seen:
            seen[ref] = compat.load_tokenizer(resolve_model(ref, tokenizer_only=True))
        for warning in compat.check_vocabulary(role, ref, seen[ref], target_tok, cfg.tokenizer):
            log.warning(warning)
    for d in drafters:
        check_drafter_memory(d)
    return compat.shared_vocab_size(target_tok, target)


def check_drafter_memory(d: DrafterSpec) -> None:
    """A drafter replica's KV budget must hold one request at its max_len (`kv_cache_gib`); a max_len past the
    model's positions is capped, and said."""
    import torch
    from transformers import AutoConfig

    from engines.runner import kv_bytes_per_token, resolve_max_len
    from engines.verifier import resolve_dtype

    config = AutoConfig.from_pretrained(resolve_model(d.model, tokenizer_only=True)).get_text_config(decoder=True)
    n = resolve_max_len(config, d.max_len)
    if n < d.max_len:
        log.warning(f"drafter {d.name}: max_len {d.max_len} is past its model's {n} positions; contexts longer than "
                    f"{n} tokens get no drafts from it")
    gpu = d.device == "cuda" or (d.device == "auto" and (d.deployment.ray_actor_options.get("num_gpus") or 0) > 0)
    # as the replica will resolve it (bf16 and fp16 take the same room), without a GPU on this node
    dtype = torch.bfloat16 if gpu and d.dtype == "auto" else resolve_dtype(d.dtype, "cpu")
    per_request = kv_bytes_per_token(config, dtype) * n
    budget = d.kv_cache_gib * 2**30
    if per_request > budget:
        raise compat.IncompatibleModels(
            f"drafter {d.name}: one request at max_len {n} needs {per_request / 2**30:.3f} GiB of KV cache "
            f"({d.model!r} in {dtype}), more than its kv_cache_gib {d.kv_cache_gib}: lower max_len or raise "
            f"kv_cache_gib")


def build_verifier_engine(cfg: AppConfig, stat_loggers: list | None = None):
    """The configured verifier engine; `stat_loggers`: more vLLM stat logger factories (vLLM engine only)."""
    v = cfg.verifier
    tokenizer = load_tokenizer(cfg)
    if v.engine == "torch" and v.collaboration is not None:
        from engines.collaborative import Combination, CollaborativeEngine

        c = v.collaboration
        return CollaborativeEngine(str(resolve_model(v.model)), str(resolve_model(c.partner)),
                                   Combination(c.combine, c.weight, c.mu), k=c.k, alternate=c.alternate,
                                   max_batch=v.max_batch, max_len=v.max_len, tokenizer=tokenizer, device=v.device)
    if v.engine == "torch":
        from engines.verifier import TorchVerifierEngine

        path = resolve_model(v.model)
        return TorchVerifierEngine(str(path), max_batch=v.max_batch, max_len=v.max_len, tokenizer=tokenizer,
                                   eos_token_ids=compat.eos_token_ids(path, tokenizer), device=v.device,
                                   dtype=v.dtype)
    from engines.vllm_engine import VllmVerifierEngine

    k = cfg.speculation.k if cfg.speculation.mode != "off" else 0
    path = resolve_model(v.model)
    return VllmVerifierEngine(str(path), max_batch=v.max_batch, max_len=v.max_len, k=k, dtype=v.dtype,
                              tokenizer=tokenizer, eos_token_ids=compat.eos_token_ids(path, tokenizer),
                              tensor_parallel_size=v.tensor_parallel_size, kv_cache_gib=v.kv_cache_gib,
                              seed=v.seed, stat_loggers=stat_loggers, **v.engine_kwargs)


def target_input_embeddings(cfg: AppConfig):
    """The target's input-embedding matrix (H in CoSine's Eq. 1), read from its safetensors without the model."""
    import glob

    from safetensors import safe_open

    path = resolve_model(cfg.verifier.model)
    for f in sorted(glob.glob(str(path / "*.safetensors"))):
        with safe_open(f, framework="pt") as st:
            if "model.embed_tokens.weight" in st.keys():
                return st.get_tensor("model.embed_tokens.weight").float()
    return None


def cpu_threads(threads: int | None, actor_cpus: float | None) -> int:
    """Torch threads for a replica: the configured number, else its reserved CPUs, else every core."""
    import os

    if threads:
        return threads
    if actor_cpus and actor_cpus >= 1:
        return int(actor_cpus)
    return os.cpu_count() or 1


def set_thread_torch_threads(n: int) -> None:
    """OpenMP threads for torch ops issued from the calling thread. OpenMP counts are per calling thread: a worker
    thread does not inherit what the main thread set, and a small drafter step on a thread that fans out over every
    core cost 2.3x what it costs on one (measured: 14.9 vs 6.6 ms per 4-token round on two cores). Calls torch's C
    function: vLLM's CPU worker replaces `torch.set_num_threads` with a no-op once it has bound its own threads."""
    import torch

    torch._C.set_num_threads(n)


def in_passing_thread(build, *args):
    """`build(*args)` on a thread that ends with it (its torch threads those of the calling thread): the OpenMP
    workers its torch ops start end with it. libgomp keeps a pool of workers per thread that ran a parallel region,
    and while a process's pools hold more threads than it has cores, every pool spins ~100 iterations (not ~300,000)
    before its workers sleep: a pool left behind by loading the drafters made each of the target's parallel regions
    wake a sleeping worker (measured on the 2-core CPU: 0.955x vLLM's step at batch 8 under light background load,
    against 1.04x without the drafters, at four-fifths of the CPU time). Startup work only: the thread is new."""
    import threading

    import torch

    threads, out = torch.get_num_threads(), {}

    def run():
        set_thread_torch_threads(threads)
        try:
            out["value"] = build(*args)
        except BaseException as e:  # noqa: BLE001 - re-raised on the calling thread
            out["error"] = e

    t = threading.Thread(target=run, name="startup")
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]
