"""The project's own ("torch") verifier engine: continuous batching and lossless verification.

Requests join with `add_request` and leave when finished or aborted, between steps. Each `step` advances every
running request by one target forward pass: the request's last committed token (not yet in the KV cache) is fed
together with its draft, if any, so the logits at the root give the next-token distribution and the logits at each
draft node give the distribution after it. The verification rule picks the accepted path and one more token from
the target; the KV cache keeps the root and the accepted nodes, and drops everything else. Requests without a draft
decode exactly one token in the same forward pass.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from engines.draft_tree import Draft
from engines.graphs import VERIFIER
from engines.interface import EngineRequest, StepOutput, check_prompt
from engines.rules import verify_greedy, verify_sampling
from engines.runner import LlamaRunner, prefill, tree_depths
from engines.sampling import SamplingParams, target_probs
from engines.stopping import StopChecker


@dataclass
class _Request(EngineRequest):
    rid: str = ""
    params: SamplingParams | None = None
    gen: torch.Generator | None = None
    last_token: int = -1  # committed, not yet in the KV cache


def resolve_device(device: str = "auto") -> str:
    """"auto": the GPU Ray assigned to this replica (CUDA_VISIBLE_DEVICES), else the CPU."""
    return ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    """"auto": bf16 on a GPU that has it (fp16 on one that does not), fp32 on a CPU (its bf16 matmuls are slower
    there and drafts would round differently from the CPU-tested path); else the named dtype."""
    if dtype != "auto":
        return DTYPES[dtype]
    if device.startswith("cuda"):
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def load_causal_lm(model_or_path, device: str | None = None, dtype: str = "auto"):
    """A model object as it is (on its own device unless `device` is given), or loaded from a local directory in
    `dtype` (`resolve_dtype`) on `device` (None: the CPU)."""
    if isinstance(model_or_path, (str, Path)):
        from transformers import AutoModelForCausalLM

        where = resolve_device(device or "cpu")
        model = AutoModelForCausalLM.from_pretrained(model_or_path, dtype=resolve_dtype(dtype, where))
    else:
        model = model_or_path
    return (model.to(resolve_device(device)) if device else model).eval()


class TorchVerifierEngine:
    partial_steps = True  # a step may advance part of the pool (the loop's pipeline halves)
    drafts_itself = False  # drafts come from the loop (CollaborativeEngine's partner drafts inside the engine)
    step_executor = None  # steps on any thread (the loop's verify thread)

    def __init__(self, model, max_batch: int = 16, max_len: int | None = 2048, tokenizer=None,
                 eos_token_ids: tuple[int, ...] | None = None, max_draft_tokens: int = 64, device: str | None = None,
                 trees: bool = True, dtype: str = "auto", graphs: bool | None = None):
        """`graphs`: chain steps at bucketed shapes, CUDA graphs on a GPU (None: on CUDA; `LlamaRunner`)."""
        self.model = load_causal_lm(model, device, dtype)
        self.runner = LlamaRunner(self.model, max_slots=max_batch, max_len=max_len, graphs=graphs, role=VERIFIER)
        if self.runner.graphs is not None:  # every bucket captured now, none while serving: verify steps (every
            # position's logits) and prefills of up to GRAPH_MAX_NEW tokens (the last one's)
            for hidden_only_last in (False, True):
                self.runner.graphs.capture(hidden_only_last)
        self.device = self.runner.device.type
        self.tokenizer = tokenizer
        eos = eos_token_ids if eos_token_ids is not None else self.model.generation_config.eos_token_id
        self.eos_token_ids = tuple(eos if isinstance(eos, (list, tuple)) else ([eos] if eos is not None else []))
        self.max_batch = max_batch
        self.max_len = self.runner.max_len
        self.max_draft_tokens = max_draft_tokens
        self.verifies_trees = trees  # false: a tree is verified as its best chain (what the vLLM engine does)
        self.waiting: OrderedDict[str, _Request] = OrderedDict()
        self.running: OrderedDict[str, _Request] = OrderedDict()
        self.forward_passes = 0
        self.prefill_passes = 0  # of which prompts' prefills
        self.last_step_tokens = 0  # tokens fed in the last step's verify forward (for latency models)
        self.last_verify_seconds = 0.0
        self._finished_stats: dict[str, dict] = {}
        self._ids = itertools.count()

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None) -> str:
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self.waiting or rid in self.running:
            raise KeyError(f"request {rid!r} already exists")
        check_prompt(prompt_ids, self.max_len)
        if unsupported := params.sampler_only():
            raise ValueError(f"the torch verifier does not apply {', '.join(unsupported)} (vLLM's sampler does: "
                             f"verifier.engine: vllm)")
        stop = StopChecker(params, self.eos_token_ids, self.tokenizer)
        self.waiting[rid] = _Request(rid=rid, prompt=list(prompt_ids), params=params, stop=stop,
                                     gen=params.generator(), last_token=prompt_ids[-1])
        return rid

    def abort(self, rid: str) -> None:
        self.waiting.pop(rid, None)
        if self.running.pop(rid, None) is not None:
            self.runner.release(rid)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def draftable(self) -> list[str]:
        """The requests the next step decodes (admitted ones)."""
        return list(self.running)

    def context(self, rid: str) -> list[int]:
        r = self.running.get(rid) or self.waiting[rid]
        return r.prompt + r.generated

    def admit(self) -> None:
        self._admit()

    def chain_of(self, draft: Draft) -> Draft:
        """What `step` verifies of a draft: all of it, or its best chain where trees are off."""
        return draft if self.verifies_trees else draft.best_chain()

    def _admit(self) -> None:
        """Move waiting requests into free slots and prefill their prompts (all but the last token)."""
        joining = {}
        while self.waiting and len(self.running) < self.max_batch:
            rid, req = self.waiting.popitem(last=False)
            self.runner.add(rid)
            self.running[rid] = req
            if len(req.prompt) > 1:
                joining[rid] = req.prompt[:-1]
        passes = prefill(self.runner, joining)
        self.forward_passes += passes
        self.prefill_passes += passes

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self, drafts: dict[str, Draft | None] | None = None, only: set[str] | None = None) -> list[StepOutput]:
        """Advance every running request (or those in `only`: pipelined callers step half the pool at a time)."""
        drafts = drafts or {}
        self._admit()
        if not self.running:
            return []
        rids, inputs, parents, used = [], [], [], {}
        for rid, req in self.running.items():
            if only is not None and rid not in only:
                continue
            draft = drafts.get(rid)
            if draft is not None and not self.verifies_trees:
                draft = draft.best_chain()
            room = min(self.max_draft_tokens, self.max_len - self.runner.length(rid) - 1,
                       req.params.max_tokens - len(req.generated) - 1)
            if draft is not None and len(draft) > room:
                draft = draft.truncated(max(0, room))
            if draft is not None and len(draft) == 0:
                draft = None
            used[rid] = draft
            rids.append(rid)
            inputs.append([req.last_token] + (draft.tokens if draft else []))
            parents.append([-1] + ([p + 1 for p in draft.parents] if draft else []))
        if not rids:
            return []
        t = time.perf_counter()
        logits = self.runner.forward(rids, inputs, parents)
        self.forward_passes += 1
        self.last_step_tokens = sum(len(x) for x in inputs)
        self.last_verify_seconds = time.perf_counter() - t

        outputs = []
        for rid, x, row in zip(rids, inputs, logits):
            req, draft = self.running[rid], used[rid]
            # node j of the draft is row j + 1; the root (last committed token) is row 0.
            if req.params.greedy:
                path, extra = verify_greedy(draft, lambda j: int(row[j + 1].argmax()))
            else:
                cache: dict[int, torch.Tensor] = {}

                def probs_at(j, row=row, params=req.params, cache=cache):
                    if j not in cache:
                        cache[j] = target_probs(row[j + 1], params)
                    return cache[j]

                path, extra = verify_sampling(draft, probs_at, req.gen)
            keep = [0] + [j + 1 for j in path]  # the root and the accepted nodes join the KV cache
            self.runner.commit(rid, x, keep)
            committed = [draft.tokens[j] for j in path] + [extra] if draft else [extra]
            req.last_token = extra
            outputs.append(self._emit(rid, committed, len(draft) if draft else 0, len(path),
                                      [draft.drafters[j] if draft and draft.drafters else None for j in path],
                                      max(tree_depths(draft.parents)) + 1 if draft else 0))
        return outputs

    def _emit(self, rid: str, committed: list[int], drafted: int, accepted: int, drafters: list[str | None],
              depth: int, out_of_room: bool = False) -> StepOutput:
        """A request's step result: its committed tokens through the stop checks, its counters, and its end
        (`out_of_room`: it cannot go on, and ends for its length if nothing else ended it)."""
        req = self.running[rid]
        emitted = req.stop.feed(committed)
        req.generated.extend(emitted)
        req.verified(drafted, accepted, drafters)
        finished = req.stop.finished
        reason = req.stop.finish_reason
        if not finished and (out_of_room or self.runner.length(rid) + 1 >= self.max_len):
            finished, reason = True, "length"
        out = StepOutput(rid, emitted, drafted, accepted, drafters, finished, reason,
                         req.stop.text if req.params.stop else None, depth)
        if finished:
            req.stop.finish_reason = reason
            self._retire(rid)
            self._finished_stats[rid] = req.stats()
        return out

    def _retire(self, rid: str) -> None:
        """Free a finished request's resources."""
        self.running.pop(rid)
        self.runner.release(rid)

    def finished_stats(self, rid: str) -> dict | None:
        """Speculation statistics of a finished request (returned once)."""
        return self._finished_stats.pop(rid, None)
