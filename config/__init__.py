"""The one configuration schema of the application, passed as Serve application `args` and validated at deploy.

Model references are a directory, the name of a shipped model (`target`, `drafter-code`, ...), or a Hugging Face
model id, optionally pinned to a revision as `org/name@revision` (model_family/sources.py: resolved with
huggingface_hub on the node that loads the model, honouring its HF_HOME, HF_HUB_OFFLINE and HF_TOKEN).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# Serve's autoscaling defaults (metrics every 10 s, scale up after 30 s, down after 600 s) are made for
# request-driven web services. Drafting demand moves with the controller's draft lengths, which change within
# seconds of a load change, and a drafter replica starts in seconds: the autoscaler needs fresher signals and
# shorter delays. Down stays slower than up: a removed replica's requests re-prefill elsewhere, and a drafter
# missing at a load peak costs verifier time.
DRAFTER_AUTOSCALING_DEFAULTS = {"metrics_interval_s": 2.0, "look_back_period_s": 10.0, "upscale_delay_s": 5.0,
                                "downscale_delay_s": 60.0}


class AutoscalingOptions(_Strict):
    """Serve's per-deployment autoscaling_config (ray.serve.config.AutoscalingConfig), its keys checked here; a
    key left out is Serve's default (on a drafter, DRAFTER_AUTOSCALING_DEFAULTS' first). The application's
    autoscaling_policy is set by the graph, not per deployment."""

    min_replicas: int | None = Field(None, ge=0, description="fewest replicas; 0 on a drafter: parked when idle")
    max_replicas: int | None = Field(None, ge=1, description="most replicas")
    initial_replicas: int | None = Field(None, ge=0, description="replicas at deploy")
    target_ongoing_requests: float | None = Field(None, gt=0, description="Serve's default policy's target per "
                                                  "replica (the drafter autoscaler decides from its own signals)")
    metrics_interval_s: float | None = Field(None, gt=0, description="how often replicas report their load")
    look_back_period_s: float | None = Field(None, gt=0, description="the window load is averaged over")
    smoothing_factor: float | None = Field(None, gt=0, description="Serve's default policy: step size")
    upscale_smoothing_factor: float | None = Field(None, gt=0, description="Serve's default policy: up step size")
    downscale_smoothing_factor: float | None = Field(None, gt=0, description="Serve's default policy: down step")
    upscaling_factor: float | None = Field(None, gt=0, description="Serve's default policy: up multiplier")
    downscaling_factor: float | None = Field(None, gt=0, description="Serve's default policy: down multiplier")
    upscale_delay_s: float | None = Field(None, ge=0, description="how long a scale-up must be wanted first")
    downscale_delay_s: float | None = Field(None, ge=0, description="how long a scale-down must be wanted first")
    downscale_to_zero_delay_s: float | None = Field(None, ge=0, description="the same, for the last replica")
    aggregation_function: Literal["mean", "max", "min"] | None = Field(None, description="how the window's load "
                                                                      "samples are combined")

    @model_validator(mode="after")
    def _bounds(self):
        lo, hi = self.min_replicas, self.max_replicas
        if lo is not None and hi is not None and lo > hi:
            raise ValueError(f"autoscaling_config: min_replicas ({lo}) must be <= max_replicas ({hi})")
        return self

    def serve(self) -> dict[str, Any]:
        """The keys given, as Serve takes them."""
        return self.model_dump(exclude_none=True)


class DeploymentOptions(_Strict):
    """What Ray Serve needs to place and scale one deployment."""

    num_replicas: int | Literal["auto"] = Field(1, description="replicas (ignored when autoscaling_config is set)")
    max_ongoing_requests: int = Field(256, ge=1, description="concurrent calls a replica takes (Serve's default of 5 "
                                      "starves deployments that batch)")
    ray_actor_options: dict[str, Any] = Field(default_factory=lambda: {"num_cpus": 0}, description="Ray placement: "
                                              "num_cpus, num_gpus, resources, accelerator_type")
    autoscaling_config: AutoscalingOptions | None = Field(
        None, description="Serve's per-deployment autoscaling. On a drafter, with the drafter autoscaler as the "
        "application's autoscaling_policy: min_replicas, max_replicas, and Serve's timing keys, defaulting to "
        f"{DRAFTER_AUTOSCALING_DEFAULTS}")
    # Serve's defaults stop a deployment's old replicas before starting new ones (a one-replica deployment is gone
    # until its replacement is up: 20-40 s here, requests in flight cut) and give a replica 20 s to finish
    max_surge_percent: int = Field(100, ge=0, le=100, description="extra replicas while a redeploy replaces this "
                                   "deployment's, in % of its replica count: 100 keeps the old replicas serving "
                                   "until their replacements are ready. Needs room for both; a verifier whose second "
                                   "copy does not fit its GPUs must set 0, and then it stops serving while it "
                                   "restarts")
    graceful_shutdown_timeout_s: float = Field(300.0, gt=0, description="a replica being replaced or scaled down "
                                               "finishes its requests in flight for up to this long (Serve's 20 s "
                                               "default would cut long generations)")

    def serve_options(self) -> dict[str, Any]:
        opts: dict[str, Any] = {"max_ongoing_requests": self.max_ongoing_requests,
                                "ray_actor_options": dict(self.ray_actor_options),
                                "max_surge_percent": self.max_surge_percent,
                                "graceful_shutdown_timeout_s": self.graceful_shutdown_timeout_s}
        if self.autoscaling_config is not None:
            opts["autoscaling_config"] = self.autoscaling_config.serve()
        else:
            opts["num_replicas"] = self.num_replicas
        return opts


class DrafterSpec(_Strict):
    name: str = Field(..., pattern=r"^[a-z0-9][a-z0-9_-]*$", description="domain name, e.g. code")
    model: str = Field(..., description="the drafter model")
    generalist: bool = Field(False, description="trained on every domain (a fallback drafter), not one: routing's "
                             "cold start ranks it first only where no domain drafter explains the prompt")
    assistant: str | None = Field(None, description="a smaller model that drafts this drafter's own chains for it "
                                  "(SpecRouter's multi-level chain: assistant -> this drafter -> target; the chains "
                                  "are this drafter's, in fewer of its forward passes). Pays for a drafter close to "
                                  "the target but slow, e.g. the target's small original as drafter of the bench "
                                  "target, assisted by a domain drafter")
    assistant_k: int = Field(4, ge=1, le=16, description="the assistant's tokens checked per forward pass of this "
                             "drafter")
    max_requests: int = Field(64, ge=1, description="requests holding a KV cache in one replica (fewer where "
                              "kv_cache_gib does not hold that many at max_len)")
    max_len: int | None = Field(None, ge=64, description="longest context (tokens) a replica drafts for; null: the "
                                "verifier's max_len (capped at the drafter's max_position_embeddings, said at "
                                "startup)")
    kv_cache_gib: float = Field(2.0, gt=0, description="KV cache memory of a replica: its request slots are "
                                "min(max_requests, what fits at max_len), reported at startup; not even one "
                                "request fitting is a startup error")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("auto", description="weights and KV cache; "
                                                                    "auto: bfloat16 (float16 where the GPU lacks "
                                                                    "it) on a GPU, float32 on a CPU")
    runner: Literal["auto", "fast", "transformers"] = Field("auto", description="the drafter's engine. fast: this "
                                                            "project's batched runner, for the architectures proven "
                                                            "equal to transformers (llama, mistral, qwen2, qwen3); "
                                                            "transformers: any other causal LM transformers loads, "
                                                            "stepped through its own forward; auto: fast where it is "
                                                            "proven, else transformers")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="where the model runs; auto: a GPU if the "
                                                  "replica sees one (ray_actor_options.num_gpus), else the CPU")
    threads: int | None = Field(1, ge=1, description="torch CPU threads of a replica (a drafter step is too small "
                                "to gain from more, and drafters sharing cores with the verifier must not crowd it); "
                                "null: as for the verifier")
    deployment: DeploymentOptions = Field(default_factory=DeploymentOptions, description="Ray Serve options")


class CollaborationSpec(_Strict):
    """CoS collaborative decoding (engines/collaborative.py): every output token follows a combination of the
    target's next-token distribution and a partner model's, computed with speculation (the partner drafts inside the
    verifier's replica, the target verifies against the combination). For operators who serve the combination
    itself, e.g. a general model steered by a domain model (ensemble), or a large model's output sharpened against a
    small one's (contrastive). It changes what the deployment outputs, so it is a deployment's choice, not a
    request's."""

    partner: str = Field(..., description="the partner model (the same vocabulary as the target); it runs beside "
                         "the target, in the verifier's replica")
    combine: Literal["ensemble", "contrastive"] = Field("ensemble", description="ensemble: weight * partner + "
                                                        "(1 - weight) * target, each processed by temperature/top-k/"
                                                        "top-p first; contrastive: softmax((target logits - mu * "
                                                        "partner logits) / temperature), the partner the amateur")
    weight: float = Field(0.5, ge=0, le=1, description="ensemble: the partner's weight")
    mu: float = Field(0.1, ge=0, description="contrastive: the partner's logits' coefficient")
    k: int = Field(4, ge=0, le=16, description="tokens the partner drafts per cycle; 0: token-by-token "
                   "collaborative decoding (a pass of each model per token, no speculation)")
    alternate: bool = Field(True, description="CoS's alternate proposal framework: after a full accept the target "
                            "proposes the next token and the partner checks it in its next pass (up to k + 1 tokens "
                            "per cycle); false: naive CoS")


class VerifierSpec(_Strict):
    engine: Literal["torch", "vllm"] = Field("torch", description="the target's engine. vllm: the drafts are "
                                            "verified inside a vLLM engine (its paged KV cache, continuous batching, "
                                            "tensor parallelism, rejection sampler; chains only: a fused tree is "
                                            "sent as its most confident chain); torch: this project's engine "
                                            "(verifies whole token trees)")
    model: str = Field(..., description="the target model")
    max_batch: int = Field(16, ge=1, description="requests verified together (continuous batching); more wait")
    max_len: int = Field(2048, ge=64, description="context length (prompt + generated tokens)")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="where the torch engine runs; auto: a GPU "
                                                  "if the replica sees one (ray_actor_options.num_gpus), else the CPU")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("auto", description="the target's weights; "
                                                                    "auto: torch engine as drafters' dtype, vllm: "
                                                                    "vLLM's own choice (its `dtype: auto`)")
    threads: int | None = Field(None, ge=1, description="torch CPU threads of a replica; null: the replica's "
                                "num_cpus if it reserves any, else every core of its machine (Ray would give a "
                                "replica without num_cpus one thread)")
    tensor_parallel_size: int = Field(1, ge=1, description="vllm: GPUs the target is split over (give the "
                                      "replica as many in deployment.ray_actor_options.num_gpus)")
    kv_cache_gib: int | None = Field(None, ge=1, description="vllm on CPU: GiB of KV cache "
                                       "(VLLM_CPU_KVCACHE_SPACE); null: vLLM's default. On GPUs vLLM sizes it from "
                                       "gpu_memory_utilization (engine_kwargs)")
    seed: int = Field(0, description="vllm: the engine's seed (requests with their own seed use it instead)")
    deployment: DeploymentOptions = Field(default_factory=DeploymentOptions, description="Ray Serve options")
    engine_kwargs: dict[str, Any] = Field(default_factory=dict, description="vllm: more vLLM engine arguments "
                                          "(e.g. gpu_memory_utilization, enable_prefix_caching)")
    collaboration: CollaborationSpec | None = Field(None, description="torch engine: serve CoS collaborative "
                                                    "decoding of the target and a partner model instead of the "
                                                    "target alone (needs speculation.mode: off: the partner drafts)")


