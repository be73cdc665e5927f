"""Greedy generation with vLLM (CPU build), run in its own process: vLLM pins the process's torch threads.

Reads {"model": dir, "prompts": [[ids]], "max_tokens": n} as JSON on stdin, prints {"outputs": [[ids]]} (`run`
calls it so from a test). Optional
"params": more vLLM SamplingParams over the defaults (greedy, ignore_eos), one dict for every prompt or a list of one
per prompt; where they ask for `logprobs`, the result has "logprobs" too: per prompt, per token, [[id, logprob], ...]
in vLLM's order (the token's own first, then the top ones); where they ask for `prompt_logprobs`, "prompt_logprobs"
the same of each prompt token (None for the first). A param's "structured_outputs" are vLLM's
StructuredOutputsParams as keyword arguments; "structured_outputs_config" (optional) the engine's.
"""

import json
import os
import subprocess
import sys

RESULT = "VLLM_RESULT "


def run(req: dict) -> dict:
    """This script on `req` in a process of its own; its result (AssertionError with the end of its log if none)."""
    proc = subprocess.run([sys.executable, __file__], input=json.dumps(req), capture_output=True, text=True,
                          timeout=600, check=False)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT)), None)
    assert line is not None, proc.stderr[-3000:]
    return json.loads(line.removeprefix(RESULT))


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    req = json.load(sys.stdin)
    from vllm import LLM, SamplingParams
    from vllm.config import StructuredOutputsConfig
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import StructuredOutputsParams

    llm = LLM(model=req["model"], dtype="float32", max_model_len=512, seed=0, enforce_eager=True,
              structured_outputs_config=StructuredOutputsConfig(**req.get("structured_outputs_config", {})))
    extra = req.get("params", {})
    per_prompt = extra if isinstance(extra, list) else [extra] * len(req["prompts"])
    defaults = {"max_tokens": req["max_tokens"], "temperature": 0.0, "detokenize": False, "ignore_eos": True}
    params = [SamplingParams(**{**defaults, **p, **({"structured_outputs": StructuredOutputsParams(
        **p["structured_outputs"])} if "structured_outputs" in p else {})}) for p in per_prompt]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in req["prompts"]], params, use_tqdm=False)
    result = {"outputs": [list(o.outputs[0].token_ids) for o in outs]}
    if any(p.get("logprobs") is not None for p in per_prompt):
        result["logprobs"] = [None if o.outputs[0].logprobs is None else
                              [[[t, lp.logprob] for t, lp in d.items()] for d in o.outputs[0].logprobs] for o in outs]
    if any(p.get("prompt_logprobs") is not None for p in per_prompt):
        result["prompt_logprobs"] = [None if o.prompt_logprobs is None else
                                     [None if d is None else [[t, lp.logprob] for t, lp in d.items()]
                                      for d in o.prompt_logprobs] for o in outs]
    print(RESULT + json.dumps(result), flush=True)
