"""The engines keep the promise: speculative output is exactly the target's, whatever the batch or draft.

Speculative runs go through `VerifyLoop`, the loop the service runs, with the drafters in this process.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import asyncio
import random

from config import AppConfig
from engines.build import set_thread_torch_threads
from engines.interface import VerifierEngine
from engines.runner import LlamaRunner
from engines.sampling import SamplingParams
from engines.verifier import TorchVerifierEngine
from assembly.loop import build_loop, generate_all
from speculation.messages import SpeculationOverrides
from model_family import DOMAINS
from model_family.distill import greedy_continue
from tests.helpers.distribution import assert_first_two_tokens_follow_the_target

NEW_TOKENS = 24


@pytest.fixture(scope="module")
def drafter_models(models):
    return {d: AutoModelForCausalLM.from_pretrained(models / f"drafter-{d}", dtype=torch.float32).eval()
            for d in ("code", "literature", "generic")}


@pytest.fixture(scope="module")
def mixed_prompts(tokenizer, heldout) -> list[list[int]]:
    """Three prompts per domain with mixed lengths (8 to 120 tokens)."""
    lengths = [8, 47, 120]
    out = []
    for d in DOMAINS:
        for i, n in enumerate(lengths):
            out.append(tokenizer(heldout[d][i + 3], add_special_tokens=False).input_ids[:n])
    return out


@pytest.fixture(scope="module")
def reference(target, mixed_prompts) -> list[list[int]]:
    """Target-only greedy decoding, one prompt at a time with transformers."""
    return [greedy_continue(target, torch.tensor([p]), NEW_TOKENS)[0, len(p):].tolist() for p in mixed_prompts]


def _run(target, drafters, prompts, k, batch, tree_budget=None, params=None, max_len=512, trees=True, mode="cosine",
         pipelined=False):
    """Every prompt through the loop, each drafted by all `drafters` (one-shot fusion of their chains when several,
    or their majority vote in mode vote). `params`: one SamplingParams for all, or one per prompt. `pipelined`: as
    if the drafters had hardware of their own (the loop then verifies the pool's halves in turn)."""
    names = [f"d{i}" for i in range(len(drafters))]
    cfg = AppConfig(verifier={"model": "target", "max_batch": batch, "max_len": max_len},
                    drafters=[{"name": n, "model": n, "max_len": max_len} for n in names],
                    speculation={"mode": mode, "k": k, "adaptive": False, "guard": {"enabled": False},
                                 "tree_budget": tree_budget or k * len(drafters), "draft_timeout_ms": 600_000},
                    routing={"drafters_per_request": len(drafters)})
    verifier = TorchVerifierEngine(target, max_batch=batch, max_len=max_len, trees=trees)
    loop = build_loop(cfg, verifier, dict(zip(names, drafters)))
    loop.drafting_overlaps_verification = pipelined
    params = params or SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    plist = params if isinstance(params, list) else [params] * len(prompts)
    overrides = [SpeculationOverrides(drafters=names, lockstep=False)] * len(prompts)
    out = asyncio.run(generate_all(loop, prompts, plist, overrides))
    for s in loop.drafting.servers.values():  # releases run on each drafter's thread: wait for them
        s.executor.submit(lambda: None).result()
    assert not any(s.engine.states for s in loop.drafting.servers.values())  # every drafter cache released
    return out, verifier


def _accepted_share(out) -> float:
    """Accepted draft tokens per generated token: 0 when speculation is silently off or every draft is rejected."""
    return sum(o.stats["num_accepted_tokens"] for o in out) / sum(len(o.token_ids) for o in out)


@pytest.mark.parametrize("k", range(1, 9))
def test_greedy_chain_equals_target_for_every_draft_length(target, drafter_models, mixed_prompts, reference, k):
    prompts = mixed_prompts[::4]  # five prompts of five domains, every length, batch of four with joins and leaves
    out, _ = _run(target, [drafter_models["generic"]], prompts, k, batch=4)
    assert [o.token_ids for o in out] == reference[::4]
    assert _accepted_share(out) > 0.2 * k / (k + 1)  # the generic drafter's acceptance is ~0.6-0.8 per token


@pytest.mark.parametrize("batch", [1, 4, 16])
@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_greedy_equals_target_for_every_batch_size(target, drafter_models, mixed_prompts, reference, batch, shape):
    drafters = [drafter_models["code"]] + ([drafter_models["literature"]] if shape == "tree" else [])
    prompts = mixed_prompts if batch > 1 else mixed_prompts[:6]
    out, verifier = _run(target, drafters, prompts, k=4, batch=batch)
    assert [o.token_ids for o in out] == reference[:len(prompts)]
    assert all(o.finish_reason == "length" for o in out)
    assert _accepted_share(out) > 0.2
    assert verifier.runner.requests == {}  # every KV cache slot released
    assert isinstance(verifier, VerifierEngine)  # the loop's written contract (engines/interface.py)


@pytest.mark.parametrize("k,budget", [(1, 2), (3, 6), (8, 12)])
def test_greedy_tree_equals_target_for_draft_lengths(target, drafter_models, mixed_prompts, reference, k, budget):
    drafters = [drafter_models["generic"], drafter_models["code"], drafter_models["literature"]]
    out, _ = _run(target, drafters, mixed_prompts[1::3], k=k, batch=4, tree_budget=budget)
    assert [o.token_ids for o in out] == reference[1::3]
    assert _accepted_share(out) > 0.2 * k / (k + 1)  # fused trees are accepted, not only verified
    assert any(o.stats["num_draft_tokens"] > k * o.stats["num_drafts"] for o in out)  # and were trees (> k nodes)


def test_greedy_best_chain_of_each_tree_equals_target(target, drafter_models, mixed_prompts, reference):
    """Trees verified as their best chain (what the vLLM engine verifies), in the torch engine."""
    drafters = [drafter_models["generic"], drafter_models["code"], drafter_models["literature"]]
    out, _ = _run(target, drafters, mixed_prompts[1::3], k=4, batch=4, tree_budget=8, trees=False)
    assert [o.token_ids for o in out] == reference[1::3]
    assert all(o.stats["num_draft_tokens"] <= 4 * o.stats["num_drafts"] for o in out)  # chains of at most k
    assert _accepted_share(out) > 0.2


def _record_steps(monkeypatch, record) -> None:
    """Every verify step of the torch engine first calls `record(engine, the step's members)`."""
    step = TorchVerifierEngine.step

    def recording(self, drafts, members=None):
        record(self, members)
        return step(self, drafts, members)

    monkeypatch.setattr(TorchVerifierEngine, "step", recording)


def test_pipeline_halves_take_turns_and_stay_lossless(target, drafter_models, mixed_prompts, reference, monkeypatch):
    """CoSine's pipeline (speculation/stepping.py, which the simulator runs too): with drafting on hardware of its
    own, each step verifies one half of the pool (requests join the halves in turn) while the other half's next
    round is drafted; the output is still the target's, and the drafts are accepted."""
    steps: list[tuple[set[str], set[str]]] = []  # (the step's members, the running pool)
    _record_steps(monkeypatch, lambda engine, members: steps.append((set(members), set(engine.running))))
    out, _ = _run(target, [drafter_models["generic"]], mixed_prompts[:8], k=4, batch=8, pipelined=True)
    assert [o.token_ids for o in out] == reference[:8]
    assert _accepted_share(out) > 0.2
    halves = [{int(r.split("-")[1]) % 2 for r in members} for members, _ in steps]
    assert all(len(h) == 1 for h in halves) and {0, 1} <= set().union(*halves)  # one half per step, both verified
    assert sum(members < running for members, running in steps) > len(steps) // 2  # halves, not the whole pool


def test_verify_steps_keep_the_loops_torch_threads_beside_in_process_drafters(target, drafter_models, mixed_prompts,
                                                                              monkeypatch):
    """In-process drafters step on threads set to their own torch thread count (1), and a thread started after that
    starts with it: the loop's verify steps must still run with the count of the thread that built the loop (they
    ran on one core of two, at half speed, in every in-process run before this was pinned). Built with two threads
    (the suite's processes run one: tests/conftest.py), a count neither the drafters' nor a new thread's default."""
    before = torch.get_num_threads()
    set_thread_torch_threads(2)  # torch's C setter: an in-process vLLM engine makes `torch.set_num_threads` a no-op
    try:
        seen: list[int] = []
        _record_steps(monkeypatch, lambda engine, members: seen.append(torch.get_num_threads()))
        _run(target, [drafter_models["generic"]], mixed_prompts[:4], k=4, batch=4)
    finally:
        set_thread_torch_threads(before)
    assert seen and set(seen) == {2}


@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_majority_vote_equals_target(target, drafter_models, mixed_prompts, reference, batch):
    out, _ = _run(target, list(drafter_models.values()), mixed_prompts, k=4, batch=batch, mode="vote")
    assert [o.token_ids for o in out] == reference
    assert _accepted_share(out) > 0.2


def test_speculation_actually_accepts_tokens(target, drafter_models, mixed_prompts):
    out, verifier = _run(target, [drafter_models["generic"]], mixed_prompts, k=4, batch=8)
    accepted = sum(o.stats["num_accepted_tokens"] for o in out)
    produced = sum(len(o.token_ids) for o in out)
    assert accepted > 0.2 * produced
    assert all(o.stats["mean_acceptance_length"] > 1.3 for o in out)  # 1.0 is a request whose drafts all failed


@pytest.mark.parametrize("graphs", [False, True], ids=["exact shapes", "padded shapes (CUDA graphs)"])
def test_kv_cache_after_rollbacks_and_interleaved_joins_equals_fresh_forward(target, mixed_prompts, graphs):
    """`graphs`: chain steps at the padded, bucketed shapes a GPU replays from CUDA graphs (run directly here)."""
    runner = LlamaRunner(target, max_slots=4, max_len=512, graphs=graphs)
    ctx: dict[str, list[int]] = {}

    def feed(rid, tokens, keep=None):
        runner.forward([rid], [tokens])
        keep = list(range(len(tokens))) if keep is None else keep
        runner.commit(rid, tokens, keep)
        ctx[rid] = ctx.get(rid, []) + [tokens[i] for i in keep]

    for rid, p in zip("abc", mixed_prompts[:3]):
        runner.add(rid)
        feed(rid, p)
    feed("a", [11, 12, 13, 14], keep=[0, 1])  # a chain, half rejected
    runner.rollback("b", len(ctx["b"]) - 3)  # roll back past prompt tokens
    ctx["b"] = ctx["b"][:-3]
    runner.release("a")  # "c" moves into a's slot
    runner.add("d")
    feed("d", mixed_prompts[4])
    # a tree on c: nodes 0,1 (siblings), 2 child of 1, 3 child of 2; keep the path 1 -> 2 -> 3
    runner.forward(["c"], [[21, 22, 23, 24]], [[-1, -1, 1, 2]])
    runner.commit("c", [21, 22, 23, 24], [1, 2, 3])
    ctx["c"] += [22, 23, 24]
    # batched step over all live requests, then compare each with a fresh forward of its full context
    probes = {"b": [31], "c": [32, 33], "d": [34]}
    rids = list(probes)
    got = runner.forward(rids, [probes[r] for r in rids])
    for r, logits in zip(rids, got):
        full = torch.tensor([ctx[r] + probes[r]])
        with torch.no_grad():
            want = target(input_ids=full).logits[0, -len(probes[r]):]
        assert torch.allclose(logits, want, atol=1e-4), r


# the vote over ~10 s on the 2-core CPU: slow (make test-fast keeps the cosine mode's distribution check)
@pytest.mark.parametrize("mode", ["cosine", pytest.param("vote", marks=pytest.mark.slow)])
def test_sampling_through_the_engines_matches_the_target(target, drafter_models, tokenizer, heldout, mode):
    """End to end: speculative sampling's first two tokens follow the target's joint distribution, with fused
    drafts and with Minions' majority vote (its chain is a selection among the drafters' chains)."""
    # a short prompt: its prefill, 1,200 times over, was most of the test's time; its length is not what is checked
    prompt = tokenizer(heldout["literature"][5], add_special_tokens=False).input_ids[:12]
    params = dict(max_tokens=2, temperature=1.0, top_k=4, ignore_eos=True)
    n = 1200
    voters = [drafter_models["literature"], drafter_models["code"]] + ([drafter_models["generic"]] if mode == "vote"
                                                                       else [])
    out, _ = _run(target, voters, [prompt] * n, k=2, batch=64,
                  params=[SamplingParams(seed=i, **params) for i in range(n)], max_len=256, mode=mode)
    assert_first_two_tokens_follow_the_target(target, prompt, params, out)
    assert sum(o.stats["num_accepted_tokens"] for o in out) > 0


@pytest.mark.parametrize("graphs", [False, True], ids=["exact shapes", "padded shapes (CUDA graphs)"])
def test_release_between_forward_and_commit_keeps_the_movers_new_tokens(target, mixed_prompts, graphs):
    """The verifier releases a finished request while later requests of the same step are still uncommitted."""
    runner = LlamaRunner(target, max_slots=3, max_len=512, graphs=graphs)
    ctx = {}
    for rid, p in zip("xyz", mixed_prompts[:3]):
        runner.add(rid)
        runner.forward([rid], [p])
        runner.commit_all(rid, p)
        ctx[rid] = list(p)
    new = {"x": [41], "y": [42, 43], "z": [44, 45, 46]}
    runner.forward(list(new), [new[r] for r in new], [[-1], [-1, 0], [-1, -1, 1]])
    runner.commit("x", new["x"], [0])
    runner.release("x")  # z (highest slot) moves into x's slot with its uncommitted nodes
    runner.commit("y", new["y"], [0, 1])
    runner.commit("z", new["z"], [1, 2])  # the tree path 1 -> 2
    ctx["y"] += [42, 43]
    ctx["z"] += [45, 46]
    got = runner.forward(["y", "z"], [[50], [51]])
    for r, probe, logits in zip("yz", (50, 51), got):
        with torch.no_grad():
            want = target(input_ids=torch.tensor([ctx[r] + [probe]])).logits[0, -1:]
        assert torch.allclose(logits, want, atol=1e-4), r


def test_one_token_steps_equal_the_general_step_exactly(target, mixed_prompts):
    """A chain's next depth (one new token per request, its inputs from the runner's persistent buffer) gives the
    general exact-shape step's logits bit for bit: alone, batched over contexts of different lengths, and over
    slots out of order (after a release moved one)."""
    runner = LlamaRunner(target, max_slots=4, max_len=512, graphs=False)
    for rid, p in zip("abcd", mixed_prompts[:4]):
        runner.add(rid)
        runner.forward([rid], [p])
        runner.commit_all(rid, p)
    runner.release("a")  # d moves into slot 0
    for rids in (["b"], ["b", "c", "d"], ["d", "b"]):
        inputs = [[17 + i] for i in range(len(rids))]
        got = torch.stack(runner.forward(rids, inputs))
        with torch.no_grad():
            want = runner._step([runner.requests[r] for r in rids], inputs, None, hidden_only_last=True)
        assert got.shape == want.shape and torch.equal(got, want), rids


def test_prepacked_cpu_linears_match_plain_matmuls(target):
    from engines.cpu_kernels import Linear

    lin = target.model.layers[0].mlp.gate_proj
    packed = Linear(lin.weight.detach(), lin.bias)
    assert packed.packed is not None  # float32 on x86 CPU: the oneDNN path must be active, or the benchmarks mislead
    for rows in (1, 3, 8):
        x = torch.randn(2, rows, lin.in_features)
        assert torch.allclose(packed(x), lin(x), atol=1e-4)
    one = torch.randn(1, 1, lin.in_features)  # one row: the plain matmul, faster there than the packed weight
    assert torch.equal(packed(one), lin(one))
    plain = LlamaRunner(target, max_slots=1, max_len=64, prepack=False)
    fast = LlamaRunner(target, max_slots=1, max_len=64)
    for r in (plain, fast):
        r.add("a")
    ids = list(range(5, 25))
    assert torch.allclose(plain.forward(["a"], [ids])[0], fast.forward(["a"], [ids])[0], atol=1e-4)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_padded_graph_steps_equal_exact_steps(target, mixed_prompts, device):
    """Padded steps (on a GPU: replays of captured graphs, with new inputs each time) with batch and token counts
    off their buckets and slots out of order after a release give the exact-shape step's logits, and leave the
    same cache behind (later steps read it)."""
    import copy

    model = copy.deepcopy(target).to(device)
    runners = [LlamaRunner(model, max_slots=6, max_len=256, graphs=g) for g in (False, True)]
    rng = random.Random(0)
    for r in runners:
        for rid, p in zip("abcde", mixed_prompts[:5]):
            r.add(rid)
            r.forward([rid], [p[:40]])
            r.commit_all(rid, p[:40])
    for step in range(12):
        if step == 4:
            for r in runners:
                r.release("b")  # e moves into b's slot: slots no longer in request order
        live = list("acde") if step >= 4 else list("abcde")
        rids = rng.sample(live, rng.randint(1, len(live)))
        inputs = [[rng.randrange(100, 5000) for _ in range(rng.randint(1, 9))] for _ in rids]
        got = [r.forward(rids, inputs, hidden_only_last=step % 2 == 1) for r in runners]
        for eager, graphed in zip(*got):
            assert torch.allclose(eager, graphed, atol=1e-3), step
        keep = [rng.randint(1, len(x)) for x in inputs]
        for r in runners:
            for rid, x, n in zip(rids, inputs, keep):
                r.commit(rid, x, list(range(n)))
    if device == "cuda":
        assert len(runners[1].graphs.graphs) > 3  # several shapes captured, each replayed


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_greedy_on_cuda_equals_target(target, drafter_models, mixed_prompts, shape):
    """The same engines with every model on a GPU: cache and forward passes there (chain steps replayed from CUDA
    graphs, trees eager), verification on the host."""
    import copy

    gpu_target = copy.deepcopy(target).cuda()
    prompts = mixed_prompts[::3]
    ref = [greedy_continue(gpu_target, torch.tensor([p], device="cuda"), NEW_TOKENS)[0, len(p):].tolist()
           for p in prompts]
    names = ["code"] if shape == "chain" else ["code", "generic"]
    drafters = [copy.deepcopy(drafter_models[n]).cuda() for n in names]
    out, verifier = _run(gpu_target, drafters, prompts, k=4, batch=4, tree_budget=8 if shape == "tree" else None)
    assert verifier.runner.k.is_cuda
    if shape == "chain":
        assert verifier.runner.graphs.graphs  # its chain steps were replayed from CUDA graphs
    assert [o.token_ids for o in out] == ref
    assert sum(o.stats["num_accepted_tokens"] for o in out) > 0


def test_a_busy_consumer_gets_the_steps_waiting_for_it_as_one_chunk(target, mixed_prompts, reference):
    """Speculation off (every step plain): a consumer that reads slowly gets the chunks that queued meanwhile merged,
    fewer chunks than steps, the same tokens; one that keeps up gets a chunk per step."""
    cfg = AppConfig(verifier={"model": "target", "max_batch": 4, "max_len": 512}, speculation={"mode": "off"})
    loop = build_loop(cfg, TorchVerifierEngine(target, max_batch=4, max_len=512))
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)

    async def read(prompt, pause):
        chunks = []
        async for chunk in loop.generate(prompt, params):
            chunks.append(chunk)
            await asyncio.sleep(pause)
        return chunks

    async def run():
        try:
            return await asyncio.gather(read(mixed_prompts[1], 0.0), read(mixed_prompts[4], 0.2))
        finally:
            await loop.stop()

    quick, slow = asyncio.run(run())
    assert [t for c in quick for t in c.token_ids] == reference[1]
    assert [t for c in slow for t in c.token_ids] == reference[4]
    assert len(quick) == NEW_TOKENS and len(slow) < NEW_TOKENS and slow[-1].finished


