"""A/B of the confidence cut in one process: runs alternating with the cut on and off (throwaway, not a command)."""
import asyncio, time, sys, yaml, statistics
from pathlib import Path
from config import AppConfig
from engines.sampling import SamplingParams
from assembly.loop import build_loop
from benchmarks.common import heldout_prompts
from transformers import AutoTokenizer
from model_family.paths import model_path
cfgp = sys.argv[1]; K = int(sys.argv[2]); C = int(sys.argv[3]); T = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
args = yaml.safe_load(Path(cfgp).read_text())["applications"][0]["args"]
args["verifier"].update(engine="vllm", max_batch=8, kv_cache_gib=1)
args["speculation"]["k"] = K
loop = build_loop(AppConfig.model_validate(args))
tok = AutoTokenizer.from_pretrained(model_path("tokenizer"))
prompts = [p for _, p in heldout_prompts(tok, 2, 64)]
cutter = loop.planner.cutter
async def go():
    sem = asyncio.Semaphore(C)
    async def one(i, p):
        async with sem:
            ids = []
            sp = SamplingParams(max_tokens=128, ignore_eos=True, temperature=T, top_p=0.95 if T else 1.0, seed=i if T else None)
            async for ch in loop.generate(p, sp):
                ids += ch.token_ids
            return ids
    t = time.perf_counter(); outs = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return sum(map(len, outs)) / (time.perf_counter() - t), outs
aio = asyncio.new_event_loop()
res = {"on": [], "off": []}; ref = None
aio.run_until_complete(go())
for rep in range(int(sys.argv[5]) if len(sys.argv) > 5 else 3):
    for name in (("on", "off") if rep % 2 == 0 else ("off", "on")):
        loop.planner.cutter = cutter if name == "on" else None
        s0 = dict(loop.stats.totals)
        tps, outs = aio.run_until_complete(go())
        if T == 0:
            ref = ref or outs
            assert outs == ref, "greedy outputs differ"
        res[name].append(tps)
        print(name, "%.1f" % tps, flush=True)
for n, v in res.items(): print(n, "median %.1f" % statistics.median(v), v)
print("ratio on/off", statistics.median(res["on"]) / statistics.median(res["off"]))
print(cutter.state())  # the A/B of the commit message: python -m benchmarks.confidence_cut_ab CONFIG K CONCURRENCY T REPEATS
