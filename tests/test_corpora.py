from model_family.corpora import chunk, normalize


def test_chunks_respect_paragraphs_and_size():
    text = "\n\n".join(f"paragraph {i} " + "word " * 60 for i in range(40))
    pieces = list(chunk(text, size=1000))
    assert all(len(p) <= 2000 for p in pieces)
    assert "".join(p.replace("\n", "") for p in pieces).replace(" ", "") == text.replace("\n", "").replace(" ", "")
    assert all(p.startswith("paragraph") for p in pieces)


def test_normalize_strips_trailing_space_and_blank_runs():
    assert normalize("a  \r\n\n\n\nb\t") == "a\n\nb"
