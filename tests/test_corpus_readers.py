"""Readers: every input format, and every kind of bad input, reported and skipped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvrag.corpus import documents as why
from kvrag.corpus.sources import JsonFields, expand_paths, read_path
from kvrag.errors import KvragError
from kvrag.tests.corpus_samples import make_pdf

FIELDS = JsonFields()
GERMAN = "Die Straße führt über den Fluß nach Köln. Größere Häuser stehen dort, schön und groß. " * 4
RUSSIAN = "Привет, мир! Как дела? Сегодня хорошая погода, и мы идём гулять в парк. " * 4


def read_one(path: Path, fields: JsonFields = FIELDS):
    result = read_path(path, fields)
    assert len(result.documents) == 1, result.skipped
    return result.documents[0]


def skip_reason(path: Path, fields: JsonFields = FIELDS) -> str:
    result = read_path(path, fields)
    assert not result.documents and len(result.skipped) == 1, result
    return result.skipped[0].reason


# -- text encodings ------------------------------------------------------------------------------

@pytest.mark.parametrize("encoding, text", [
    ("utf-8", GERMAN), ("utf-8-sig", GERMAN), ("utf-16", RUSSIAN), ("utf-16-be", None),
    ("utf-32", RUSSIAN), ("cp1252", GERMAN), ("cp1251", RUSSIAN),
])
def test_plain_text_in_common_encodings_decodes_to_the_original(tmp_path, encoding, text):
    if text is None:  # UTF-16 without a BOM: NUL bytes, yet text
        text, data = GERMAN, GERMAN.encode("utf-16-be")
    else:
        data = text.encode(encoding)
    path = tmp_path / "notes.txt"
    path.write_bytes(data)
    doc = read_one(path)
    assert doc.text == text
    assert doc.title == "notes"
    assert doc.doc_id == str(path)


def test_crlf_line_ends_become_newlines(tmp_path):
    path = tmp_path / "dos.txt"
    path.write_bytes(b"line one\r\nline two\r\n")
    assert read_one(path).text == "line one\nline two\n"


def test_markdown_keeps_its_text_and_takes_the_first_heading_as_title(tmp_path):
    path = tmp_path / "guide.md"
    path.write_text("Intro line.\n\n## Getting started\n\nRun `make`.\n", encoding="utf-8")
    doc = read_one(path)
    assert doc.title == "Getting started"
    assert doc.text == "Intro line.\n\n## Getting started\n\nRun `make`.\n"


def test_markdown_front_matter_is_dropped_and_gives_the_title(tmp_path):
    path = tmp_path / "post.markdown"
    path.write_text('---\ntitle: "A Post"\ntags: [x]\n---\n# Heading\n\nBody.\n', encoding="utf-8")
    doc = read_one(path)
    assert doc.title == "A Post"
    assert doc.text == "# Heading\n\nBody.\n"


def test_html_gives_visible_text_by_block_without_scripts_or_styles(tmp_path):
    path = tmp_path / "page.html"
    path.write_text(
        "<!doctype html><html><head><title> The  Page </title><style>p{color:red}</style>"
        "<script>var hidden = 1;</script></head><body>"
        "<h1>Header</h1><p>First <b>bold</b>\n   paragraph.</p>"
        "<ul><li>one</li><li>two<br>three</li></ul>"
        "<div>outer<div>inner</div></div><noscript>no js</noscript>"
        "<p hidden>secret</p><span style='display: none'>also secret</span>"
        "<pre>  keep\n    indent</pre><table><tr><td>a</td><td>b</td></tr></table>"
        "<!-- a comment --></body></html>",
        encoding="utf-8",
    )
    doc = read_one(path)
    assert doc.title == "The Page"
    assert doc.text == (
        "Header\n\nFirst bold paragraph.\n\none\ntwo\nthree\n\nouter\n\ninner\n\n  keep\n    indent\n\na\tb"
    )


def test_html_in_a_legacy_encoding(tmp_path):
    path = tmp_path / "old.htm"
    path.write_bytes(f"<html><body><p>{GERMAN}</p></body></html>".encode("cp1252"))
    doc = read_one(path)
    assert doc.text == GERMAN.strip()
    assert doc.title == "old"


def test_pdf_text_layer_and_title(tmp_path):
    path = tmp_path / "paper.pdf"
    path.write_bytes(make_pdf(["Hello PDF world.", "Second line (with parens)."], title="A Paper"))
    doc = read_one(path)
    assert doc.title == "A Paper"
    assert doc.text.split("\n") == ["Hello PDF world.", "Second line (with parens)."]


def test_json_records_with_custom_fields(tmp_path):
    path = tmp_path / "faq.json"
    records = [{"q": "How?", "body": "Like this.", "key": "a1"}, {"q": "Why?", "body": "Because.", "key": 7},
               {"q": "No key", "body": "Still indexed."}]
    path.write_text(json.dumps(records), encoding="utf-8")
    result = read_path(path, JsonFields(text="body", title="q", id="key"))
    assert [(d.doc_id, d.title, d.text) for d in result.documents] == [
        (f"{path}#id=a1", "How?", "Like this."), (f"{path}#id=7", "Why?", "Because."),
        (f"{path}#2", "No key", "Still indexed."),
    ]
    assert result.skipped == []


def test_a_single_json_object_is_one_record(tmp_path):
    path = tmp_path / "one.json"
    path.write_text(json.dumps({"text": "Only one.", "title": "Solo"}), encoding="utf-8")
    doc = read_one(path)
    assert (doc.title, doc.text) == ("Solo", "Only one.")


def test_jsonl_skips_broken_lines_and_records_without_text(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"id": 1, "text": "first"}\n{broken\n\n{"id": 2, "other": "x"}\n[1, 2]\n'
                    '{"id": 3, "text": "   "}\n{"id": 1, "text": "dup id"}\n{"id": 4, "text": "last"}\n',
                    encoding="utf-8")
    result = read_path(path, FIELDS)
    assert [d.text for d in result.documents] == ["first", "last"]
    assert sorted((s.source, s.reason) for s in result.skipped) == sorted([
        (f"{path}:2", why.BROKEN_JSON_LINE), (f"{path}:4", why.NO_TEXT_FIELD), (f"{path}:5", why.NO_TEXT_FIELD),
        (f"{path}:6", why.EMPTY), (f"{path}:7", why.DUPLICATE_ID),
    ])


def test_json_lines_under_a_json_name_are_read_as_jsonl(tmp_path):
    path = tmp_path / "lines.json"
    path.write_text('{"text": "a"}\n{"text": "b"}\n', encoding="utf-8")
    assert [d.text for d in read_path(path, FIELDS).documents] == ["a", "b"]


def test_musique_items_give_each_distinct_passage_once(tmp_path):
    items = [
        {"question": "q1", "answers": ["a"], "ctxs": [{"title": "", "text": "Passage one."},
                                                      {"title": "", "text": "Passage two."}]},
        {"question": "q2", "answers": ["b"], "ctxs": [{"title": "", "text": "Passage two."},
                                                      {"title": "T", "text": "Passage two."},
                                                      {"title": "", "text": "  "}]},
    ]
    path = tmp_path / "musique.json"
    path.write_text(json.dumps(items), encoding="utf-8")
    result = read_path(path, FIELDS)
    assert [(d.title, d.text) for d in result.documents] == [
        ("", "Passage one."), ("", "Passage two."), ("T", "Passage two.")]
    assert len({d.doc_id for d in result.documents}) == 3
    assert result.merged_duplicates == 1
    assert [s.reason for s in result.skipped] == [why.EMPTY]


@pytest.mark.benchmark_data
def test_the_real_musique_file_gives_its_1255_distinct_passages(musique_path, musique_items):
    result = read_path(musique_path, FIELDS)
    expected = {(c["title"], c["text"]) for item in musique_items for c in item["ctxs"]}
    assert len(expected) == 1255
    assert {(d.title, d.text) for d in result.documents} == expected
    assert len(result.documents) + result.merged_duplicates == sum(len(i["ctxs"]) for i in musique_items)


# -- bad input ------------------------------------------------------------------------------------

def test_binary_files_are_skipped(tmp_path):
    png = tmp_path / "image.png"
    png.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)) * 4)
    disguised = tmp_path / "data.txt"
    disguised.write_bytes(bytes(range(1, 32)) * 40)  # control characters, no NUL
    assert skip_reason(png) == why.BINARY
    assert skip_reason(disguised) == why.BINARY


def test_undecodable_text_is_skipped(tmp_path):
    path = tmp_path / "mess.txt"
    path.write_bytes(bytes(range(128, 256)) * 20)  # no encoding makes sense of this
    assert skip_reason(path) == why.UNDECODABLE
    odd = tmp_path / "odd.txt"
    odd.write_bytes(b"\xff\xfe" + "abc".encode("utf-16-le") + b"\x00")  # odd byte count after a BOM
    assert skip_reason(odd) == why.UNDECODABLE


@pytest.mark.parametrize("name, data", [
    ("empty.txt", b""), ("blank.md", b" \n\t\n"), ("empty.html", b"<html><body><script>x()</script></body></html>"),
    ("empty.json", b"[]"), ("empty.jsonl", b"\n\n"), ("notext.pdf", None),
])
def test_empty_inputs_are_skipped(tmp_path, name, data):
    path = tmp_path / name
    path.write_bytes(make_pdf([]) if data is None else data)
    result = read_path(path, FIELDS)
    assert not result.documents
    assert {s.reason for s in result.skipped} <= {why.EMPTY, why.NO_TEXT_FIELD}
    if name != "empty.jsonl":  # a file of blank lines has no record to complain about
        assert len(result.skipped) == 1


@pytest.mark.parametrize("data", [
    b"this is not a pdf", b"%PDF-1.4\n1 0 obj\n<< /Type /Catalog /Pages 9 0 R >>\nendobj\n%%EOF",
    make_pdf(["Hello"])[:150],
])
def test_broken_pdfs_are_skipped(tmp_path, data):
    path = tmp_path / "broken.pdf"
    path.write_bytes(data)
    assert skip_reason(path) == why.BROKEN_PDF


def test_broken_json_and_json_without_the_text_field(tmp_path):
    broken = tmp_path / "broken.json"
    broken.write_text('[{"text": "a"},', encoding="utf-8")
    assert skip_reason(broken) == why.BROKEN_JSON
    other = tmp_path / "other.json"
    other.write_text(json.dumps([{"body": "x"}, {"body": "y"}]), encoding="utf-8")
    result = read_path(other, FIELDS)
    assert [(s.reason, "--text-field" in s.detail) for s in result.skipped] == [(why.NO_TEXT_FIELD, True)]


def test_unreadable_file_is_skipped(tmp_path, monkeypatch):
    path = tmp_path / "locked.txt"
    path.write_text("secret")
    real = Path.read_bytes

    def denied(self):  # chmod 0 means nothing to root, who runs CI: fail the read itself
        if self == path:
            raise PermissionError(13, "Permission denied", str(self))
        return real(self)

    monkeypatch.setattr(Path, "read_bytes", denied)
    result = read_path(path, FIELDS)
    assert [(s.reason, s.detail) for s in result.skipped] == [(why.UNREADABLE, "Permission denied")]


# -- paths ----------------------------------------------------------------------------------------

def test_folders_are_walked_recursively_without_hidden_files_or_the_store(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / ".git").mkdir()
    (tmp_path / "store").mkdir()
    for rel in ("top.txt", "a/one.md", "a/b/two.html", ".hidden.txt", ".git/config", "store/data.mdb"):
        (tmp_path / rel).write_text("x")
    found = expand_paths([str(tmp_path)], exclude=tmp_path / "store")
    assert found == [tmp_path / "top.txt", tmp_path / "a" / "one.md", tmp_path / "a" / "b" / "two.html"]


def test_globs_files_and_duplicates(tmp_path, monkeypatch):
    (tmp_path / "d").mkdir()
    for rel in ("x.md", "y.md", "z.txt", "d/w.md"):
        (tmp_path / rel).write_text("x")
    monkeypatch.chdir(tmp_path)
    found = expand_paths(["*.md", "x.md", "**/*.md"])
    assert found == [tmp_path / "x.md", tmp_path / "y.md", tmp_path / "d" / "w.md"]


def test_a_missing_path_or_empty_glob_is_an_error(tmp_path):
    with pytest.raises(KvragError, match="no such file or directory: .*nope"):
        expand_paths([str(tmp_path / "nope")])
    with pytest.raises(KvragError, match=r"no file matches .*\*\.xyz"):
        expand_paths([str(tmp_path / "*.xyz")])