class ControllerSpec(_Strict):
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


class VoteSpec(_Strict):
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


class RetirementSpec(_Strict):
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


class GuardSpec(_Strict):
    """The guard that keeps speculation from running slower than plain decoding (speculation/guard.py): it compares
    the tokens per second speculation really gave over a window of steps (drafting waits included) with plain
    steps measured at the same batch sizes, and switches speculation off (k = 0) where it lost, trying it again
    after a while. Model-free: it catches what the draft-length controller's models get wrong. With adaptive
    speculation only (`adaptive: false` drafts k every round)."""

    enabled: bool = Field(True, description="false: speculation is never switched off by measurement")
    window: int = Field(16, ge=2, description="speculating verify steps per verdict")
    margin: float = Field(0.03, ge=0, lt=1, description="speculation is switched off when its realised tokens per "
                          "second fall more than this share below plain decoding's")
    patience: int = Field(2, ge=1, description="windows in a row that must lose before speculation is switched "
                          "off (one, when it is tried again after being off)")
    severe: float = Field(0.5, gt=0, le=1, description="speculation realising less than this share of plain "
                          "decoding's tokens per second is switched off after a quarter window, whatever the patience")
    probe_steps: int = Field(2, ge=1, description="plain steps taken to measure plain decoding where no plain "
                             "step was measured at a batch size near the window's")
    off_steps: int = Field(32, ge=1, description="plain steps after a lost window before speculation is tried "
                           "again; doubled after each further loss in a row, and at least enough that a trial "
                           "losing as much as the last verdict's steps costs half the margin of them")
    off_steps_max: int = Field(512, ge=1, description="the longest such wait")
    refresh_steps: int = Field(256, ge=1, description="a plain measurement older than this many steps is taken "
                               "again")

    @model_validator(mode="after")
    def _ordered(self) -> GuardSpec:
        if self.off_steps_max < self.off_steps:
            raise ValueError(f"speculation.guard.off_steps_max ({self.off_steps_max}) is below off_steps "
                             f"({self.off_steps})")
        return self


