"""Greedy generation with vLLM (CPU build), run in its own process: vLLM pins the process's torch threads.

Reads {"model": dir, "prompts": [[ids]], "max_tokens": n} as JSON on stdin, prints {"outputs": [[ids]]}.
"""

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

if __name__ == "__main__":
    req = json.load(sys.stdin)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=req["model"], dtype="float32", max_model_len=512, seed=0, enforce_eager=True)
    params = SamplingParams(max_tokens=req["max_tokens"], temperature=0.0, detokenize=False, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in req["prompts"]], params, use_tqdm=False)
    print("VLLM_RESULT " + json.dumps({"outputs": [list(o.outputs[0].token_ids) for o in outs]}), flush=True)
