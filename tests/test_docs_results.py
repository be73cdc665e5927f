"""The docs' results can be checked: every raw-data file they name as present exists, data said to be "not kept"
comes with where its history is, every table of docs/benchmarks.md is rendered from the JSON its section names, and
the README's headline table is rendered from the latest committed runs, refusing noisy baselines.

Fast (reads six markdown files); no marks."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ["docs/benchmarks.md", "docs/simulation.md", "docs/model_card.md", "README.md", "docs/design.md",
        "docs/operations.md"]
PATH_RE = re.compile(r"bench_results/[\w./-]+\.json|models/[\w-]+\.json")
LOST = "not kept"  # the docs' wording for data that is gone: "its raw JSON was not kept (...)", "data not kept"
# ... and where a reader finds what is left of it: the history (docs/benchmarks-history.md, bench_results/history/,
# a commit in the repository's history)
PLACE = re.compile(r"history")
# An output a command writes is not named as present: `--json PATH` in a command line, "writes `PATH`" in prose.
OUTPUT_BEFORE = re.compile(r"(--json\s+|writes\s+`?)$")


def _read(rel: str) -> str:
    return (ROOT / rel).read_text(encoding="utf-8")


def _paths_named(line: str) -> list[str]:
    """The raw files a line names as present (not the outputs its commands write)."""
    return [m.group(0) for m in PATH_RE.finditer(line) if not OUTPUT_BEFORE.search(line[:m.start()])]


def _named_as_present(rel: str) -> list[tuple[int, str]]:
    found = []
    for n, line in enumerate(_read(rel).splitlines(), 1):
        if LOST in line:
            continue
        found += [(n, p) for p in _paths_named(line)]
    return found


@pytest.mark.parametrize("rel", DOCS)
def test_every_raw_file_named_as_present_exists(rel):
    missing = [f"{rel}:{n}: {p}" for n, p in _named_as_present(rel) if not (ROOT / p).is_file()]
    assert not missing, "named as present but not in the repository (say it \"was not kept\"):\n" + "\n".join(missing)


def _paragraphs(text: str) -> list[str]:
    """Paragraphs, list items and table rows of a markdown text, each as one line; code blocks left out."""
    out, para, fence = [], [], False
    for line in text.splitlines() + [""]:
        if line.startswith("```"):
            fence = not fence
            continue
        if fence:
            continue
        new_item = line.startswith("|") or re.match(r"\s*(- |\d+\. |#)", line) or not line.strip()
        if new_item and para:
            out.append(" ".join(para))
            para = []
        if line.startswith("|"):
            out.append(line)
        elif line.strip():
            para.append(line.strip())
    return out


@pytest.mark.parametrize("rel", DOCS)
def test_data_not_kept_says_where_its_history_is(rel):
    """A paragraph that says a run's data was not kept names where what is left of it is: the history (its tables
    in docs/benchmarks-history.md, its JSON in bench_results/history/ or at a commit of the repository's history)."""
    bad = [p[:200] for p in _paragraphs(_read(rel)) if LOST in p and not PLACE.search(p)]
    assert not bad, f"{rel}: data not kept, its place not named:\n" + "\n".join(bad)


def test_the_not_kept_check_reads_paragraphs():
    text = "Intro.\n\nIts JSON was not kept;\nthe tables are in the history.\n\n- One 1.2x, data not kept.\n"
    assert [p for p in _paragraphs(text) if LOST in p and not PLACE.search(p)] == ["- One 1.2x, data not kept."]


