from autoscale.goodput import LinearLatency, SpeculationController, expected_tokens


def test_expected_tokens():
    assert expected_tokens(0.0, 4) == 1.0
    assert abs(expected_tokens(0.5, 2) - 1.75) < 1e-9


def _ctrl(verify_a, verify_b, draft_a, draft_b, acc):
    c = SpeculationController(k_max=8, prior_acceptance=acc)
    c.verify.a, c.verify.b, c.draft.a, c.draft.b = verify_a, verify_b, draft_a, draft_b
    return c


def test_gpu_like_costs_draft_long_for_agreeing_requests():
    # verifying extra tokens is nearly free, drafting is cheap: long drafts pay off
    ks = _ctrl(0.030, 0.0001, 0.001, 0.0001, acc=0.8).choose(["a", "b"])
    assert ks["a"] >= 6 and ks["b"] >= 6


def test_cpu_like_costs_at_large_batch_switch_speculation_off():
    # every verified token costs almost as much as a decode step: speculation cannot pay at batch 16
    ks = _ctrl(0.002, 0.004, 0.002, 0.0005, acc=0.5).choose([str(i) for i in range(16)])
    assert set(ks.values()) == {0}


def test_jumps_past_a_worse_k_of_one():
    # a fixed per-step drafter cost makes k=1 a loss, longer drafts a gain
    c = _ctrl(0.030, 0.001, 0.012, 0.0, acc=0.95)
    assert c.choose(["a"])["a"] >= 3


def test_acceptance_feedback_shortens_drafts_of_a_failing_request():
    c = _ctrl(0.030, 0.002, 0.002, 0.0, acc=0.8)
    for _ in range(10):
        c.observe_acceptance("bad", drafted=4, accepted=0)
        c.observe_acceptance("good", drafted=4, accepted=4)
    ks = c.choose(["bad", "good"])
    assert ks["good"] > ks["bad"]


def test_linear_latency_fit():
    lat = LinearLatency()
    for n in range(1, 9):
        lat.observe(n, 0.01 + 0.002 * n)
    assert abs(lat.a - 0.01) < 1e-6 and abs(lat.b - 0.002) < 1e-6
