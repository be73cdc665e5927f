"""The vLLM verifier engine: our drafts verified inside an unmodified vLLM engine.

Same interface as the torch engine (engines/verifier.py), so the verify loop drives either. vLLM keeps the
requests' KV cache across steps (paged, no prefix recomputation), batches them continuously and verifies each
step's drafts with its own forward pass and rejection sampler; engines/vllm_hooks.py writes the drafts in. vLLM
verifies chains: a fused tree is sent as its most confident chain. Stops (EOS, stop ids, stop strings) stay ours,
so both engines end requests the same way; a request we stop is aborted in vLLM, which frees its KV blocks. The
penalties, min_tokens, logprobs (the prompt's too), allowed_token_ids, bad_words and structured outputs are vLLM's
sampler's, which only this engine has.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

from engines import vllm_hooks
from engines.draft_tree import Draft
from engines.sampling import SamplingParams
from engines.stopping import StopChecker
from engines.interface import EngineRequest, StepOutput, check_prompt


class VllmVerifierEngine:
    partial_steps = False  # vLLM steps its whole batch at once: the loop does not verify halves of the pool
    drafts_itself = False

    def __init__(self, model: str, *, max_batch: int = 16, max_len: int = 2048, k: int = 4, tokenizer=None,
                 eos_token_ids: tuple[int, ...] = (), **engine_kwargs):
        # vLLM's CPU worker sizes its attention metadata by the OpenMP threads of the thread that built it, and its
        # kernels check that the thread running them has as many (a step on another thread fails): the engine is
        # built, stepped and shut down on one thread of its own.
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="vllm-engine")
        self._engine_thread = self._thread.submit(threading.current_thread).result()
        if tokenizer is not None:  # the target's tokenizer (config `tokenizer`), for vLLM's structured outputs
            engine_kwargs.setdefault("tokenizer", tokenizer.name_or_path)
        self.engine, self.scheduler, self.vllm_counters = self._thread.submit(
            vllm_hooks.build_engine, model, max_batch=max_batch, max_len=max_len, k=k, **engine_kwargs).result()
        self.device = vllm_hooks.platform_device()
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_batch = max_batch
        self.max_len = max_len
        self.max_draft_tokens = k
        self.requests: dict[str, EngineRequest] = {}
        self.forward_passes = 0
        self.last_step_tokens = 0
        self.last_verify_seconds = 0.0
        self._finished_stats: dict[str, dict] = {}

    @property
    def running(self) -> dict[str, EngineRequest]:
        """Every request in the engine: vLLM admits and prefills them itself, within a step."""
        return self.requests

    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str) -> str:
        from vllm.exceptions import VLLMClientError
        from vllm.inputs import TokensPrompt

        if request_id in self.requests:
            raise KeyError(f"request {request_id!r} already exists")
        check_prompt(prompt_ids, self.max_len)
        stop = StopChecker(params, self.eos_token_ids, self.tokenizer)
        try:
            self.engine.add_request(request_id, TokensPrompt(prompt_token_ids=list(prompt_ids)),
                                    vllm_hooks.sampling_params(params, request_id, self.eos_token_ids))
        except VLLMClientError as e:  # vLLM's validation of the request (a grammar it cannot compile): the client's
            raise ValueError(str(e)) from None
        self.requests[request_id] = EngineRequest(prompt=list(prompt_ids), stop=stop)
        return request_id

    def abort(self, rid: str) -> None:
        if self.requests.pop(rid, None) is not None:
            self.engine.abort_request([rid])

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def draftable(self) -> list[str]:
        """The requests the next step decodes: vLLM runs at most max_batch of them and queues the rest, and a
        draft for a queued request (or one still prefilling) is never verified. Drafting every request here put
        ~27 contexts in each round at 2 requests/s, and the controller priced a batch that vLLM does not run."""
        ids = (vllm_hooks.our_id(r) for r in list(self.scheduler.running)
               if r.num_computed_tokens == r.num_tokens - 1)
        return [i for i in ids if i in self.requests]

    def context(self, rid: str) -> list[int]:
        r = self.requests[rid]
        return r.prompt + r.generated

    def admit(self) -> None:
        """vLLM admits waiting requests inside its own step."""

    @property
    def step_executor(self) -> ThreadPoolExecutor:
        """The engine's own thread: the loop submits `step` there directly (no hop through a thread of its own)."""
        return self._thread

    def step(self, drafts: dict[str, Draft | None] | None = None, only: set[str] | None = None) -> list[StepOutput]:
        """One vLLM engine step over the whole batch (`only` is ignored: see `partial_steps`); from any thread but
        the engine's own, it waits for that thread to run it."""
        if threading.current_thread() is self._engine_thread:
            return self._step(drafts or {})
        return self._thread.submit(self._step, drafts or {}).result()

    def shutdown(self) -> None:
        self._thread.submit(self.engine.engine_core.shutdown).result()
        self._thread.shutdown()

    def chain_of(self, draft: Draft) -> Draft:
        """What this engine verifies of a draft: its best chain, at most k long."""
        return draft.best_chain().truncated(self.max_draft_tokens)

    def _step(self, drafts: dict[str, Draft | None]) -> list[StepOutput]:
        chains = {rid: self.chain_of(d) for rid, d in drafts.items()
                  if d is not None and len(d) and rid in self.requests}
        # the scheduler hook clears vLLM's own placeholder drafts of the requests without one of ours
        self.scheduler.external_drafts = {
            rid: vllm_hooks.ExternalDraft(len(self.requests[rid].prompt) + len(self.requests[rid].generated), c.tokens)
            for rid, c in chains.items()}
        t = time.perf_counter()
        outs = self.engine.step()
        self.last_verify_seconds = time.perf_counter() - t
        self.last_step_tokens = self.scheduler.last_scheduled_tokens
        self.forward_passes += 1
        verified = self.scheduler.take_verified()
        results = []
        for o in outs:
            req = self.requests.get(o.request_id)
            if req is None:
                continue
            completion = o.outputs[0]
            emitted = req.stop.feed(list(completion.token_ids))
            req.generated.extend(emitted)
            drafted, accepted = verified.get(o.request_id, (0, 0))
            chain = chains.get(o.request_id)
            by = list((chain.drafters or [None] * len(chain))[:accepted]) if drafted else []
            req.verified(drafted, accepted, by)
            finished = req.stop.finished or o.finished
            reason = req.stop.finish_reason or completion.finish_reason
            # vLLM's logprobs of the target's raw distribution (its default logprobs_mode), the emitted ones
            logprobs = None if completion.logprobs is None else [
                {t: lp.logprob for t, lp in d.items()} for d in completion.logprobs[:len(emitted)]]
            # the whole prompt's at once, with the first output (vLLM's DELTA outputs; empty afterwards)
            prompt_logprobs = [None if d is None else {t: (lp.logprob, lp.rank) for t, lp in d.items()}
                               for d in o.prompt_logprobs] if o.prompt_logprobs else None
            results.append(StepOutput(o.request_id, emitted, drafted, accepted, by, finished, reason,
                                      req.stop.text if req.stop.params.stop else None, drafted, logprobs,
                                      prompt_logprobs))
            if finished:
                self.requests.pop(o.request_id)
                if not o.finished:  # stopped by us (EOS, a stop id or string): vLLM would go on
                    self.engine.abort_request([o.request_id])
                self._finished_stats[o.request_id] = req.stats()
        return results

    def finished_stats(self, rid: str) -> dict | None:
        return self._finished_stats.pop(rid, None)
