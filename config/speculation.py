"""`speculation`: the speculation modes, drafting and verification, and their parts: the draft-length
controller, the vote, the domain drafters' retirement and the guard."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from config.base import Strict
from config.deployment import DeploymentOptions


class ControllerSpec(Strict):
    """The draft-length controller of adaptive speculation, one of two (`kind`). goodput (SmartSpec,
    speculation/goodput.py): per-request draft lengths and participation from fitted step-latency models and
    acceptance estimates; the other fields without a prefix are its. hill_climb (Minions, speculation/hill_climb.py):
    one draft length for the batch, moved a step at a time toward higher measured goodput, model-free; the
    `hill_climb:` fields are its."""

    kind: Literal["goodput", "hill_climb"] = Field("goodput", description="which controller")
    prior_acceptance: float = Field(0.6, gt=0, lt=1, description="per-token acceptance assumed before any is seen")
    ema: float = Field(0.3, gt=0, le=1, description="weight of the newest round in a request's acceptance estimate")
    probe_interval: int = Field(8, ge=1, description="rounds a request may sit at k = 0 before it drafts once "
                                "(probe_k tokens) to re-measure its acceptance")
    probe_k: int = Field(2, ge=1, description="draft length of such a probe")
    participation_probe: int = Field(32, ge=1, description="rounds after which a participation mode not chosen "
                                     "is tried once")
    participation_probe_max: int = Field(256, ge=1, description="a participation mode the controller's model puts "
                                         "outside participation_hysteresis of the chosen one waits twice as long after "
                                         "each probe, up to this many rounds; back to participation_probe once "
                                         "within reach (equal to participation_probe: no backoff)")
    participation_hysteresis: float = Field(0.03, ge=0, lt=1, description="a participation mode replaces the one in use "
                                   "only when its predicted goodput is this much higher (modes whose measurements "
                                   "tie do not alternate)")
    verify_seed_ms: tuple[float, float] | None = Field(None, description="[a, b]: the verify step model the "
                                                       "controller starts from, t = a + b * tokens in the step, in "
                                                       "ms (`cosine profile` measures it); refitted online")
    draft_seed_ms: tuple[float, float] | None = Field(None, description="[a, b]: the lockstep drafter step model "
                                                      "it starts from, t = a + b * requests in the step, in ms "
                                                      "(`cosine profile`); refitted online")
    window: int = Field(32, ge=2, description="hill_climb: verify steps per goodput measurement (tokens per "
                        "second per running request)")
    hold: int = Field(4, ge=0, description="hill_climb: windows at the best draft length, beyond the one that "
                      "measures it afresh, before its neighbours are probed again (from k = 0: k = 1, whether "
                      "speculation pays again)")

    @model_validator(mode="after")
    def _probe_backoff(self) -> ControllerSpec:
        if self.participation_probe_max < self.participation_probe:
            raise ValueError(f"controller.participation_probe_max ({self.participation_probe_max}) is below "
                             f"participation_probe ({self.participation_probe}): set it at least that (equal: no "
                             "backoff)")
        return self


class VoteSpec(Strict):
    """Minions' majority-voted speculator (`speculation.mode: vote`, speculation/voting.py): every voter drafts its
    own chain, the chains are merged into a token trie weighted by the voters' weights, and the heaviest path is
    verified. A voter's weight is multiplied by reward_factor while its acceptance rate over its last `window`
    rounds is above reward_threshold, by punish_factor while below punish_threshold, then renormalised and clipped.
    Pick it over cosine when the drafters are alike in quality and disagree on few tokens (several general drafters,
    say): agreement then outvotes one drafter's slip, and the verifier checks one chain, not a tree. With domain
    specialists and mixed traffic, routing (cosine) picks the right drafter per request for a fraction of the cost:
    voting runs every voter on every request."""

    drafters: list[str] | None = Field(None, description="the voters; null: every configured drafter")
    per_request: bool = Field(False, description="weights per request, from equal at its first round (for "
                              "drafters specialised by domain); false: one set of weights for all requests (Minions)")
    window: int = Field(32, ge=1, description="a voter's recent rounds over which its acceptance rate is taken")
    reward_threshold: float = Field(0.6, ge=0, le=1, description="acceptance rate above which a voter gains weight")
    punish_threshold: float = Field(0.3, ge=0, le=1, description="acceptance rate below which a voter loses weight")
    reward_factor: float = Field(1.2, ge=1, description="a rewarded voter's weight is multiplied by this")
    punish_factor: float = Field(0.8, gt=0, le=1, description="a punished voter's weight is multiplied by this")
    min_weight: float = Field(0.02, ge=0, le=1, description="a voter's weight (of 1 in all) is kept at least this")
    max_weight: float = Field(0.6, gt=0, le=1, description="and at most this")

    @model_validator(mode="after")
    def _ordered(self):
        if self.punish_threshold > self.reward_threshold:
            raise ValueError("vote.punish_threshold must be <= vote.reward_threshold")
        if self.min_weight > self.max_weight:
            raise ValueError("vote.min_weight must be <= vote.max_weight")
        return self


class RetirementSpec(Strict):
    """Retiring the domain drafters while the goodput controller drafts (nearly) every round on the generalist:
    the verifier then puts the rest of the rounds there too, so the drafter autoscaler can take the domain
    drafters' replicas without a call still reaching them (one waiting at a handle with no replica makes Serve start
    one). On where a generalist drafter exists and another drafter has an autoscaling_config."""

    below: float = Field(0.1, ge=0, lt=1, description="retire the domain drafters when fewer than this share of "
                         "the last window_rounds drafted request rounds are routed by the controller's choice (the "
                         "rest on the generalist)")
    above: float = Field(0.3, gt=0, le=1, description="bring them back when more than this share is routed by the "
                         "controller's choice again (above `below`: a share near one threshold does not start and "
                         "stop replicas)")
    window_rounds: int = Field(200, ge=1, description="the drafted request rounds (a round of n drafting requests "
                               "counts n) the routed share is measured over: a count, not a time, so that a pause "
                               "in traffic does not empty it and the first lone requests after it (always routed) do "
                               "not read as a routed majority")
    min_rounds: int = Field(100, ge=1, description="drafted request rounds the window needs before the domain "
                            "drafters retire")

    @model_validator(mode="after")
    def _ordered(self):
        if self.above <= self.below:
            raise ValueError("speculation.retirement.above must be greater than below")
        return self


class GuardSpec(Strict):
    """The guard that keeps speculation from running slower than plain decoding (speculation/guard.py): it compares
    the tokens per second speculation really gave over a window of steps (drafting waits included) with plain
    steps measured at the same batch sizes, and switches speculation off (k = 0) where it lost, trying it again
    after a while. Each load (batch sizes 1, 2, 3-4, 5-8, 9-16, ...) has its own verdict, windows and waits.
    Model-free: it catches what the draft-length controller's models get wrong, and guards fixed-k methods
    (`adaptive: false`) as it guards adaptive ones."""

    enabled: bool = Field(True, description="false: speculation is never switched off by measurement")
    window: int = Field(16, ge=2, description="speculating verify steps per verdict")
    margin: float = Field(0.03, ge=0, lt=1, description="speculation is switched off when its realised tokens per "
                          "second fall more than this share below plain decoding's")
    clear: float = Field(0.85, gt=0, le=1, description="speculation realising less than this share of plain "
                         "decoding's tokens per second is switched off after half a window, whatever the patience")
    patience: int = Field(2, ge=1, description="windows in a row that must lose before speculation is switched "
                          "off (one, when it is tried again after being off)")
    severe: float = Field(0.5, gt=0, le=1, description="speculation realising less than this share of plain "
                          "decoding's tokens per second is switched off after a quarter window, whatever the patience")
    probe_steps: int = Field(2, ge=1, description="plain steps taken to measure plain decoding where no plain "
                             "step was measured at a batch size near the window's")
    off_steps: int = Field(32, ge=1, description="plain steps after a lost window before speculation is tried "
                           "again; doubled after each further loss in a row, and (but for a load's first verdict) "
                           "at least enough that a trial losing as much costs half the margin of them")
    off_steps_max: int = Field(512, ge=1, description="the longest such wait")
    refresh_steps: int = Field(256, ge=1, description="a plain measurement older than this many steps is taken "
                               "again")
    noise: float = Field(1.0, ge=0, description="a verdict before a full window (clear, severe, on trial) needs "
                         "its loss beyond this many standard errors of the window's per-step ratios (0: the ratio "
                         "alone)")

    @model_validator(mode="after")
    def _ordered(self) -> GuardSpec:
        if self.clear < self.severe:
            raise ValueError(f"speculation.guard.clear ({self.clear}) is below severe ({self.severe}): a clear loss "
                             "is judged later than a severe one, so it must be the higher share")
        if self.off_steps_max < self.off_steps:
            raise ValueError(f"speculation.guard.off_steps_max ({self.off_steps_max}) is below off_steps "
                             f"({self.off_steps})")
        return self


# The one list of speculation modes: each but off is the `name` of its drafting strategy (speculation/strategies/;
# tests/test_config.py checks that they agree), and the modes a request may choose for itself (the API's
# `speculation.mode`: both decide per request, so either can serve any request losslessly).
SpeculationMode = Literal["cosine", "chain", "vote", "single", "off"]
RequestMode = Literal["cosine", "vote"]


class SpeculationSpec(Strict):
    mode: SpeculationMode = Field(
        "cosine", description="cosine: routed drafters, fused; chain: one fixed drafter's chain; vote: Minions' "
        "majority vote of several drafters' chains (see `vote`); single: `drafter` drafts every request, no routing "
        "state kept (speculation/strategies/); off: target-only decoding")
    k: int = Field(4, ge=0, le=32, description="draft steps per round (the maximum when adaptive)")
    gamma_max: int = Field(64, ge=1, description="total draft tokens verified per step (CoSine's Gamma_max)")
    tree_budget: int = Field(8, ge=1, description="draft nodes per request and round")
    lockstep: bool = Field(True, description="with several drafters per request, fuse them in lockstep (the fused "
                           "token fed back to every drafter at every depth, CoSine Eq. 4) as one of the controller's "
                           "options; false: only one-shot fusion (each drafter's own chain, fused at divergences)")
    draft_ahead: bool = Field(True, description="vllm engine, drafters on hardware of their own: while a step is "
                              "verified, draft the next round from the context that step's full acceptance would "
                              "give; after the step each such draft is used for what of it still extends the "
                              "context (the other requests draft as usual), so drafting overlaps verification")
    adaptive: bool = Field(True, description="the controller (controller.kind) picks the draft length 0..k every "
                           "round; false: always k")
    adaptive_drafters: bool = Field(True, description="with adaptive speculation, the goodput controller also "
                                    "picks 1..routing.drafters_per_request drafters per request each round: fewer "
                                    "when the verifier is loaded (CoSine Alg. 2), and, given a generalist drafter, "
                                    "whether the round's requests all draft with it instead of their routed "
                                    "drafters (one batched step per depth); the hill climber always uses "
                                    "routing.drafters_per_request")
    fixed_drafters: list[str] | None = Field(None, description="bypass routing: always use these drafters")
    drafter: str | None = Field(None, description="mode single: the drafter (default: the first configured)")
    draft_timeout_ms: float = Field(100.0, gt=0, description="the longest the verifier waits for a round's drafts "
                                    "(decoding without them when they are later); the bound until a verify step is "
                                    "measured, and for rounds that score a new request's prompt")
    draft_timeout_share: float | None = Field(2.0, gt=0, description="once verify steps are measured, wait for a "
                                              "round's drafts at most this many times the recent verify step "
                                              "(median of the last 32), within draft_timeout_ms: drafting that "
                                              "takes longer than verifying cannot pay; null: draft_timeout_ms "
                                              "only. A configuration that sets draft_timeout_ms and not this gets "
                                              "null (its bound, as written)")
    drafter_timeout_ms: float = Field(5000.0, gt=0, description="a drafter call later than this drops that drafter "
                                      "from the round (the others' drafts still count)")
    drafter_backoff_s: tuple[float, float] = Field(
        (1.0, 30.0), description="[first, longest]: a drafter whose call failed or came too late (after "
        "drafter_timeout_ms, or past the round's end at 0.8 x draft_timeout_ms) is not called for `first` seconds, "
        "doubled at each further failure in a row up to `longest`; one answer in time clears it")
    controller: ControllerSpec = Field(default_factory=ControllerSpec, description="the draft-length controller")
    guard: GuardSpec = Field(default_factory=GuardSpec, description="switching speculation off where it measured "
                             "slower than plain decoding")
    retirement: RetirementSpec = Field(default_factory=RetirementSpec, description="retiring the domain drafters "
                                       "while rounds draft on the generalist (for the drafter autoscaler)")
    vote: VoteSpec = Field(default_factory=VoteSpec, description="mode vote: the voters and their weights")
    drafting_tier: Literal["deployments", "colocated", "auto"] = Field(
        "deployments", description="where drafting runs. deployments: the Speculation deployment (routing, fusion) "
        "and a deployment per drafter, each placed and scaled on its own hardware (the cluster layout; the drafter "
        "autoscaler scales them); colocated: the coordinator and every drafter inside the verifier's replica, "
        "called directly (no hops; for one machine, where drafters share the verifier's cores anyway). Colocated "
        "drafters ignore their deployment options; auto: both, each drafting round on the one that predicts more "
        "goodput at the current load from the measured round times of each and the goodput controller's verify "
        "model and acceptance (speculation/tiers.py); the drafter autoscaler gives the drafter deployments "
        "min_replicas while the verifier drafts on its own hardware. Needs the goodput controller")
    pool_drafters: Literal["auto", "on", "off"] = Field(
        "auto", description="drafters in one process (the colocated layout, `cosine generate`, benchmarks): on: "
        "the drafters of one shape (same config apart from the weights, the fast runner) advance together, one "
        "batched forward per depth for all of them and their requests (engines/drafter_pool.py), on a GPU one CUDA "
        "graph replay per depth; off: each drafter steps on its own; auto: on where the drafters run on a GPU, off "
        "on a CPU, where the pooled step measured 1.03x and 0.98x the separate steps' tokens/s at batch 1 and 8 on 2 "
        "cores: no gain (bench_results/drafter-pool.json)")
    colocated_overlap: Literal["auto", "on", "off"] = Field(
        "auto", description="drafters in the verifier's process (`cosine generate`, benchmarks; assembly/loop.py): "
        "on: drafting overlaps verification, the loop verifying one half of the batch while the other half drafts "
        "(the drafters' host work and kernels while the target's kernels run); off: the two take turns (on a CPU the "
        "drafters step on the verifier's thread); auto: on where the verifier runs on a GPU, off on a CPU, where "
        "drafters and verifier share the same cores")
    record_trace: str | None = Field(None, description="a JSON-lines file (absolute path on the verifier's node) "
                                     "the verify loop appends to: every finished request's prompt and output, "
                                     "every verify step's and drafting round's timing, each request's draft depth "
                                     "and accepted tokens per step; `cosine simulate` replays it, `cosine bench "
                                     "rounds` reads it")
    # the speculation cluster's central node keeps per-request state (routing scores, last round, which drafters
    # hold a cache), so it runs as one replica; place it next to the verifier
    deployment: DeploymentOptions = Field(default_factory=DeploymentOptions, description="Ray Serve options")

    def colocated_overlaps(self, verifier_device: str) -> bool:
        """Whether drafting in the verifier's process overlaps verification (`colocated_overlap`); auto: on a GPU,
        where the target's step is the device's work and drafting mostly the host's, so the two can run at once; not
        on a CPU, where they would take the same cores."""
        setting = self.colocated_overlap
        return setting == "on" or (setting == "auto" and verifier_device.startswith("cuda"))

    @model_validator(mode="after")
    def _fixed_timeout_as_written(self):
        if "draft_timeout_ms" in self.model_fields_set and "draft_timeout_share" not in self.model_fields_set:
            self.draft_timeout_share = None
        return self

    @model_validator(mode="after")
    def _one_central_node(self):
        if self.deployment.num_replicas != 1 or self.deployment.autoscaling_config is not None:
            raise ValueError("speculation.deployment must have num_replicas: 1 (it holds per-request routing "
                             "state); scale the verifier and the drafters instead")
        return self

    @field_validator("drafter_backoff_s")
    @classmethod
    def _backoff(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not 0 < v[0] <= v[1]:
            raise ValueError("drafter_backoff_s must be [first, longest] with 0 < first <= longest")
        return v
