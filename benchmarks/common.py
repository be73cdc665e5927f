"""What the benchmarks share: held-out prompts, the models loaded as the benchmarks run them, a result row with its
median over repeats, and the servers under test (`cosine serve`, and `vllm serve` beside it, on loopback ports
with an HTTP client).

Every benchmark imports these from here; none reaches into another benchmark's module."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from itertools import pairwise
from pathlib import Path

import httpx

from model_family import DOMAINS


def load_model(path: Path, packed: bool = False, device: str = "cpu", dtype=None):
    """A model for inference, in fp32 unless `dtype` says otherwise; `packed`: its linear layers in the CPU kernels'
    packed layout."""
    import torch
    from transformers import AutoModelForCausalLM

    from engines.cpu_kernels import pack_linear_modules

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32).eval().to(device)
    return pack_linear_modules(model) if packed else model


def heldout_prompts(tokenizer, per_domain: int, length: int) -> list[tuple[str, list[int]]]:
    """(domain, the first `length` tokens of a held-out text) for `per_domain` texts of every domain."""
    from model_family.samples import heldout_texts

    texts = heldout_texts()
    out = []
    for d in DOMAINS:
        for t in texts[d][:per_domain]:
            out.append((d, tokenizer(t, add_special_tokens=False).input_ids[:length]))
    return out


def cell(value, fmt: str = "{:.2f}") -> str:
    """A table cell: `value` formatted, or "-" where a system has no such figure."""
    return "-" if value is None else fmt.format(value)


def tps_cell(row: dict) -> str:
    """A row's tokens/s cell: the median run's, with the min-max over the repeats."""
    return f"{row['tokens_per_s']:.1f} ({row['tokens_per_s_min']:.1f}-{row['tokens_per_s_max']:.1f})"


def paired(row: dict, base: dict) -> dict | None:
    """`row` against `base` repeat by repeat: the ratio of their tokens/s in each repeat (run back to back, so a
    machine that slows down between repeats slows both), the median and range of those ratios."""
    ours, theirs = row.get("tokens_per_s_by_repeat"), base.get("tokens_per_s_by_repeat")
    if not ours or not theirs or len(ours) != len(theirs):
        return None
    ratios = [round(o / b, 3) for o, b in zip(ours, theirs)]
    return {"median": round(statistics.median(ratios), 3), "min": min(ratios), "max": max(ratios),
            "by_repeat": ratios}


@dataclass
class Row:
    method: str
    batch: int
    tokens: int
    seconds: float
    tokens_per_s: float  # the median run's
    mean_accepted_length: float | None
    target_passes_per_token: float | None
    rounds: int | None = None
    forward_seconds: float | None = None  # the verifier's forward passes: this run's time with free drafting
    draft_ms_per_round: float | None = None  # per verify step, the time the loop waited for drafts
    verify_ms_per_round: float | None = None
    overhead_ms_per_round: float | None = None
    drafting_ms_per_round: float | None = None  # the drafting tier's own time per round (routing, drafters, fusion)
    drafting_ms_per_drafted_token: float | None = None  # the same per draft token verified
    speedup_vs_target: float | None = None
    identical_to_target: bool | None = None
    limit_speedup: float | None = None
    efficiency: float | None = None
    tokens_per_s_min: float | None = None  # over the repeats
    tokens_per_s_max: float | None = None
    tokens_per_s_by_repeat: list[float] | None = None  # every repeat's, in run order
    runs: int = 1
    # device work (engines/device_work.py): drafter forwards per drafting depth, host reads (syncs on a GPU) per
    # drafting round and per verify step, CUDA graph captures during the run (0 after warm-up)
    drafter_forwards_per_depth: float | None = None
    host_reads_per_round: float | None = None
    host_reads_per_verify_step: float | None = None
    graph_captures: int | None = None
    guard_switched_off: int | None = None  # times the guard switched speculation off (speculation/guard.py)


def median_row(rows: list[Row]) -> Row:
    """The median run by tokens/s (a copy: `rows` are left as they are, so a summary after each repeat reads every
    run's own figure), with the spread of all runs and every run's tokens/s in the order of `rows`."""
    ordered = sorted(rows, key=lambda r: r.tokens_per_s)
    mid = replace(ordered[(len(ordered) - 1) // 2], tokens_per_s_by_repeat=[r.tokens_per_s for r in rows])
    mid.tokens_per_s = round(statistics.median(r.tokens_per_s for r in rows), 1)
    mid.tokens_per_s_min, mid.tokens_per_s_max, mid.runs = ordered[0].tokens_per_s, ordered[-1].tokens_per_s, len(rows)
    return mid


ALLOW_BUSY = "COSINE_BENCH_ALLOW_BUSY"  # =1: start while other benchmarks or tests run (the tests' own runs)


class MachineBusy(RuntimeError):
    pass


@contextmanager
def machine_load() -> Iterator[dict]:
    """The machine's load averages (1, 5 and 15 minutes) when a benchmark starts and when it ends, for its JSON: a
    run that shared its cores says so."""
    load = {"logical_cores": os.cpu_count(), "start": [round(x, 2) for x in os.getloadavg()]}
    try:
        yield load
    finally:
        load["end"] = [round(x, 2) for x in os.getloadavg()]


def is_other_run(argv: list[str]) -> bool:
    """A `cosine bench ...` (or `python -m serve_app.cli bench ...`) or a pytest command line."""
    names = [Path(a).name for a in argv]
    if "pytest" in names or "py.test" in names or ("-m" in argv and "pytest" in argv):
        return True
    return any(a in ("cosine", "serve_app.cli") and b == "bench" for a, b in pairwise(names))


def _processes(proc: Path) -> dict[int, tuple[int, list[str]]]:
    """pid -> (parent pid, command line) of every process /proc shows."""
    out = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:  # gone meanwhile, or not ours to read
            continue
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])  # after the command name, which may hold spaces
        out[int(entry.name)] = (ppid, [a.decode(errors="replace") for a in argv if a])
    return out


def _ancestry(pid: int, procs: dict[int, tuple[int, list[str]]]) -> list[int]:
    """pid, its parent, its parent's parent ... up to the first process /proc does not show."""
    chain = []
    while pid in procs and pid not in chain:
        chain.append(pid)
        pid = procs[pid][0]
    return chain


def other_runs(proc: Path = Path("/proc")) -> list[str]:
    """The command lines of benchmarks and test runs on this machine outside this process's own tree: not this
    process, not one that started it (a pytest running this benchmark), not one it started."""
    procs, me = _processes(proc), os.getpid()
    ancestors = set(_ancestry(me, procs))
    return [" ".join(argv) for pid, (_, argv) in sorted(procs.items())
            if is_other_run(argv) and pid not in ancestors and me not in _ancestry(pid, procs)]


def refuse_if_busy() -> None:
    """Refuse to start a benchmark while another benchmark or the test suite runs here: they take the cores it
    measures. COSINE_BENCH_ALLOW_BUSY=1 overrides."""
    if os.environ.get(ALLOW_BUSY) == "1":
        return
    busy = other_runs()
    if busy:
        raise MachineBusy("another benchmark or test run is using this machine (set COSINE_BENCH_ALLOW_BUSY=1 to "
                          "run anyway):\n" + "\n".join(busy))


def reap(proc: subprocess.Popen, timeout_s: float, tmp: str | None = None) -> None:
    """Wait for a process told to stop (killed after `timeout_s`), then remove its temp dir `tmp`."""
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    if tmp is not None:
        shutil.rmtree(tmp, ignore_errors=True)


def wait_until_serving(url: str, proc: subprocess.Popen, what: str, timeout_s: float = 600) -> None:
    """Until the OpenAI server at `url` lists its models; RuntimeError if `proc` exits first or it takes too long."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited ({proc.returncode})")
        try:
            if httpx.get(f"{url}/v1/models", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(3)
    raise RuntimeError(f"{what} did not come up in {timeout_s:.0f} s")


def config_copy(config: str, path: Path, edit: Callable[[dict], None]) -> str:
    """A copy of the Serve config `config` at `path`, its first application's args changed in place by `edit`."""
    import yaml

    cfg = yaml.safe_load(Path(config).read_text())
    edit(cfg["applications"][0].setdefault("args", {}))
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


class ServedApp:
    """`cosine serve CONFIG` on loopback ports of its own (`haproxy`: `--haproxy`), and a closed-loop HTTP client."""

    def __init__(self, config: str, port: int, dashboard_port: int, haproxy: bool = False):
        self.url = f"http://127.0.0.1:{port}"
        cli = Path(sys.executable).with_name("cosine")
        self.proc = subprocess.Popen([str(cli), "serve", config, "--port", str(port), "--dashboard-port",
                                      str(dashboard_port)] + ["--haproxy"] * haproxy,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_until_serving(self.url, self.proc, "cosine serve")
        self.model = httpx.get(f"{self.url}/v1/models", timeout=5).json()["data"][0]["id"]

    def run(self, prompts, concurrency, max_tokens, domains, sampling: dict | None = None) -> dict:
        """`stream_completions` of `prompts` against this server (`domains`: unused, the server routes), with what
        the in-process rows report of the guard and the drafting rounds (`served_speculation`)."""
        before = self.speculation_stats()
        out = stream_completions(self.url, self.model, prompts, concurrency, max_tokens, sampling)
        return out | served_speculation(before, self.speculation_stats())

    def speculation_stats(self) -> dict:
        return httpx.get(f"{self.url}/v1/internal/speculation_stats", timeout=30).json()

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        reap(self.proc, 120)


def served_speculation(before: dict, after: dict) -> dict:
    """What the in-process rows report of a run, from the served graph's speculation statistics read before and
    after it (its counts since start differenced): the share of verify steps with drafts and the guard's verdicts
    against speculation (where it has a guard), and the drafting tier's rounds in this replica: their seconds, the
    drafter models' forwards and seconds, the requests' rounds by participation (where the verifier drafts in its
    own process, `drafting_tier: colocated`)."""
    out = {}
    guard, was = (after.get("controller") or {}).get("guard"), (before.get("controller") or {}).get("guard")
    if guard is not None and was is not None:
        steps = after["steps_since_start"] - before["steps_since_start"]
        out |= {"drafted_step_share": (after["drafted_steps_since_start"] - before["drafted_steps_since_start"])
                / max(1, steps), "guard_switched_off": guard["switched_off"] - was["switched_off"],
                "guard_by_batch": guard["by_batch"]}
    if "drafter_forwards_since_start" in after and "rounds" in after:
        parts, parts_was = after["by_participation_since_start"], before["by_participation_since_start"]
        out |= {"draft_s": after["step_seconds"] - before["step_seconds"],
                "draft_rounds": after["rounds"] - before["rounds"],
                "drafter_forwards": after["drafter_forwards_since_start"] - before["drafter_forwards_since_start"],
                "draft_forward_s": after["drafter_forward_s_since_start"] - before["drafter_forward_s_since_start"],
                "by_participation": {p: n - parts_was.get(p, 0) for p, n in parts.items()
                                     if n > parts_was.get(p, 0)}}
    return out


class VllmServe:
    """`vllm serve` on the bench target, on a loopback port: vLLM's OpenAI server as its users run it (its API server
    and engine core in processes of their own), with our engine's arguments (fp32, eager on this CPU, the same
    batch, length and KV cache), and the closed-loop HTTP client `ServedApp` has. `draft`: its own speculation,
    `draft_model` with that shipped drafter and `k` tokens a step (a run's drafts and accepted tokens read from its
    Prometheus counters around the run)."""

    def __init__(self, port: int, max_batch: int, max_len: int, log_path: Path, draft: str | None = None, k: int = 0):
        from model_family.paths import model_path

        self.url = f"http://127.0.0.1:{port}"
        self.draft = draft
        self.tmp = tempfile.mkdtemp(prefix="cosine-vllm-serve-")  # vLLM leaves its rendezvous file (vllm_dist_*) there
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", TMPDIR=self.tmp)
        spec = ["--speculative-config", json.dumps({"method": "draft_model", "num_speculative_tokens": k,
                                                    "model": str(model_path(f"drafter-{draft}"))})] if draft else []
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
                                          str(model_path("bench-target")), "--host", "127.0.0.1", "--port", str(port),
                                          "--dtype", "float32", "--max-model-len", str(max_len), "--max-num-seqs",
                                          str(max_batch), "--enforce-eager", "--served-model-name", "bench-target",
                                          *spec], stdout=log, stderr=subprocess.STDOUT, env=env)
        self.model = "bench-target"
        try:
            wait_until_serving(self.url, self.proc, f"vllm serve (its log: {log_path})")
        except BaseException:
            self.stop()
            raise

    def run(self, prompts, concurrency, max_tokens, domains, sampling: dict | None = None) -> dict:
        """`stream_completions` of `prompts` against vLLM's server (`domains`: unused), with its speculation's
        drafts, draft tokens and accepted tokens over the run."""
        before = self.spec_counts() if self.draft else {}
        out = stream_completions(self.url, self.model, prompts, concurrency, max_tokens, sampling)
        if self.draft:
            after = self.spec_counts()
            out |= {key: int(after[key] - before[key]) for key in after}
        return out

    def spec_counts(self) -> dict[str, float]:
        """vLLM's speculation counters since start: {"drafts", "draft_tokens", "accepted"}."""
        from prometheus_client.parser import text_string_to_metric_families

        names = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens": "accepted"}
        out = dict.fromkeys(names.values(), 0.0)
        for family in text_string_to_metric_families(httpx.get(f"{self.url}/metrics", timeout=30).text):
            if family.name in names:  # a counter's family is named without `_total`, its samples with it
                out[names[family.name]] += sum(s.value for s in family.samples if s.name.endswith("_total"))
        return out

    def stop(self) -> None:
        self.proc.terminate()
        reap(self.proc, 60, self.tmp)