def _sections(text: str) -> list[tuple[str, str]]:
    """(heading, body up to the next heading of any level); code blocks are not headings."""
    out, head, body, fence = [], "", [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fence = not fence
        if not fence and re.match(r"#{1,6} ", line):
            out.append((head, "\n".join(body)))
            head, body = line, []
        else:
            body.append(line)
    out.append((head, "\n".join(body)))
    return out


@pytest.mark.parametrize("rel", ["docs/benchmarks.md", "docs/simulation.md"])
def test_a_section_naming_a_lost_file_says_so(rel):
    """A command's output file that is not in the repository needs the section's "was not kept" line."""
    bad = []
    for head, body in _sections(_read(rel)):
        lost = sorted({p for line in body.splitlines() for p in _paths_named(line) if not (ROOT / p).is_file()})
        if lost and LOST not in body:
            bad.append(f"{head}: {', '.join(lost)}")
    assert not bad, "sections naming raw files that are not in the repository without saying so:\n" + "\n".join(bad)


def test_every_table_in_the_benchmarks_doc_has_its_raw_data_committed():
    """docs/benchmarks.md holds the current answer per benchmark, each table with the JSON behind it: a section with a
    table names a committed JSON file, and no raw file of it is lost (those runs' tables are in the history)."""
    bad = []
    for head, body in _sections(_read("docs/benchmarks.md")):
        if not _tables(body):
            continue
        if "was not kept" in body or not any((ROOT / p).is_file() for p in PATH_RE.findall(body)):
            bad.append(head)
    assert not bad, "tables without their committed JSON (re-run, or move the table to the history):\n" + "\n".join(bad)


# --- the README's headline results -------------------------------------------------------------------------------

def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = heading.lstrip("#").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _tables(body: str) -> list[list[dict[str, str]]]:
    """Markdown tables as rows keyed by header; a repeated header name gets " #2", " #3"."""
    tables, lines = [], body.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("|") and i + 1 < len(lines) and re.match(r"\|(\s*:?-+:?\s*\|)+\s*$", lines[i + 1]):
            header, seen = [], {}
            for h in _cells(lines[i]):
                seen[h] = seen.get(h, 0) + 1
                header.append(h if seen[h] == 1 else f"{h} #{seen[h]}")
            rows, i = [], i + 2
            while i < len(lines) and lines[i].startswith("|"):
                rows.append(dict(zip(header, _cells(lines[i]))))
                i += 1
            tables.append(rows)
        else:
            i += 1
    return tables


def _benchmark_sections() -> dict[str, str]:
    return {_slug(h): body for h, body in _sections(_read("docs/benchmarks.md")) if h}


NUM = r"(\d+(?:\.\d+)?)"


def _lead(cell: str) -> str:
    m = re.match(NUM, cell.replace("*", ""))
    assert m, f"no figure at the start of {cell!r}"
    return m.group(1)


def _decimals(figure: str) -> int:
    return len(figure.split(".")[1]) if "." in figure else 0


def _ratio_ok(printed: str, a: str, b: str) -> bool:
    """printed (a ratio with its own decimals) equals a / b within the rounding of all three figures."""
    fa, fb, fp = float(a), float(b), float(printed)
    exact = fa / fb
    slack = 0.5 * 10 ** -_decimals(printed)
    slack += exact * (0.5 * 10 ** -_decimals(a) / fa + 0.5 * 10 ** -_decimals(b) / fb)
    return abs(fp - exact) <= slack + 1e-9


ANCHORS = "cosine-bench-anchors-ours-against-vllms-own-methods-2-core-cpu"
ENGINE = "the-default-methods"
TOKS = "tok/s median (min-max)"


def _readme_tables() -> list[list[dict[str, str]]]:
    text = _read("README.md")
    return _tables(text[text.index("## Headline results"):].split("\n## ", 1)[0])


def _readme_results() -> list[tuple[str, str]]:
    """(label, link anchor) of each row of the README's headline tables that quotes a result."""
    rows = []
    for table in _readme_tables():
        for row in table:
            m = re.match(r"\[(.+?)\]\(docs/benchmarks\.md#([\w-]+)\)", row["result"])
            if m:
                rows.append((m.group(1), m.group(2)))
    return rows


def test_readme_opens_with_the_two_commands_and_the_results():
    text = _read("README.md")
    first = text[:text.index("## Headline results")]
    assert "make run" in first and "make test" in first
    assert text.index("## Headline results") < text.index("## The deployment graph")
    anchors, engine = _readme_tables()
    # 4 results (6 with the served rows against `vllm serve`) and the workload, 1-3 runs side by side
    assert len(anchors) in (5, 7) and 2 <= len(anchors[0]) <= 4
    assert len(engine) == 1


def test_readme_results_link_to_existing_sections():
    sections = _benchmark_sections()
    for label, anchor in _readme_results():
        assert anchor in sections, f"{label}: no section #{anchor} in docs/benchmarks.md"


def _readme_sources() -> dict[str, list[str]]:
    """The JSON the README's headline table is rendered from, as its text names them: the anchors runs and the
    engine run."""
    text = _read("README.md")
    body = text[text.index("## Headline results"):].split("\n## ", 1)[0]
    named = re.search(r"python -m benchmarks\.headline ((?:bench_results/\S+\.json\s*)+)", body)
    assert named, "the README names the JSON its headline table is rendered from (python -m benchmarks.headline ...)"
    *anchors, engine = named.group(1).split()
    assert anchors and all("anchors" in p for p in anchors) and "engine" in engine, named.group(0)
    return {"anchors": anchors, "engine": [engine]}


def _settings(result: dict) -> dict:
    """What a run measured (its config but the number of repeats, and the systems it ran: a run of a subset, such as
    `--systems ours served`, answers another question): runs with the same settings answer the same question."""
    systems = sorted({r.get("system") or r.get("method") for r in result.get("rows", [])})
    return {k: v for k, v in result.get("config", {}).items() if k != "repeats"} | {"systems": systems}


def _date(result: dict) -> str:
    return (result.get("provenance") or {}).get("date", "")


def test_readme_headline_is_rendered_from_the_latest_committed_runs():
    """The README's headline table is exactly benchmarks/headline.py's rendering of the JSON it names (figures,
    which of vLLM's `draft_model` runs is its best there, ratios), those are the JSON whose tables docs/benchmarks.md's
    sections show, and no committed run of the same benchmark and settings is newer."""
    from benchmarks import headline

    sources = _readme_sources()
    data = {p: json.loads((ROOT / p).read_text()) for paths in sources.values() for p in paths}
    sections = _benchmark_sections()
    assert all(p in sections[ANCHORS] for p in sources["anchors"]) and sources["engine"][0] in sections[ENGINE]
    for key, paths in sources.items():
        for path in paths:
            mine = data[path]
            for other in sorted((ROOT / "bench_results").glob(f"{key}*.json")):
                theirs = json.loads(other.read_text())
                if other.name != Path(path).name and _settings(theirs) == _settings(mine):
                    assert _date(theirs) <= _date(mine), f"{other.name} is a later run of {path}: the README quotes it"
    text = _read("README.md")
    shown = [line for line in text[text.index("## Headline results"):].split("\n## ", 1)[0].splitlines()
             if line.startswith("|")]
    rendered = headline.tables([data[p] for p in sources["anchors"]], data[sources["engine"][0]])
    expected = [line for line in rendered.splitlines() if line]
    assert shown == expected, "README's headline table is not its JSON's; render it again:\n" + "\n".join(expected)


def _quiet(run: dict) -> dict:
    """`run` as if its repeats had agreed: every row's min and max its median."""
    return dict(run, rows=[dict(r, tokens_per_s_min=r["tokens_per_s"], tokens_per_s_max=r["tokens_per_s"])
                           for r in run["rows"]])


def test_a_ratio_whose_baseline_spread_over_its_repeats_is_withheld():
    """A headline ratio is withheld where its baseline's max / min over repeats is above 1.15 (target-only's or
    vLLM's fastest `draft_model`'s), the ratios over its other baselines still published, and each published ratio
    shows its range over the repeats."""
    from benchmarks import headline

    run = _quiet(json.loads((ROOT / _readme_sources()["anchors"][0]).read_text()))
    base = next(r for r in run["rows"] if r["system"] == "vLLM target-only" and r["concurrency"] == 8)
    ours = next(r for r in run["rows"] if r["system"] == headline.SERVED and r["concurrency"] == 8)
    ours.update(tokens_per_s_min=ours["tokens_per_s"] - 10, tokens_per_s_max=ours["tokens_per_s"] + 10)
    base.update(tokens_per_s_min=100.0, tokens_per_s_max=115.0)
    lo, hi = (ours["tokens_per_s"] - 10) / 115.0, (ours["tokens_per_s"] + 10) / 100.0
    c8 = "| [Concurrency 8: ours served / vLLM target-only]"
    assert f"; repeats {lo:.2f}-{hi:.2f}x)" in next(x for x in headline.anchors_table([run]) if x.startswith(c8))
    base["tokens_per_s_max"] = 116.0
    table = headline.anchors_table([run])
    [line] = [x for x in table if x.startswith(c8)]
    assert "| withheld: vLLM target-only spread 1.160 over its repeats (100.0-116.0 tok/s), above the gate of 1.15 |" \
        in line
    assert "withheld" not in "".join(x for x in table[2:] if x != line)  # the run's other ratios are published
    best = headline.best_draft_model(run := _quiet(run), 1)
    best["tokens_per_s_min"] = best["tokens_per_s"] / 1.2
    table = headline.anchors_table([run])
    assert f"withheld: {best['system']} spread 1.200" in table[3]
    assert "withheld" not in "".join(table[2:3] + table[4:])
    engine = _quiet(json.loads((ROOT / _readme_sources()["engine"][0]).read_text()))
    assert "(repeats " in headline.engine_table(engine)[2]
    hf = next(r for r in engine["rows"] if r["method"] == headline.ENGINE_BASE and r["batch"] == 1)
    hf["tokens_per_s_max"] = hf["tokens_per_s"] * 1.2
    assert "withheld: HF assisted generation" in headline.engine_table(engine)[2]


def test_vllms_best_there_is_the_fastest_draft_model_run():
    """The headline's "vLLM's best there" is computed: the fastest `draft_model` row at that concurrency, whichever
    drafter it ran with; a JSON where the other drafter is faster names the other one."""
    from benchmarks import headline

    anchors = _quiet(json.loads((ROOT / _readme_sources()["anchors"][0]).read_text()))
    for c in (1, 8):
        best = headline.best_draft_model(anchors, c)
        others = [r for r in anchors["rows"] if r["system"].startswith(headline.DRAFT_MODEL) and r["concurrency"] == c]
        assert best["tokens_per_s"] == max(r["tokens_per_s"] for r in others)
    generic_c1 = [r["system"].endswith("generic drafter") and r["concurrency"] == 1 for r in anchors["rows"]]
    swapped = _quiet(dict(anchors, rows=[dict(r, tokens_per_s=1000.0) if g else r
                                         for r, g in zip(anchors["rows"], generic_c1)]))
    assert headline.best_draft_model(swapped, 1)["system"] == "vLLM draft_model, generic drafter"
    assert "generic drafter; repeats" in headline.anchors_table([swapped])[3]
    two = headline.anchors_table([dict(anchors, config=dict(anchors["config"], k=4)),
                                  dict(anchors, config=dict(anchors["config"], k=8))])
    assert two[0].startswith("| result | k = 4, ") and "| k = 8, " in two[0]
    assert len(two) == len(headline.anchors_table([anchors]))


def test_the_source_tables_ratios_match_their_figures():
    """The speed-ups and ratios printed in the tables the README quotes agree with the figures beside them."""
    sections = _benchmark_sections()
    for anchors in _tables(sections[ANCHORS]):
        base = {r["concurrency"]: _lead(r[TOKS]) for r in anchors if r["system"] == "vLLM target-only"}
        for r in anchors:
            printed = _lead(r["speed-up vs vLLM target-only"])
            assert _ratio_ok(printed, _lead(r[TOKS]), base[r["concurrency"]]), (r["system"], r["concurrency"])
    (engine,) = _tables(sections[ENGINE])
    base = {r["batch"]: _lead(r[TOKS]) for r in engine if r["method"] == "target-only (our engine)"}
    for r in engine:
        assert _ratio_ok(_lead(r["speed-up vs target-only"]), _lead(r[TOKS]), base[r["batch"]]), r["method"]


def test_ratio_check_catches_an_inconsistent_edit():
    assert _ratio_ok("1.32", "163.0", "123.0")      # 1.3252: within rounding
    assert not _ratio_ok("1.34", "163.0", "123.0")
    assert not _ratio_ok("0.15", "60", "359")       # 0.167
    assert _ratio_ok("0.15", "54", "359")
