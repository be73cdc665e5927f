"""`cosine simulate`: traces recorded by the real verify loop, drafters replayed exactly, the simulated cluster's
mechanics, the autoscaler's decisions in it, and the studies end to end."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import yaml

from config import AppConfig
from engines.sampling import SamplingParams
from model_family.paths import REPO_ROOT
from simulate.cluster import Simulation, Workload
from simulate.fleet import Autoscaling
from simulate.hardware import PROFILES, Hardware, Linear, fit
from simulate.replay import annotate
from assembly.loop import build_loop, generate_all
from speculation.trace import Trace

LOCAL = REPO_ROOT / "examples" / "local.yaml"


def _args(**speculation) -> dict:
    args = yaml.safe_load(LOCAL.read_text())["applications"][0]["args"]
    args["verifier"] = dict(args["verifier"], engine="torch", model="target")
    args["speculation"].pop("drafting_tier")  # examples/local.yaml's auto: these use the default
    args["speculation"] = dict(args["speculation"], draft_timeout_ms=60000, **speculation)
    return args


def _record(tmp: Path, prompts: list[list[int]], **speculation) -> tuple[AppConfig, Trace]:
    """Run the real in-process verify loop with the trace flag on."""
    path = tmp / "trace.jsonl"
    cfg = AppConfig.model_validate(_args(record_trace=str(path), **speculation))
    loop = build_loop(cfg)
    asyncio.run(generate_all(loop, prompts, [SamplingParams(max_tokens=40, ignore_eos=True)] * len(prompts)))
    loop.trace.close()
    return cfg, Trace.load(path)


@pytest.fixture(scope="module")
def prompts(domain_prompt_ids) -> list[list[int]]:
    return [ps[0] for ps in domain_prompt_ids.values()]


@pytest.fixture(scope="module")
def cosine_trace(tmp_path_factory, prompts):
    return _record(tmp_path_factory.mktemp("cosine"), prompts, adaptive=False, guard={"enabled": False})


def test_a_requests_first_routed_round_after_generalist_rounds_is_priced_as_its_prompts_scoring(tmp_path, prompts):
    """The generalist's rounds leave a request's prompt unscored; its first routed round scores it with every
    drafter. That round is not the routed participation's steady cost: the goodput controller's round model is not
    fed it (None among the round's participations) and the trace marks it scored, as a request's first round."""
    from speculation.messages import Participation

    path = tmp_path / "trace.jsonl"
    loop = build_loop(AppConfig.model_validate(_args(record_trace=str(path), adaptive=True,
                                                     guard={"enabled": False})))
    shared, routed, chosen, priced = Participation(1, generalist=True), Participation(1), [], []

    def choose(rids, *args, **kwargs):  # three generalist rounds, then routed ones
        loop.controller.participation = shared if len(chosen) < 3 else routed
        chosen.append(loop.controller.participation)
        return {r: 2 for r in rids}

    loop.controller.choose, observe = choose, loop.planner.observe_round
    loop.planner.observe_round = lambda batch, parts, s, faulted, scored: (priced.append(set(parts)),
                                                                           observe(batch, parts, s, faulted, scored))
    asyncio.run(generate_all(loop, prompts[:3], [SamplingParams(max_tokens=16, ignore_eos=True)] * 3))
    loop.trace.close()
    scored = [d["scored"] > 0 for d in Trace.load(path).drafts]
    assert priced[:5] == [{None}, {shared}, {shared}, {None}, {routed}]
    assert scored[:5] == [True, False, False, True, False]


def test_trace_holds_requests_steps_and_drafting_rounds(cosine_trace, prompts):
    cfg, trace = cosine_trace
    assert sorted(map(tuple, (r["prompt"] for r in trace.requests))) == sorted(map(tuple, prompts))
    assert all(len(r["output"]) == 40 and r["t1"] > r["t0"] for r in trace.requests)
    assert sum(s["batch"] for s in trace.steps) >= len(prompts) * 40 / 5  # at most k + 1 tokens per step
    assert trace.drafts and all(d["depth"] == 4 for d in trace.drafts)
    assert sum(d["scored"] > 0 for d in trace.drafts) >= 1  # the first round scores the prompts
    hw = fit(trace)
    assert hw.verify.a > 0 and hw.draft_round(4, 6, 0) > 0
    # per request and step, the draft's depth and what of it was accepted: the request's own counts add up
    assert {v["id"] for v in trace.verified} == {r["id"] for r in trace.requests}
    assert all(0 <= v["accepted"] <= v["depth"] <= 4 for v in trace.verified)
    assert any(v["depth"] == 4 and 0 < v["accepted"] < 4 for v in trace.verified)
    for r in trace.requests:
        mine = [v for v in trace.verified if v["id"] == r["id"]]
        assert sum(v["accepted"] for v in mine) == r["accepted"]
        assert sum(1 + v["accepted"] for v in mine) >= len(r["output"])  # the last step's tokens may be cut


def test_replay_of_one_drafters_chains_is_exact(tmp_path, prompts):
    """Chain speculation with a fixed drafter: the simulator's replayed acceptance is the real run's, request by
    request, and what it commits is the target's output."""
    cfg, trace = _record(tmp_path, prompts, mode="chain", adaptive=False, fixed_drafters=["generic"],
                         guard={"enabled": False})
    replay = annotate(trace.requests, cfg)
    result = Simulation(cfg, fit(trace), replay).run(Workload("offline", count=len(replay)))
    real = {r["id"]: (r["output"], r["accepted"]) for r in trace.requests}
    simulated = {f.rid.split("#")[0]: (f.output, f.accepted) for f in result.finished}
    assert simulated == real


def test_replay_of_routed_fusion_is_close(cosine_trace):
    """Routing and lockstep fusion replayed: a drafter's tokens after one it got wrong are stand-ins (its real ones
    were conditioned on the wrong token), which moves routing scores a little, not acceptance much."""
    cfg, trace = cosine_trace
    replay = annotate(trace.requests, cfg)
    result = Simulation(cfg, fit(trace), replay).run(Workload("offline", count=len(replay)))
    real = sum(r["accepted"] for r in trace.requests)
    assert abs(sum(f.accepted for f in result.finished) / real - 1) < 0.03
    outputs = {r["id"]: r["output"] for r in trace.requests}
    assert all(f.output == outputs[f.rid.split("#")[0]] for f in result.finished)  # lossless


def _flat(ms: float) -> Hardware:
    return Hardware(name="flat", description="test", verifier_gpu="A100-80GB", verify=Linear(a=ms),
                    drafter_gpu="RTX3090", draft=Linear(a=1.0), colocated_draft=Linear(a=1.0), hop_ms=1.0)


def test_target_only_time_is_the_step_model(cosine_trace):
    """Speculation off, one request at a time: one verify step per token, each `a` ms."""
    cfg, trace = cosine_trace
    off = AppConfig.model_validate(dict(_args(mode="off")))
    replay = annotate(trace.requests[:2], cfg)
    result = Simulation(off, _flat(10.0), replay).run(Workload("closed", count=2, concurrency=1))
    assert result.steps == 80
    assert result.summary()["throughput_tok_s"] == pytest.approx(100.0)
    assert result.summary()["target_passes_per_token"] == 1.0


def test_speculation_cuts_target_passes_and_pays_for_its_drafters(cosine_trace):
    """The served default (vLLM verifier, drafting ahead) on the paper's 70B profile: a 31 ms verify step and 1 ms
    drafter steps on GPUs of their own make speculation pay; drafter GPU time is accounted."""
    cfg, trace = cosine_trace
    replay = annotate(trace.requests, cfg)
    work = Workload("offline", count=12)
    vllm = {"engine": "vllm"}
    off = Simulation(AppConfig.model_validate(dict(_args(mode="off"), verifier=dict(cfg.verifier, **vllm))),
                     PROFILES["paper-llama"], replay).run(work)
    sim = Simulation(cfg.model_copy(update={"verifier": cfg.verifier.model_copy(update=vllm)}),
                     PROFILES["paper-llama"], replay)
    assert not sim.grouping.partial_steps  # vLLM steps its whole pool: drafting ahead, not pipeline halves
    on = sim.run(work).summary()
    assert on["target_passes_per_token"] < 0.5 < off.summary()["target_passes_per_token"]
    assert on["mean_accepted_length"] > 2.5
    assert on["throughput_tok_s"] > off.summary()["throughput_tok_s"]
    assert on["drafter_gpu_hours"] > 0 and off.drafter_gpu_seconds == 0
    assert 0 < on["ahead_used_share"] < 1


def test_autoscaler_adds_replicas_to_slow_drafters_under_load(cosine_trace):
    """The project's ReplicaPlanner, fed the simulated replicas' busy time: drafters that compute most of the time
    get replicas (after the up-scale delay and their start-up), and the output stays the target's."""
    cfg, trace = cosine_trace
    replay = annotate(trace.requests, cfg)
    slow = _flat(5.0).model_copy(update={"draft": Linear(a=20.0, b=2.0), "replica_start_s": 2.0})
    sim = Simulation(cfg, slow, replay, autoscaling=Autoscaling(min_replicas=1, max_replicas=3, upscale_delay_s=2.0))
    result = sim.run(Workload("poisson", rate=6.0, duration=60.0, seed=3))
    assert max(n for _, n in result.replicas) > len(cfg.drafters)
    outputs = {r["id"]: r["output"] for r in trace.requests}
    assert result.finished and all(f.output == outputs[f.rid.split("#")[0]] for f in result.finished)


@pytest.mark.slow  # over ~10 s
def test_simulate_cli_reproduce_and_size(cosine_trace, domain_prompt_ids, tmp_path):
    from serve_app.cli import main

    _, trace = cosine_trace
    domain_of = {tuple(ps[0]): d for d, ps in domain_prompt_ids.items()}
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"kind": "request", "domain": domain_of[tuple(r["prompt"])], **r}) + "\n"
                            for r in trace.requests))
    out = tmp_path / "rep.json"
    assert main(["simulate", "reproduce", "--trace", str(path), "--profiles", "paper-llama", "--prompts", "6",
                 "--online-s", "20", "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert {r["system"] for r in rep["online"]} == {"no-spec", "vanilla", "cosine", "cosine+autoscaler"}
    assert len(rep["offline"]) == 5 * 3
    out = tmp_path / "size.json"
    assert main(["simulate", "size", "--trace", str(path), "--counts", "1,7", "--duration", "20",
                 "--mix", "code=1,legal=1", "--slo-ms-per-token", "40", "--json", str(out)]) == 0
    size = json.loads(out.read_text())
    assert len(size["rows"]) == 2 + 3 * 2
    # the answer is the best layout of all, baselines included; the best remote one is reported beside it
    assert size["best"]["good_tokens_per_usd"] == max(r["good_tokens_per_usd"] for r in size["rows"])
    assert size["best_remote"]["system"] == "cosine" and size["best_remote"]["kind"] in {"RTX2080Ti", "RTX3090",
                                                                                         "A100-80GB"}
    assert all(r["goodput_tok_s"] <= r["throughput_tok_s"] + 1e-9 for r in size["rows"])


def test_goodput_counts_only_the_requests_within_the_slo():
    from simulate.result import Finished, Result

    # two requests of 10 tokens over 1 s: 20 ms and 80 ms per token from sending
    fast = Finished("a#0", [], arrival=0.0, started=0.0, first=0.01, end=0.2, tokens=10, passes=4, rounds=4,
                    accepted=6)
    slow = Finished("b#1", [], arrival=0.2, started=0.2, first=0.3, end=1.0, tokens=10, passes=10, rounds=10,
                    accepted=0)
    result = Result([fast, slow], makespan=1.0, steps=14, step_tokens=20, drafter_gpu_seconds=0.0, cost_usd=0.01,
                    replicas=[])
    every = result.summary()
    assert every["goodput_tok_s"] == every["throughput_tok_s"] == 20
    within = result.summary(slo_ms_per_token=50)
    assert within["goodput_tok_s"] == 10 and within["usd_per_million_good_tokens"] == 1e6 * 0.01 / 10
    assert result.summary(slo_ms_per_token=10)["usd_per_million_good_tokens"] is None


def test_where_remote_drafters_pay_follows_the_drafter_step_and_the_margin():
    """`cosine simulate remote` on a few replayed requests: a remote drafter step dearer than the one vanilla runs on
    the verifier's GPUs loses to it, and sharpened domain drafters (every top token the target's) raise both the
    accepted length and the ratio; the generic drafter, vanilla's, is left as replayed."""
    from simulate.replay import sharpened
    from simulate.report import DEFAULT_TRACE
    from simulate.studies import remote_pays

    args = _args()
    args["verifier"] = dict(args["verifier"], engine="vllm")
    replay = annotate(Trace.load(DEFAULT_TRACE).requests[:6], AppConfig.model_validate(args))
    sharp = sharpened(replay, {"code", "legal"}, 1.0)
    assert all((sharp[i].preds[d].tokens[:, 0] == r.output).all() for i, r in enumerate(replay)
               for d in ("code", "legal"))
    assert all((sharp[i].preds["generic"].tokens == r.preds["generic"].tokens).all() for i, r in enumerate(replay))
    out = remote_pays(args, replay, batches=(1,), draft_ms=(0.5,), hops=(1.5,), shares=(0.0, 1.0), prompts=6,
                      log=lambda _: None)
    ratio = {g["draft_ms"]: g["ratio"] for g in out["grid"]}
    assert ratio[0.5] > 1 > ratio[max(ratio)]  # the eager 0.5B step on a 3090 (17 ms) against 2.5 ms on an A100
    low, high = out["margin"]
    assert high["accepted"] > low["accepted"] and high["ratio"] > low["ratio"]