# The one list of speculation modes: each but off is the `name` of its drafting strategy (speculation/strategies/;
# tests/test_config.py checks that they agree), and the modes a request may choose for itself (the API's
# `speculation.mode`: both decide per request, so either can serve any request losslessly).
SpeculationMode = Literal["cosine", "chain", "vote", "single", "off"]
RequestMode = Literal["cosine", "vote"]


class SpeculationSpec(_Strict):
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
        "on a CPU, where the pooled step measured 0.97x the separate steps' tokens/s at batch 1 and 8 on 2 cores "
        "(bench_results/drafter-pool.json)")
    record_trace: str | None = Field(None, description="a JSON-lines file (absolute path on the verifier's node) "
                                     "the verify loop appends to: every finished request's prompt and output, "
                                     "every verify step's and drafting round's timing, each request's draft depth "
                                     "and accepted tokens per step; `cosine simulate` replays it, `cosine bench "
                                     "rounds` reads it")
    # the speculation cluster's central node keeps per-request state (routing scores, last round, which drafters
    # hold a cache), so it runs as one replica; place it next to the verifier
    deployment: DeploymentOptions = Field(default_factory=DeploymentOptions, description="Ray Serve options")

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


class RoutingSpec(_Strict):
    """CoSine's routing (Eq. 1-3): per-request drafter scores from how well each drafter's tokens aligned with
    what the target committed, explore/exploit, and a cold start from the prompt's likelihood."""

    drafters_per_request: int = Field(2, ge=1, le=8, description="routed drafters per request and round (the "
                                      "most, when the goodput controller picks fewer); CoSine used 2-3")
    tau: float = Field(2.0, ge=1.0, description="accepted length (bonus included) below which a request explores")
    alpha: float = Field(0.3, ge=0, le=1, description="probability of a random pick per place while exploring")
    beta: float = Field(0.05, ge=0, le=1, description="probability of a random pick per place while exploiting")
    # fused drafters are scored on the same positions, so one round separates them little; 0.2 flipped close calls
    # on noise (own domain first at release 19/24 vs 21/24 over 12 tokens, 14/24 vs 17/24 over 128, same MAL)
    ema: float = Field(0.1, gt=0, le=1, description="weight of the newest round in a request's routing scores")
    cold_start_temperature: float = Field(0.5, gt=0, description="softmax temperature over the drafters' mean "
                                          "prompt log-likelihoods (a new request's first ranking)")
    generalist_margin: float = Field(0.5, ge=0, description="nats per prompt token by which a generalist drafter "
                                     "must out-explain every domain drafter to lead a new request's ranking")
    seed: int = Field(0, description="seed of the router's random picks")
    chain_choice: Literal["score", "latency"] = Field(
        "score", description="a request drafting with one drafter (one chain): score: the top routing score; "
        "latency: SpecRouter's choice, the drafter with the least predicted time per accepted token from the "
        "request's measured acceptance of each drafter, each drafter's measured time per token (an assisted "
        "drafter, a multi-level chain, is cheaper per token) and the measured verify cycle (speculation/chains.py), "
        "among the router's pick, the chains the request has drafted with and those of the same drafter model "
        "(which share its acceptance; one not yet timed is tried once)")

    @model_validator(mode="after")
    def _alpha_above_beta(self):
        if self.alpha < self.beta:
            raise ValueError("routing.alpha (exploration) must be >= routing.beta (exploitation)")
        return self


