"""The verify loop's recent timings and counters since start: what `speculation_stats` reports and the benchmarks read;
the service's exporter (deployments/verifier.py) adds Prometheus."""

from __future__ import annotations

from collections import Counter, deque

from engines.device_work import WORK, DeviceWork
from speculation.messages import Draft


class LoopStats:
    """Recent timings of the loop (what `speculation_stats` reports); the service's exporter adds Prometheus."""

    def __init__(self):
        self.draft_failures = 0
        self.draft_seconds: deque = deque(maxlen=128)
        self.verify_seconds: deque = deque(maxlen=128)
        self.wait_seconds: deque = deque(maxlen=128)  # per step: how long the verifier waited for its drafts
        self.step_intervals: deque = deque(maxlen=128)  # per step: from one verify's end to the next one's start
        self.recent_accepted: dict[str, deque] = {}  # drafter -> accepted length (bonus included) per draft
        self.by_drafter: dict[str, list[int]] = {}  # drafter -> [tokens of its in verified chains, those accepted]
        self.by_participation: Counter = Counter()  # Participation -> requests' rounds drafted in it
        self.totals = {"steps": 0, "verify_s": 0.0, "draft_wait_s": 0.0,  # since start, for benchmarks
                       "drafted_steps": 0,  # verify steps where some request had a draft
                       "drafted_ahead": 0, "ahead_used": 0,
                       "requests_aborted": 0,  # cancelled (a client hanging up) or failed before finishing
                       # device work in this process (engines/device_work.py): drafting rounds, their depths,
                       # the drafter forwards and host reads they cost, and the verify steps' host reads
                       "draft_rounds": 0, "draft_depths": 0, "drafter_forwards": 0, "draft_host_reads": 0,
                       "verify_host_reads": 0}
        # since start, vLLM's speculative-decoding counters (the ingress exports them under vLLM's names)
        self.spec_decode = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0,
                            "num_accepted_tokens_per_pos": []}

    def draft_round(self, seconds: float | None) -> None:
        if seconds is None:
            self.draft_failures += 1
        else:
            self.draft_seconds.append(seconds)

    def verify_step(self, seconds: float, drafts: dict[str, Draft], outs: list, in_flight: int) -> None:
        self.verify_seconds.append(seconds)
        self.totals["steps"] += 1
        self.totals["drafted_steps"] += bool(drafts)
        self.totals["verify_s"] += seconds
        spec, per_pos = self.spec_decode, self.spec_decode["num_accepted_tokens_per_pos"]
        for o in outs:
            if o.num_draft_tokens:
                spec["num_drafts"] += 1
                spec["num_draft_tokens"] += o.num_draft_tokens
                spec["num_accepted_tokens"] += o.num_accepted_tokens
                per_pos.extend([0] * (o.num_draft_tokens - len(per_pos)))
                for i in range(o.num_accepted_tokens):
                    per_pos[i] += 1
        for o in outs:
            d = drafts.get(o.request_id)
            if d is None or not d.drafters:
                continue
            for name, n in Counter(x for x in d.drafters if x).items():
                acc = sum(1 for a in o.accepted_drafters if a == name)
                self.drafter_round(name, n, acc)

    def device_round(self, depth: int, work: DeviceWork) -> None:
        """A drafting round `depth` deep cost `work` on this process's devices."""
        self.totals["draft_rounds"] += 1
        self.totals["draft_depths"] += depth
        self.totals["drafter_forwards"] += work.drafter_forwards
        self.totals["draft_host_reads"] += work.host_reads

    def device_step(self, work: DeviceWork) -> None:
        """A verify step cost `work` on this process's devices."""
        self.totals["verify_host_reads"] += work.host_reads

    def device_summary(self) -> dict:
        """Per drafting round and depth, what drafting cost the devices; graph captures after warm-up (must be 0)."""
        t = self.totals
        return {"drafter_forwards_per_depth": t["drafter_forwards"] / t["draft_depths"] if t["draft_depths"] else None,
                "host_reads_per_round": t["draft_host_reads"] / t["draft_rounds"] if t["draft_rounds"] else None,
                "host_reads_per_verify_step": t["verify_host_reads"] / t["steps"] if t["steps"] else None,
                "graph_captures_after_warmup": WORK.captures_after_warmup}

    def ahead_round(self, drafted: int, used: int) -> None:
        """Drafts made ahead during a step, and how many still extended their context after it."""
        self.totals["drafted_ahead"] += drafted
        self.totals["ahead_used"] += used

    def draft_wait(self, seconds: float) -> None:
        self.wait_seconds.append(seconds)
        self.totals["draft_wait_s"] += seconds

    def planned(self, ks: list[int], predicted_goodput: float | None) -> None:
        """The draft lengths chosen this round for the requests that may speculate (0: not this round), and the
        tokens per second the controller expects of its choice."""

    def drafter_round(self, name: str, drafted: int, accepted: int) -> None:
        self.recent_accepted.setdefault(name, deque(maxlen=200)).append(1 + accepted)
        totals = self.by_drafter.setdefault(name, [0, 0])
        totals[0] += drafted
        totals[1] += accepted

    def summary(self) -> dict:
        def mean_ms(q: deque) -> float:
            return 1000 * sum(q) / max(1, len(q))

        return {**self.device_summary(), "verify_steps": len(self.verify_seconds), "draft_fallbacks": self.draft_failures,
                "verify_ms_recent": mean_ms(self.verify_seconds), "draft_round_ms_recent": mean_ms(self.draft_seconds),
                "draft_wait_ms_recent": mean_ms(self.wait_seconds),
                "between_steps_ms_recent": mean_ms(self.step_intervals),
                "requests_aborted": self.totals["requests_aborted"],
                # since start: a client reads a run's share of steps with drafts as the difference of two reads
                "steps_since_start": self.totals["steps"], "drafted_steps_since_start": self.totals["drafted_steps"]}