def test_a_syncs_common_prefix_is_the_walked_one_wherever_the_two_differ():
    """`sync` keeps what the cache and the new context share: the head compared as a slice must give the same
    length as a walk of every token, whether they part in the tail, deep in the head, or not before `limit`."""
    from engines.interface import common_prefix

    def walked(a, b, limit):
        n = 0
        while n < limit and a[n] == b[n]:
            n += 1
        return n

    rng = random.Random(0)
    base = [rng.randrange(50) for _ in range(300)]
    for cut in (0, 1, 5, 100, 250, 290, 299, 300):
        other = base[:cut] + [99] * (300 - cut)  # parts at `cut` (a rejected draft, or an edited context)
        for limit in (0, 3, cut, min(300, cut + 40), 300):
            assert common_prefix(base, other, limit) == walked(base, other, limit), (cut, limit)
    assert common_prefix([], [1, 2], 0) == 0


def test_a_steps_tokens_reach_their_request_after_the_next_round_where_drafters_share_the_cpu(
        target, drafter_models, mixed_prompts, reference):
    """Drafters on the verifier's CPU: a step's tokens wait until the next round has drafted, so that their reader
    (a server's streaming) runs beside the verify step, not beside the drafters' forwards; a request's first tokens
    go at once (its first round scores the prompt for routing). Every token arrives, in order, the target's own."""
    cfg = AppConfig(verifier={"model": "target", "max_batch": 1, "max_len": 512},
                    drafters=[{"name": "d0", "model": "d0"}],
                    speculation={"mode": "cosine", "k": 4, "adaptive": False, "guard": {"enabled": False},
                                 "draft_timeout_ms": 600_000})
    loop = build_loop(cfg, TorchVerifierEngine(target, max_batch=1, max_len=512), {"d0": drafter_models["generic"]})
    loop.drafting_overlaps_verification = False
    events, draft = [], loop.drafting.draft

    async def recorded(batch):
        events.append("round")
        try:
            return await draft(batch)
        finally:
            events.append("drafted")

    loop.drafting.draft = recorded

    async def read():
        out = []
        async for chunk in loop.generate(mixed_prompts[1], SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)):
            events.append("tokens")
            out += chunk.token_ids
        return out

    assert asyncio.run(read()) == reference[1]
    drafting, read_while_drafting = False, []
    for e in events:
        drafting = {"round": True, "drafted": False}.get(e, drafting)
        read_while_drafting += [drafting] if e == "tokens" else []
    assert events.count("round") >= 3 and not any(read_while_drafting), events
    # the first step's tokens go before the next round; the second step's wait for the round after it
    assert events[:6] == ["round", "drafted", "tokens", "round", "drafted", "round"], events