class IngressSpec(_Strict):
    model_name: str = Field("cosine-target", description="the model name clients send (OpenAI `model`)")
    max_queued_requests: int = Field(256, ge=1, description="beyond this, 429 with Retry-After")
    max_body_bytes: int = Field(1 << 20, ge=1024, description="larger request bodies get 413 before they are read "
                                "whole")
    api_key: str | None = Field(None, min_length=1, description="clients must send `Authorization: Bearer <key>` "
                                "(401 otherwise) on every path but /health and /metrics. Prefer the environment "
                                "variable COSINE_API_KEY of the ingress replicas (`cosine serve --api-key`): the "
                                "dashboard shows application args. Neither set: no authentication")
    retry_after_s: int = Field(1, ge=1, description="Retry-After of a 429")
    tool_call_parser: str | None = Field(None, min_length=1, description="vLLM's tool-call parser of the target's "
                                         "family (its --tool-call-parser: hermes, llama3_json, mistral, ...), for "
                                         "tool_choice auto; null: auto is refused (named and required need none). "
                                         "Checked at startup against vLLM and the tokenizer")
    reasoning_parser: str | None = Field(None, min_length=1, description="vLLM's reasoning parser (its "
                                         "--reasoning-parser: qwen3, deepseek_r1, ...): the reply's reasoning comes "
                                         "back as reasoning_content. Checked at startup against vLLM and the "
                                         "tokenizer")
    deployment: DeploymentOptions = Field(default_factory=DeploymentOptions, description="Ray Serve options")