def rotated(interleaved: list[tuple[str, int]], rep: int) -> list[tuple[str, int]]:
    """Repeat `rep`'s order: each concurrency's systems in turn, as in `interleaved`, each concurrency's list
    rotated by `rep`, so that no system always runs first (after the other concurrency's runs) or right after the
    same neighbour."""
    out = []
    for c in dict.fromkeys(c for _, c in interleaved):
        group = [x for x in interleaved if x[1] == c]
        shift = rep % len(group)
        out += group[shift:] + group[:shift]
    return out


def stream_completions(url: str, model: str, prompts: list[list[int]], concurrency: int, max_tokens: int,
                       sampling: dict | None = None, extra: dict | None = None) -> dict:
    """Closed-loop streamed completions of `prompts` (token ids, ignore_eos) from an OpenAI-compatible server,
    `concurrency` at a time: every request streamed, as vLLM's own serving benchmark does and as most clients do, so
    each chunk's arrival gives the request's time to first token and the intervals between its chunks.
    `sampling`: {"temperature", "top_p", "seeds": one per prompt or None}; greedy without it; `extra`: more fields of
    every request's body. Returns the outputs' texts and token ids, seconds per request, latencies, each chunk's
    arrival (perf_counter), the wall time and the speculation counts of the usage."""
    from benchmarks.workers import latencies

    sampling = sampling or {"temperature": 0, "top_p": 1.0, "seeds": None}

    async def one(client: httpx.AsyncClient, i: int, p: list[int]):
        body = {"model": model, "prompt": p, "max_tokens": max_tokens, "ignore_eos": True,
                "temperature": sampling["temperature"], "top_p": sampling["top_p"],
                "seed": sampling["seeds"][i] if sampling["seeds"] else None, "return_token_ids": True,
                "stream": True, "stream_options": {"include_usage": True}, **(extra or {})}
        t, text, ids, arrivals, usage = time.perf_counter(), [], [], [], {}
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(f"request {i} failed: {chunk['error']}")
                usage = chunk.get("usage") or usage
                for choice in chunk["choices"]:
                    text.append(choice.get("text") or "")
                    if choice.get("token_ids"):
                        ids += choice["token_ids"]
                        arrivals.append(time.perf_counter())
        return {"text": "".join(text), "ids": ids, "usage": usage, "seconds": time.perf_counter() - t,
                "latency": latencies(t, arrivals), "arrivals": arrivals}

    async def go():
        sem = asyncio.Semaphore(concurrency)
        async with httpx.AsyncClient(timeout=600) as client:
            async def limited(i, p):
                async with sem:
                    return await one(client, i, p)

            t0 = time.perf_counter()
            res = await asyncio.gather(*(limited(i, p) for i, p in enumerate(prompts)))
            return res, time.perf_counter() - t0

    res, wall = asyncio.run(go())
    # the output check compares the text with the reference's decoded text, as a client reads it
    return {"texts": [r["text"] for r in res], "outputs": [r["ids"] for r in res],
            "seconds": [r["seconds"] for r in res], "latency": [r["latency"] for r in res],
            "arrivals": [r["arrivals"] for r in res], "wall": wall,
            "drafts": sum(r["usage"].get("num_drafts", 0) for r in res),
            "accepted": sum(r["usage"].get("num_accepted_tokens", 0) for r in res),
            "draft_tokens": sum(r["usage"].get("num_draft_tokens", 0) for r in res),
            "steps": sum(r["usage"].get("verify_steps", 0) for r in res)}
