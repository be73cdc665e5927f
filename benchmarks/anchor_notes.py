"""The notes under a `cosine bench anchors` table: each ratio paired by repeat, what the guard let through, which
drafters drafted and in which participations (ours in process), from the rows `benchmarks/anchors.py` builds."""

from __future__ import annotations

from benchmarks.common import cell


def by_drafter(runs: list[dict]) -> dict[str, dict] | None:
    """Each drafter's share of the drafted tokens that reached verification over `runs`, and its acceptance rate."""
    if not any(r.get("by_drafter") for r in runs):
        return None
    sums: dict[str, list[int]] = {}
    for r in runs:
        for name, (drafted, accepted) in r["by_drafter"].items():
            s = sums.setdefault(name, [0, 0])
            s[0], s[1] = s[0] + drafted, s[1] + accepted
    total = sum(d for d, _ in sums.values()) or 1
    return {n: {"drafted_share": round(d / total, 3), "accepted_rate": round(a / d, 3) if d else None}
            for n, (d, a) in sorted(sums.items(), key=lambda kv: -kv[1][0]) if d}


def summed(counts: list[dict[str, int]]) -> dict[str, int] | None:
    out: dict[str, int] = {}
    for c in counts:
        for k, n in c.items():
            out[k] = out.get(k, 0) + n
    return dict(sorted(out.items(), key=lambda kv: -kv[1])) or None


def paired_line(row: dict) -> str:
    p = row["paired_vs_vllm_target_only"]
    return (f"- {row['system']} / vLLM target-only, concurrency {row['concurrency']}, paired by repeat: "
            f"{p['median']:.2f}x ({p['min']:.2f}-{p['max']:.2f}; {', '.join(f'{x:.2f}' for x in p['by_repeat'])})")


def guard_line(row: dict) -> str:
    """What the guard let through in a row of ours (served: read from the server's statistics before and after each
    run, `served_speculation`): steps with drafts and its verdicts, per run."""
    share = ", ".join(f"{x:.0%}" for x in row["drafted_step_share"])
    offs = ", ".join(str(x) for x in row["guard_switched_off"] or [])
    loads = ", ".join(f"{n}: {'on' if g['speculating'] else 'off'}" for n, g in (row["guard_by_batch"] or {}).items())
    return (f"- {row['system']}, concurrency {row['concurrency']}: steps with drafts per run {share}; "
            f"speculation switched off {offs or '-'} times per run by the guard; after the last run, by load: "
            f"{loads or '-'}")


def rounds_line(row: dict) -> str:
    """Where a row's drafting round went: the drafter models' forwards (how many, how long) and the host work left
    (the coordinator's routing and fusion, the drafter servers' syncs and proposals, the thread hops)."""
    per, fwd = row["draft_ms_per_round"], row["draft_forward_ms_per_round"]
    return (f"- {row['system']}, concurrency {row['concurrency']}: a drafting round {per:.2f} ms: "
            f"{row['drafter_forwards_per_round']:.2f} drafter forwards taking {fwd:.2f} ms, host work "
            f"{per - fwd:.2f} ms")


def drafters_line(row: dict) -> str:
    """Which drafters drafted a row's verified tokens: each one's share of them and how many were accepted."""
    parts = ", ".join(f"{n} {d['drafted_share']:.0%} ({cell(d['accepted_rate'], '{:.2f}')} accepted)"
                      for n, d in row["by_drafter"].items())
    calib = ", ".join(f"{n} {f:.2f}" for n, f in (row.get("model_free_calibration") or {}).items())
    return (f"- {row['system']}, concurrency {row['concurrency']}: drafted tokens by drafter: {parts}"
            + (f"; model-free confidences scaled by {calib} (accepted over claimed)" if calib else ""))


def participation_line(row: dict) -> str:
    """How a row's requests drafted their rounds: each participation's share of them (the goodput controller's
    choice, its probes included)."""
    total = sum(row["by_participation"].values())
    parts = ", ".join(f"{p} {n / total:.0%}" for p, n in row["by_participation"].items())
    return f"- {row['system']}, concurrency {row['concurrency']}: requests' rounds by participation: {parts}"
