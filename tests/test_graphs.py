"""What a GPU run's device work rests on, checked on the CPU: CUDA graphs' bookkeeping and the lock (engines/graphs.py)
and the overlap of colocated drafting with verification (`speculation.colocated_overlap`). What a GPU would capture
at startup covers every shape a round meets; a runner whose cache a drafter pool re-points drops the graphs that
addressed the old one; steps never wait for a capture; drafting overlaps verification where the verifier runs on a
GPU."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from assembly.loop import build_loop, generate_all
from config import AppConfig, SpeculationSpec
from engines.device_work import WORK, warmed_up
from engines.drafter import DrafterEngine
from engines.drafter_pool import DrafterPool
from engines.graphs import CAPTURE_LOCK, DRAFTERS, VERIFIER, cache_addresses, role_stream
from engines.runner import LlamaRunner
from engines.sampling import SamplingParams
from engines.verifier import TorchVerifierEngine
from model_family.distill import greedy_continue

NAMES = ("code", "generic")
MAX_LEN = 160


@pytest.fixture(scope="module")
def drafter_models(models):
    return {d: AutoModelForCausalLM.from_pretrained(models / f"drafter-{d}", dtype=torch.float32).eval()
            for d in NAMES}


def _engines(drafter_models, max_requests: int = 4) -> dict[str, DrafterEngine]:
    return {n: DrafterEngine(m, name=n, max_requests=max_requests, max_len=MAX_LEN, graphs=True)
            for n, m in drafter_models.items()}


def test_startup_captures_every_shape_a_round_meets(target, drafter_models, tokenizer, heldout):
    """The verifier and the pooled drafters at padded shapes (a GPU's CUDA graphs, their shapes recorded here), built
    as the service builds them: prompts of 5 to 40 tokens (prefills of 17 tokens or fewer go through the graphs)
    and a drafter of the pool scoring a short prompt alone (its own runner's graphs) capture nothing after startup;
    the output is the target's."""
    prompts = [tokenizer(heldout[d][4], add_special_tokens=False).input_ids[:n]
               for d, n in zip(("code", "legal", "literature", "code"), (5, 12, 17, 40))]
    verifier = TorchVerifierEngine(target, max_batch=2, max_len=MAX_LEN, graphs=True)
    engines = _engines(drafter_models)
    cfg = AppConfig(verifier={"model": "target", "max_batch": 2, "max_len": MAX_LEN},
                    drafters=[{"name": n, "model": n, "max_len": MAX_LEN, "max_requests": 4} for n in NAMES],
                    speculation={"mode": "cosine", "k": 3, "pool_drafters": "on", "draft_timeout_ms": 600_000,
                                 "guard": {"enabled": False}})
    loop = build_loop(cfg, verifier, engines)
    pool = loop.drafting.pools["code"].pool
    assert pool.padded and pool.graphs.graphs  # every bucket of the pooled step recorded at startup
    warmed_up()
    try:
        before = WORK.snapshot()
        res = asyncio.run(generate_all(loop, prompts, [SamplingParams(max_tokens=10, ignore_eos=True)] * 4))
        engines["code"].sync("alone", prompts[1][:6])  # one drafter scoring a prompt: its own step, its own runner
        pool.step({"code": ["alone"]}, want_loglik={"code"})
        work = WORK.since(before)
    finally:
        warmed_up(False)
    assert work.drafter_forwards > 0 and work.captures_after_warmup == 0
    for p, r in zip(prompts, res):
        assert r.token_ids == greedy_continue(target, torch.tensor([p]), 10)[0, len(p):].tolist()


def test_a_pool_re_pointing_a_cache_drops_its_graphs_and_a_later_pool_keeps_them(drafter_models, tokenizer, heldout):
    """A runner's graphs address its cache: the pool that moves it into its own drops them (they would replay into
    freed memory); a later pool over the same engines keeps the cache where it is, with the graphs and what the
    requests had cached; a pool of other members moves it again; a cache moved otherwise refuses to step."""
    ctx = tokenizer(heldout["code"][5], add_special_tokens=False).input_ids[:12]
    engines, alone = _engines(drafter_models), _engines(drafter_models)
    runners = [e.runner for e in engines.values()]
    for r in runners:
        r.graphs.capture(hidden_only_last=True)
    old = [r.graphs for r in runners]
    DrafterPool(list(engines.values()))
    assert all(r.graphs is not g and not r.graphs.graphs.graphs for r, g in zip(runners, old))
    assert all(r.graphs.cache == cache_addresses(r) for r in runners)

    for e in (engines, alone):
        for n in NAMES:
            e[n].sync("r", ctx)
            e[n].step(["r"])  # cached in the first pool's memory
    for r in runners:
        r.graphs.capture(hidden_only_last=True)
    kept = [(r.graphs, cache_addresses(r)) for r in runners]
    second = DrafterPool(list(engines.values()))
    assert [(r.graphs, cache_addresses(r)) for r in runners] == kept
    for e in (engines, alone):
        for n in NAMES:
            e[n].feed("r", [7])
    want = {n: alone[n].step(["r"])["r"] for n in NAMES}
    got = second.step({n: ["r"] for n in NAMES})
    assert all(got[n]["r"].token == want[n].token and got[n]["r"].top_tokens == want[n].top_tokens for n in NAMES)

    more = _engines(drafter_models)  # other members: the cache moves again
    DrafterPool([engines["code"], more["generic"]])
    assert cache_addresses(runners[0]) != kept[0][1] and runners[0].graphs is not kept[0][0]

    r = runners[1]
    r.k = r.k.clone()  # moved behind the graphs' back
    engines["generic"].feed("r", [9])
    with pytest.raises(RuntimeError, match="cache moved"):
        engines["generic"].step(["r"])


def test_steps_and_cache_moves_never_wait_for_a_capture(target):
    """Only a capture holds `CAPTURE_LOCK`: a runner's steps, commits and releases (and, on a CPU, its recorded
    captures) go on while another thread's capture holds it. Streams are a GPU's: none on a CPU, and none for a role
    that is neither the verifier's nor the drafters'."""
    cpu = torch.device("cpu")
    assert role_stream(cpu, VERIFIER) is None and role_stream(cpu, DRAFTERS) is None
    with pytest.raises(ValueError, match="role"):
        role_stream(cpu, "partner")
    runner = LlamaRunner(target, max_slots=2, max_len=64, graphs=True, role=VERIFIER)

    def work():
        for rid in ("a", "b"):
            runner.add(rid)
            runner.forward([rid], [[5, 6, 7]])
            runner.commit_all(rid, [5, 6, 7])
        runner.forward(["a", "b"], [[8, 9], [10]], [[-1, -1], [-1]])  # a tree on "a": two siblings
        runner.commit("a", [8, 9], [1])  # the second kept: moved next to the prefix
        runner.commit_all("b", [10])
        runner.release("a")  # "b" moves into slot 0
        runner.graphs.capture(hidden_only_last=False)

    with CAPTURE_LOCK:
        t = threading.Thread(target=work)
        t.start()
        t.join(timeout=120)
        assert not t.is_alive()
    assert runner.length("b") == 4 and runner.requests["b"].slot == 0


def test_colocated_drafting_overlaps_verification_where_the_verifier_runs_on_a_gpu(target, drafter_models):
    """`speculation.colocated_overlap`: auto overlaps on a GPU (the target's kernels while the drafters' host work
    runs), not on a CPU (the same cores); on and off as set. The loop built in process takes it from the config and
    the verifier's device; where drafting takes turns with verification on a CPU, the drafters step on the thread
    the verifier steps on (`step_on_verifier_thread`), else on threads of their own."""
    def spec(setting):
        return SpeculationSpec(colocated_overlap=setting)

    assert spec("auto").colocated_overlaps("cuda") and spec("auto").colocated_overlaps("cuda:1")
    assert not spec("auto").colocated_overlaps("cpu")
    assert spec("on").colocated_overlaps("cpu") and not spec("off").colocated_overlaps("cuda")
    verifier = TorchVerifierEngine(target, max_batch=2, max_len=MAX_LEN)
    engines = {n: DrafterEngine(m, name=n, max_requests=2, max_len=MAX_LEN) for n, m in drafter_models.items()}
    for setting, overlaps in (("auto", False), ("on", True), ("off", False)):
        cfg = AppConfig(verifier={"model": "target", "max_batch": 2, "max_len": MAX_LEN},
                        drafters=[{"name": n, "model": n, "max_len": MAX_LEN, "max_requests": 2} for n in NAMES],
                        speculation={"colocated_overlap": setting})
        loop = build_loop(cfg, verifier, engines)
        assert loop.drafting_overlaps_verification is overlaps
        threads = {n: s.executor for n, s in loop.drafting.servers.items()}
        if overlaps:
            assert loop.step_thread not in threads.values() and len(set(threads.values())) == len(NAMES), setting
        else:
            assert set(threads.values()) == {loop.step_thread}, setting
            ran = loop.step_thread.submit(threading.current_thread).result()
            assert ran.name.startswith("verify"), ran.name  # the loop's verify thread: the torch engine has none
