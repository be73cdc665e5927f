"""Builds the verifier engine named by the configuration."""

from __future__ import annotations

from config import AppConfig
from model_family.paths import model_path


def load_tokenizer(cfg: AppConfig):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_path(cfg.tokenizer)))


def build_verifier_engine(cfg: AppConfig, stat_loggers: list | None = None):
    """The configured verifier engine; `stat_loggers`: more vLLM stat logger factories (vLLM engine only)."""
    v = cfg.verifier
    tokenizer = load_tokenizer(cfg)
    if v.engine == "torch" and v.collaboration is not None:
        from engines.collaborative import Combination, CollaborativeEngine

        c = v.collaboration
        return CollaborativeEngine(str(model_path(v.model)), str(model_path(c.partner)),
                                   Combination(c.combine, c.weight, c.mu), k=c.k, alternate=c.alternate,
                                   max_batch=v.max_batch, max_len=v.max_len, tokenizer=tokenizer, device=v.device)
    if v.engine == "torch":
        from engines.verifier import TorchVerifierEngine

        return TorchVerifierEngine(str(model_path(v.model)), max_batch=v.max_batch, max_len=v.max_len,
                                   tokenizer=tokenizer, device=v.device)
    from engines.vllm_engine import VllmVerifierEngine

    k = cfg.speculation.k if cfg.speculation.mode != "off" else 0
    eos = tokenizer.eos_token_id
    return VllmVerifierEngine(str(model_path(v.model)), max_batch=v.max_batch, max_len=v.max_len, k=k,
                              tokenizer=tokenizer, eos_token_ids=() if eos is None else (eos,),
                              tensor_parallel_size=v.tensor_parallel_size, kv_cache_gib=v.kv_cache_gib,
                              seed=v.seed, stat_loggers=stat_loggers, **v.engine_kwargs)


def target_input_embeddings(cfg: AppConfig):
    """The target's input-embedding matrix (H in CoSine's Eq. 1), read from its safetensors without the model."""
    import glob

    from safetensors import safe_open

    path = model_path(cfg.verifier.model)
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