class AppConfig(_Strict):
    tokenizer: str | None = Field(None, description="the tokenizer of the target, which every drafter must share "
                                  "(checked at startup); null: the target model's own")
    ingress: IngressSpec = Field(default_factory=IngressSpec, description="the OpenAI-compatible HTTP front")
    verifier: VerifierSpec = Field(..., description="the target model's deployment")
    drafters: list[DrafterSpec] = Field(default_factory=list, description="one deployment per drafter (domain)")
    speculation: SpeculationSpec = Field(default_factory=SpeculationSpec, description="drafting and verification")
    routing: RoutingSpec = Field(default_factory=RoutingSpec, description="which drafters draft each request")

    @field_validator("drafters")
    @classmethod
    def _unique_names(cls, v: list[DrafterSpec]) -> list[DrafterSpec]:
        names = [d.name for d in v]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"drafter names must be unique, repeated: {dupes}")
        return v

    @model_validator(mode="after")
    def _consistent(self):
        names = {d.name for d in self.drafters}
        if self.verifier.collaboration is not None:
            if self.verifier.engine != "torch":
                raise ValueError("verifier.collaboration runs in the torch engine (vLLM cannot sample from a "
                                 "combination of two models): set verifier.engine: torch")
            if self.speculation.mode != "off":
                raise ValueError("verifier.collaboration drafts with its partner inside the verifier: set "
                                 "speculation.mode: off (the drafting tier's drafts would be ignored)")
        if self.speculation.mode != "off" and not self.drafters:
            raise ValueError("speculation is on but no drafters are configured (set speculation.mode: off)")
        for n in self.speculation.fixed_drafters or []:
            if n not in names:
                raise ValueError(f"speculation.fixed_drafters names unknown drafter {n!r}; known: {sorted(names)}")
        if self.speculation.drafter is not None and self.speculation.drafter not in names:
            raise ValueError(f"speculation.drafter names unknown drafter {self.speculation.drafter!r}; known: "
                             f"{sorted(names)}")
        voters = self.speculation.vote.drafters or sorted(names)
        unknown = sorted(set(voters) - names)
        if unknown:
            raise ValueError(f"speculation.vote.drafters names unknown drafters {unknown}; known: {sorted(names)}")
        if self.speculation.mode == "vote":
            if len(set(voters)) < 2:
                raise ValueError("speculation.mode: vote needs at least two voters (with one, use mode: chain)")
        spec = self.speculation
        if spec.drafting_tier == "auto" and spec.mode != "off" and (not spec.adaptive
                                                                     or spec.controller.kind != "goodput"):
            raise ValueError("speculation.drafting_tier: auto chooses the tier from the goodput controller's verify "
                             "model and acceptance: set speculation.adaptive: true and controller.kind: goodput, or "
                             "pick a tier (deployments or colocated)")
        if self.speculation.drafting_tier == "colocated":
            scaled = [d.name for d in self.drafters if d.deployment.autoscaling_config is not None
                      or d.deployment.num_replicas != 1]
            if scaled:
                raise ValueError(f"speculation.drafting_tier: colocated runs every drafter inside the verifier's "
                                 f"replica; drafters {scaled} ask for replicas of their own (use deployments)")
        for d in self.drafters:
            if d.max_len is None:
                d.max_len = self.verifier.max_len
        if self.tokenizer is None:
            self.tokenizer = self.verifier.model
        if self.routing.drafters_per_request > max(1, len(self.drafters)):
            self.routing.drafters_per_request = max(1, len(self.drafters))
        return self


