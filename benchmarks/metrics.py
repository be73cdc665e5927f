"""Sampling the application's Prometheus metrics during a benchmark, and rendering them as plots for the docs.

Ray's metrics agent serves every node's metrics at `http://NODE:METRICS_EXPORT_PORT/metrics` (start the head
with `ray start --head --metrics-export-port=8080`). `MetricsSampler` scrapes it every `interval` seconds in a
background thread and keeps the CoSine series (names containing `cosine_`); `render` turns a run's samples into
PNG plots: throughput, acceptance per drafter, verify and drafter step latency, requests in flight.
"""

from __future__ import annotations

import json
import threading
import time
from collections import defaultdict
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.provenance import with_provenance


def save_json(result: dict, path: str) -> None:
    """A benchmark's result as JSON at `path` (its folder made), with its provenance, and where it went."""
    out = with_provenance(result)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(out, indent=2))
    print(f"wrote {path}")


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted label items): value} for the CoSine metrics at `url`."""
    text = httpx.get(url, timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if "cosine_" in s.name:
                labels = tuple(sorted((k, v) for k, v in s.labels.items() if k in ("drafter", "le")))
                out[(s.name, labels)] = out.get((s.name, labels), 0.0) + s.value  # summed over replicas
    return out


class MetricsSampler:
    def __init__(self, url: str, interval: float = 2.0):
        self.url, self.interval = url, interval
        self.samples: list[tuple[float, dict]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.errors = 0

    def _run(self) -> None:
        t0 = time.time()
        while not self._stop.is_set():
            try:
                self.samples.append((time.time() - t0, scrape(self.url)))
            except Exception:  # noqa: BLE001 - a missed scrape is a gap in the plot, not a failed benchmark
                self.errors += 1
            self._stop.wait(self.interval)

    def __enter__(self) -> "MetricsSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def series(self) -> list[dict]:
        """JSON-friendly samples: [{"t": seconds, "values": {"name{labels}": value}}]."""
        return [{"t": round(t, 2), "values": {_key(n, lab): v for (n, lab), v in vals.items()}}
                for t, vals in self.samples]


def _key(name: str, labels: tuple) -> str:
    return name + ("{" + ",".join(f"{k}={v}" for k, v in labels) + "}" if labels else "")


def _find(values: dict, stem: str, suffix: str = "") -> dict[str, float]:
    """Series whose name contains `stem` and ends (before labels) with `suffix`: {label string: value}."""
    out = {}
    for key, v in values.items():
        name, _, labels = key.partition("{")
        if stem in name and name.endswith(suffix):
            out[labels.rstrip("}")] = v
    return out


WINDOW_S = 20.0  # Ray's agent exports every few seconds: rates over a window, not between consecutive scrapes


def _pairs(samples: list[dict], window: float = WINDOW_S):
    """(earlier, later) sample pairs about `window` seconds apart."""
    j = 0
    for b in samples:
        while j + 1 < len(samples) and samples[j + 1]["t"] <= b["t"] - window:
            j += 1
        if b["t"] - samples[j]["t"] >= window:
            yield samples[j], b


def _rates(samples: list[dict], stem: str, suffix: str = "_total") -> dict[str, list[tuple[float, float]]]:
    """Per-second rates of a counter over a sliding window, per label set."""
    out: dict[str, list] = defaultdict(list)
    for a, b in _pairs(samples):
        dt = b["t"] - a["t"]
        va, vb = _find(a["values"], stem, suffix), _find(b["values"], stem, suffix)
        for lab, v in vb.items():
            if dt > 0 and lab in va:
                out[lab].append((b["t"], max(0.0, v - va[lab]) / dt))
    return out


def _ratio(samples, num: tuple[str, str], den: tuple[str, str], offset: float = 0.0):
    """Windowed ratio of two counters' increases, per label set: num and den are (stem, suffix), e.g. accepted /
    drafted tokens, or a histogram's sum / count (its mean)."""
    out: dict[str, list] = defaultdict(list)
    for a, b in _pairs(samples):
        na, nb = _find(a["values"], *num), _find(b["values"], *num)
        da, db = _find(a["values"], *den), _find(b["values"], *den)
        for lab in db:
            d = db[lab] - da.get(lab, 0.0)
            if d > 0:
                out[lab].append((b["t"], offset + (nb.get(lab, 0.0) - na.get(lab, 0.0)) / d))
    return out


def _hist_mean(samples, stem) -> dict[str, list[tuple[float, float]]]:
    return _ratio(samples, (stem, "_sum"), (stem, "_count"))


def require_plotting(asked: bool) -> None:
    """Refuse a run that was asked for a plot before it starts, where matplotlib (the `docs` extra) is missing: the
    run would otherwise end in a traceback after its work."""
    import importlib.util

    if asked and importlib.util.find_spec("matplotlib") is None:
        raise ValueError("a plot needs matplotlib, which is not installed: pip install -e '.[docs]' (or run without "
                         "the plot option)")


def render(samples: list[dict], out_dir: Path, title: str = "") -> list[Path]:
    """PNG plots of one run's samples (needs matplotlib: `pip install -e .[docs]`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    panels = [
        ("tokens/s to clients", _rates(samples, "cosine_generated_tokens")),
        ("draft acceptance rate, by drafter", _ratio(samples, ("cosine_accepted_tokens", "_total"),
                                                                   ("cosine_draft_tokens", "_total"))),
        ("mean accepted length, by drafter", _ratio(samples, ("cosine_accepted_tokens", "_total"),
                                                                  ("cosine_drafts", "_total"), offset=1.0)),
        ("verify step, mean ms", _hist_mean(samples, "cosine_verify_latency_ms")),
        ("drafter step (hops included), mean ms", _hist_mean(samples, "cosine_drafter_step_ms")),
        ("requests in flight (verifier)", {"": [(s["t"], v) for s in samples
                                               for v in _find(s["values"], "cosine_requests_in_flight").values()]}),
    ]
    fig, axes = plt.subplots(3, 2, figsize=(12, 10), sharex=True)
    for ax, (name, series) in zip(axes.flat, panels):
        for lab, pts in sorted(series.items()):
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, label=lab.replace("drafter=", "") or None, linewidth=1.2)
        ax.set_title(name, fontsize=10)
        ax.grid(alpha=0.3)
        if any(lab for lab in series):
            ax.legend(fontsize=7, ncol=2)
    for ax in axes[-1]:
        ax.set_xlabel("seconds into the benchmark")
    fig.suptitle(title or "CoSine Serve metrics (Prometheus, scraped from Ray's metrics agent)")
    fig.tight_layout()
    path = out_dir / "serve_metrics.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]
