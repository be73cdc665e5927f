"""`cosine bench control-plane`: what Ray's own processes cost the served graph's throughput on this machine.

A served request passes through HAProxy and the verifier's replica only (`cosine serve --haproxy` with the OpenAI
server in the verifier's replica, `ingress.in_verifier`). Every other process of the server is Ray's control plane:
the GCS, the raylet, the dashboard with its module processes and agents, the log and autoscaler monitors, Serve's
controller, proxy actor and HAProxy manager, idle workers, the `cosine serve` driver. They share the machine's
cores with the target's step. This streams a closed-loop load at the server and, in alternating windows, pauses
every control-plane process (SIGSTOP; SIGCONT before the next window, and on any exit of the measurement), so
the same graph streams with and without them; windows last seconds, well inside Ray's health-check bounds (the
GCS and raylet pause together). Tokens per second of the replies (their token ids counted by arrival), running
against paused, is the control plane's toll; the paired ratio of each round's two windows cancels the machine's
drift. On a machine with cores to spare for Ray the toll should vanish; on the 2-core CPU it is what the served
rows of `cosine bench anchors` lose that no code of ours runs.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil

from benchmarks.common import ServedApp, config_copy, heldout_prompts
from benchmarks.metrics import save_json

DATA_PATH = ("ray::ServeReplica:", "haproxy")  # the labels (below) of the processes a request passes through


def split_processes(root: int) -> tuple[list[psutil.Process], list[psutil.Process]]:
    """(control plane, data path) among the server process `root` and its descendants as they are now: the data
    path is every Serve replica and HAProxy, the control plane everything else. ValueError where the tree has no
    replica, GCS or raylet (not a running `cosine serve`)."""
    top = psutil.Process(root)
    control, data, names = [], [], set()
    for p in [top] + top.children(recursive=True):
        name = label(p)
        if name is None:  # ended meanwhile (HAProxy is replaced at each reload, idle workers come and go)
            continue
        if name.startswith(DATA_PATH):
            data.append(p)
        else:
            control.append(p)
            names.add(name)
    if not data or not {"gcs_server", "raylet"} <= names:
        raise ValueError(f"process {root} is not a running `cosine serve` (no replica, GCS or raylet below it)")
    return control, data


def label(p: psutil.Process) -> str | None:
    """A process as the JSON names it, without this machine's paths: its title (Ray's workers and dashboard modules
    set one), else its program's and script's file names (`python dashboard.py`, `gcs_server`); None once ended."""
    try:
        args = p.cmdline() or [p.name()]
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return None
    if args[0].startswith(("ray::", "ray-dashboard-")):
        return args[0].split(" (")[0].strip()
    words = [Path(args[0]).name]
    for i, a in enumerate(args[1:], 1):
        if a == "-c" and i + 1 < len(args):
            return " ".join(words + ["-c", args[i + 1].split(";")[0][:40]])
        if not a.startswith("-"):
            return " ".join(words + [Path(a).name])
    return words[0]


def _exit_on_term(*_) -> None:
    raise SystemExit(128 + signal.SIGTERM)


def _signal(processes: list[psutil.Process], sig: int) -> None:
    for p in processes:
        try:
            p.send_signal(sig)
        except psutil.NoSuchProcess:
            pass


def measure(url: str, model: str, prompts: list[list[int]], concurrency: int, sampling: dict,
            control: list[psutil.Process], rounds: int, window_s: float, max_tokens: int = 128,
            warmup_s: float = 8.0) -> dict:
    """Tokens per second streamed by `concurrency` closed-loop clients (greedy, or `sampling` {"temperature",
    "top_p"}) in `rounds` pairs of windows of `window_s`, one with `control` running, one with it paused (the
    order alternating by round); every process resumed before this returns, however it ends (SIGTERM included)."""
    arrivals: list[tuple[float, int]] = []
    done = asyncio.Event()

    async def client(c: httpx.AsyncClient, i: int) -> None:
        while not done.is_set():
            body = {"model": model, "prompt": prompts[i % len(prompts)], "max_tokens": max_tokens,
                    "ignore_eos": True, "stream": True, "return_token_ids": True, **sampling}
            async with c.stream("POST", f"{url}/v1/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        ids = sum(len(ch.get("token_ids") or []) for ch in json.loads(line[6:])["choices"])
                        arrivals.append((time.perf_counter(), ids))
            i += concurrency

    async def window(paused: bool) -> float:
        if paused:
            _signal(control, signal.SIGSTOP)
        try:
            await asyncio.sleep(0.5)  # what was in flight when the window turned
            t0 = time.perf_counter()
            await asyncio.sleep(window_s)
            t1 = time.perf_counter()
        finally:
            if paused:
                _signal(control, signal.SIGCONT)
        return sum(n for t, n in arrivals if t0 <= t < t1) / (t1 - t0)

    async def go() -> dict:
        out: dict[str, list[float]] = {"running": [], "paused": []}
        async with httpx.AsyncClient(timeout=300) as c:
            tasks = [asyncio.create_task(client(c, i)) for i in range(concurrency)]
            try:
                await asyncio.sleep(warmup_s)
                for r in range(rounds):
                    for paused in ((False, True) if r % 2 == 0 else (True, False)):
                        out["paused" if paused else "running"].append(await window(paused))
                        failed = [t.exception() for t in tasks if t.done() and t.exception()]
                        if failed:
                            raise failed[0]
            finally:
                done.set()
                await asyncio.gather(*tasks, return_exceptions=True)
        return out

    # SIGTERM ends the run through the `finally`s (Python's default would exit leaving the control plane stopped)
    main_thread = threading.current_thread() is threading.main_thread()
    before = signal.signal(signal.SIGTERM, _exit_on_term) if main_thread else None
    try:
        out = asyncio.run(go())
    finally:
        _signal(control, signal.SIGCONT)
        if main_thread:
            signal.signal(signal.SIGTERM, before)
    pairs = [a / b for a, b in zip(out["running"], out["paused"]) if b > 0]
    return out | {"ratio_of_medians": statistics.median(out["running"]) / statistics.median(out["paused"]),
                  "paired_ratios": pairs, "paired_median": statistics.median(pairs)}


def run(config: str, concurrencies: list[int], temperatures: list[float], top_p: float, rounds: int,
        window_s: float, port: int, log=print) -> dict:
    from transformers import AutoTokenizer

    from model_family.paths import model_path

    prompts = [p for _, p in heldout_prompts(AutoTokenizer.from_pretrained(model_path("tokenizer")), 4, 64)]
    with tempfile.TemporaryDirectory(prefix="cosine-control-plane-") as work:
        log(f"serving {config} (--haproxy, ingress.in_verifier) ...")
        served_config = config_copy(config, Path(work) / f"control-plane-{Path(config).stem}.yaml",
                                    lambda args: args.setdefault("ingress", {}).update(in_verifier=True))
        served = ServedApp(served_config, port, port + 1, haproxy=True)
        try:
            control, data = split_processes(served.proc.pid)
            log(f"data path: {sorted(filter(None, map(label, data)))}; pausing {len(control)} control-plane processes")
            cells = []
            for t in temperatures:
                sampling = {"temperature": t, "top_p": top_p if t > 0 else 1.0}
                for c in concurrencies:
                    log(f"[concurrency {c}, temperature {t}] {rounds} rounds of {window_s:.0f} s windows")
                    cell = measure(served.url, served.model, prompts, c, sampling, control, rounds, window_s)
                    cells.append({"concurrency": c, **sampling} | cell)
                    log(f"  running {statistics.median(cell['running']):.1f} tok/s, paused "
                        f"{statistics.median(cell['paused']):.1f}: {cell['paired_median']:.3f}x")
            names = sorted(filter(None, map(label, control)))
        finally:
            served.stop()
    return {"config": {"base": config, "layout": "cosine serve --haproxy, ingress.in_verifier", "rounds": rounds,
                       "window_s": window_s, "max_tokens": 128, "cpus": os.cpu_count()},
            "control_plane": names, "cells": cells}


def format_table(result: dict) -> str:
    lines = ["| concurrency | sampling | tok/s, control plane running (min-max) | paused (min-max) | running / "
             "paused, paired by round (min-max) |", "|---|---|---|---|---|"]
    for c in result["cells"]:
        samp = "greedy" if c["temperature"] == 0 else f"T = {c['temperature']}, top_p {c['top_p']}"
        run_, pau, pr = c["running"], c["paused"], c["paired_ratios"]
        lines.append(f"| {c['concurrency']} | {samp} | {statistics.median(run_):.1f} ({min(run_):.1f}-{max(run_):.1f})"
                     f" | {statistics.median(pau):.1f} ({min(pau):.1f}-{max(pau):.1f}) | {c['paired_median']:.3f}x "
                     f"({min(pr):.3f}-{max(pr):.3f}) |")
    return "\n".join(lines)


def main(args) -> int:
    result = run(args.config, args.concurrency, args.temperatures, args.top_p, args.rounds, args.window, args.port)
    save_json(result, args.json)
    print(format_table(result))
    return 0