class AutoscalerSpec(_Strict):
    """The drafter autoscaler (autoscale/policy.py), an application-level Serve autoscaling policy. It is not part
    of the application's `args`: Serve gives it these fields as `autoscaling_policy.policy_kwargs`."""

    target_utilization: float = Field(0.6, gt=0, le=1, description="share of a drafter replica's time it should "
                                      "compute: lower keeps drafts quick (the verifier waits for them), higher "
                                      "uses fewer replicas")
    hysteresis: float = Field(0.25, ge=0, lt=1, description="scale down only while the remaining replicas would "
                              "stay this much below target_utilization (no flapping at a boundary)")
    smoothing: float = Field(0.5, gt=0, le=1, description="weight of the newest decision period in the smoothed "
                             "demand (Serve already averages each signal over look_back_period_s)")
    speculation_off_below: float = Field(0.05, ge=0, lt=1, description="when the verifier gives drafts to fewer "
                                         "than this share of its request rounds, speculation is off: drafters go "
                                         "to min_replicas")
    draft_wait_above: float = Field(0.2, ge=0, le=1, description="when the verifier waits for drafts more than "
                                    "this share of its time and a drafter is at target_utilization, that drafter "
                                    "gets a replica more")


def reference_markdown() -> str:
    """docs/config.md: every field of the schema with its type, default and description (`cosine config docs`)."""
    lines = ["# Configuration reference", "",
             "Generated from `config.AppConfig` by `cosine config docs > docs/config.md` (the test suite checks it is "
             "current). These are the `args` of the Serve application (`import_path: serve_app.graph:build_app`); "
             "`cosine config schema` prints the same as JSON Schema.", ""]

    from typing import get_origin

    def walk(model: type[BaseModel], prefix: str) -> None:
        nested = []
        lines.extend([f"## `{prefix or 'top level'}`", ""])
        if model.__doc__ and model.__doc__.strip() and model is not AppConfig:
            lines.extend([" ".join(model.__doc__.split()), ""])
        lines.extend(["| field | type | default | description |", "|---|---|---|---|"])
        for name, f in model.model_fields.items():
            ann = f.annotation
            sub = _model_in(ann)
            path = f"{prefix}.{name}" if prefix else name
            if sub is not None and sub is not DeploymentOptions:
                nested.append((sub, path + ("[]" if "list" in str(ann) else "")))
            default = "required" if f.is_required() else repr(f.get_default(call_default_factory=True))
            if sub is not None:
                default = "see below" if sub is not DeploymentOptions else "see `deployment`"
            typ = str(ann).replace("typing.", "") if get_origin(ann) else getattr(ann, "__name__", str(ann))
            typ = typ.replace("|", "\\|")
            desc = (f.description or "").replace("|", "\\|")
            shown = default if sub is not None else f"`{default}`"
            lines.append(f"| `{name}` | `{typ}` | {shown} | {desc} |")
        lines.append("")
        for sub, path in nested:
            walk(sub, path)

    walk(AppConfig, "")
    walk(DeploymentOptions, "deployment (of ingress, verifier, speculation and every drafter)")
    walk(AutoscalerSpec, "autoscaling_policy.policy_kwargs (the drafter autoscaler, beside `args`)")
    return "\n".join(lines)


def _model_in(annotation) -> type[BaseModel] | None:
    from typing import get_args

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for a in get_args(annotation):
        m = _model_in(a)
        if m is not None:
            return m
    return None

