"""From command-line paths (files, folders, globs) to files, and from a file to documents: plain text and
Markdown, HTML's visible text, a PDF's text layer, JSON/JSONL records and the MuSiQue/CacheBlend question file."""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from selectolax.lexbor import LexborHTMLParser

from kvrag.corpus import documents as why  # the skip reasons
from kvrag.corpus.documents import Document, ReadResult, Skipped, Unreadable
from kvrag.corpus.text_encoding import decode_bytes
from kvrag.errors import KvragError

_FRONT_MATTER = re.compile(r"\A---\r?\n.*?\r?\n(?:---|\.\.\.)\r?\n", re.S)
_ATX_HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", re.M)
_FM_TITLE = re.compile(r"^title:[ \t]*['\"]?(.*?)['\"]?[ \t]*$", re.M)



def expand_paths(specs: list[str], exclude: Path | None = None) -> list[Path]:
    """Files named by `specs` (files, folders walked recursively, globs), absolute, each once.

    Hidden files and folders inside a folder are left out; so is `exclude` (the store, when it
    lies inside the corpus). A spec that names nothing is a KvragError.
    """
    files: dict[Path, None] = {}
    skip = exclude.resolve() if exclude is not None else None
    for spec in specs:
        path = Path(spec).expanduser()
        if path.exists():
            matches = [path]
        elif glob.has_magic(spec):
            matches = [Path(m) for m in sorted(glob.glob(os.path.expanduser(spec), recursive=True))]
            if not matches:
                raise KvragError(f"no file matches {spec}")
        else:
            raise KvragError(f"no such file or directory: {spec}")
        for match in matches:
            for file in _walk(match.resolve(), skip):
                files[file] = None
    return list(files)


def _walk(path: Path, skip: Path | None) -> list[Path]:
    if path.is_file():
        return [path]
    if skip is not None and (path == skip or skip in path.parents):
        return []
    found = []
    for root, dirs, names in os.walk(path):
        root_path = Path(root)
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and root_path / d != skip)
        found += [root_path / n for n in sorted(names) if not n.startswith(".")]
    return [f for f in found if f.is_file()]


def _decoded(path: Path) -> str:
    """The file's text in whatever common encoding it uses (text_encoding.py)."""
    data = path.read_bytes()
    if not data.strip():
        raise Unreadable(why.EMPTY)
    return decode_bytes(data)


def read_text(path: Path) -> Document:
    text = _decoded(path).replace("\r\n", "\n")
    if not text.strip():
        raise Unreadable(why.EMPTY)
    return Document(doc_id=str(path), title=path.stem, text=text, source=str(path))


def read_markdown(path: Path) -> Document:
    """Markdown is kept as written (the LLM reads it well); front matter is dropped.

    Title: front matter `title:`, else the first heading, else the file name.
    """
    text = _decoded(path).replace("\r\n", "\n")
    title = ""
    front = _FRONT_MATTER.match(text)
    if front:
        found = _FM_TITLE.search(front.group(0))
        title = found.group(1).strip() if found else ""
        text = text[front.end():]
    if not text.strip():
        raise Unreadable(why.EMPTY)
    if not title:
        heading = _ATX_HEADING.search(text)
        title = heading.group(1).strip() if heading else path.stem
    return Document(doc_id=str(path), title=title, text=text, source=str(path))


_INVISIBLE = frozenset({
    "head", "script", "style", "noscript", "template", "svg", "canvas", "iframe", "object",
    "embed", "audio", "video", "map", "select", "option",
})
_PARAGRAPH = frozenset({
    "address", "article", "aside", "blockquote", "body", "details", "dialog", "div", "dl",
    "fieldset", "figcaption", "figure", "footer", "form", "h1", "h2", "h3", "h4", "h5", "h6",
    "header", "hr", "main", "nav", "ol", "p", "pre", "section", "summary", "table", "ul",
    "caption", "center",
})
_LINE = frozenset({"br", "li", "dt", "dd", "tr", "thead", "tbody", "tfoot"})
_CELL = frozenset({"td", "th"})
_SPACES = re.compile(r"\s+")


def _hidden(node) -> bool:
    attrs = node.attributes
    if "hidden" in attrs or attrs.get("aria-hidden") == "true":
        return True
    style = (attrs.get("style") or "").replace(" ", "").lower()
    return "display:none" in style or "visibility:hidden" in style


def visible_text(root) -> str:
    """Text of `root` as a reader sees it: blocks separated by blank lines, list items and rows by
    newlines, whitespace collapsed outside <pre>. An explicit stack: deep pages can't overflow it."""
    out: list[str] = []
    pending = 0  # newlines owed before the next text: the largest break asked for since the last text
    in_pre = 0
    stack: list[tuple[object, bool]] = [(root, False)]
    while stack:
        node, leaving = stack.pop()
        if node.is_text_node:
            text = node.text_content or ""
            if not in_pre:
                text = _SPACES.sub(" ", text)
                if pending or not out:
                    text = text.lstrip(" ")
            if not text:
                continue
            if pending and out:
                out[-1] = out[-1].rstrip(" \t")
                out.append("\n" * pending)
            pending = 0
            out.append(text)
            continue
        if not node.is_element_node:
            continue  # comments, doctype
        tag = node.tag
        if not leaving and (tag in _INVISIBLE or _hidden(node)):
            continue
        if tag in _PARAGRAPH:
            pending = max(pending, 2)
        elif tag in _LINE:
            pending = max(pending, 1)
        elif tag in _CELL and leaving and out and not pending:
            out.append("\t")
        if tag == "pre":
            in_pre += -1 if leaving else 1
        if not leaving:
            stack.append((node, True))
            stack.extend((child, False) for child in reversed(list(node.iter(include_text=True))))
    return "".join(out).strip()


def read_html(path: Path) -> Document:
    """The visible text, one paragraph per block element; scripts, styles and hidden parts dropped."""
    tree = LexborHTMLParser(_decoded(path))
    title_node = tree.css_first("title") or tree.css_first("h1")
    title = _SPACES.sub(" ", title_node.text()).strip() if title_node is not None else ""
    text = visible_text(tree.body) if tree.body is not None else ""
    if not text:
        raise Unreadable(why.EMPTY, "no visible text")
    return Document(doc_id=str(path), title=title or path.stem, text=text, source=str(path))


def read_pdf(path: Path) -> Document:
    """The text layer, page by page (no OCR: a scanned PDF without text is reported as empty)."""
    import pypdf  # imported here: only PDF corpora pay for it
    from pypdf.errors import PyPdfError

    # pypdf logs recoverable damage as warnings; the summary reports what matters.
    logging.getLogger("pypdf").setLevel(logging.ERROR)
    try:
        reader = pypdf.PdfReader(path)
        if reader.is_encrypted and not reader.decrypt(""):
            raise Unreadable(why.BROKEN_PDF, "encrypted")
        pages = [(page.extract_text() or "").strip() for page in reader.pages]
        meta = reader.metadata
        title = (meta.title or "").strip() if meta else ""
    except Unreadable:
        raise
    except (PyPdfError, ValueError, KeyError, TypeError, AttributeError, IndexError,
            RecursionError, OSError, NotImplementedError) as exc:
        # pypdf raises many types on damaged files; none of them is worth a traceback.
        raise Unreadable(why.BROKEN_PDF, f"{type(exc).__name__}: {exc}"[:200]) from None
    text = "\n\n".join(page for page in pages if page)
    if not text:
        raise Unreadable(why.EMPTY, "no text layer")
    return Document(doc_id=str(path), title=title or path.stem, text=text, source=str(path))


@dataclass(frozen=True)
class JsonFields:
    """Which keys of a JSON record hold its text, title and id (`--text-field` ...)."""

    text: str = "text"
    title: str = "title"
    id: str = "id"

    def __post_init__(self) -> None:
        for name in ("text", "title", "id"):
            if not getattr(self, name).strip():
                raise KvragError(f"--{name}-field must not be empty")


def read_json(path: Path, fields: JsonFields) -> ReadResult:
    text = _decoded(path)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        if exc.msg == "Extra data":  # one object per line under a .json name
            return _records_from_lines(path, text, fields)
        raise Unreadable(why.BROKEN_JSON, f"line {exc.lineno}: {exc.msg}") from None
    if isinstance(data, list) and data and all(isinstance(i, dict) and isinstance(i.get("ctxs"), list) for i in data):
        return _musique_passages(path, data)  # question items whose `ctxs` lists hold the passages
    records = data if isinstance(data, list) else [data]
    return _records(path, list(enumerate(records)), fields)


def read_jsonl(path: Path, fields: JsonFields) -> ReadResult:
    return _records_from_lines(path, _decoded(path), fields)


def _records_from_lines(path: Path, text: str, fields: JsonFields) -> ReadResult:
    records: list[tuple[int, object]] = []
    broken: list[Skipped] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append((lineno, json.loads(line)))
        except json.JSONDecodeError as exc:
            broken.append(Skipped(f"{path}:{lineno}", why.BROKEN_JSON_LINE, exc.msg))
    try:
        result = _records(path, records, fields) if records else ReadResult()
    except Unreadable as exc:  # keep the broken lines in the count too
        result = ReadResult(skipped=[Skipped(str(path), exc.reason, exc.detail)])
    result.skipped[:0] = broken
    return result


def _records(path: Path, records: list[tuple[int, object]], fields: JsonFields) -> ReadResult:
    result = ReadResult()
    if not any(isinstance(r, dict) and isinstance(r.get(fields.text), str) for _, r in records):
        raise Unreadable(why.NO_TEXT_FIELD, f"no record has a string {fields.text!r} (see --text-field)")
    seen: set[str] = set()
    for position, record in records:
        where = f"{path}:{position}"
        if not isinstance(record, dict) or not isinstance(record.get(fields.text), str):
            result.skipped.append(Skipped(where, why.NO_TEXT_FIELD, f"no string {fields.text!r}"))
            continue
        text = record[fields.text]
        if not text.strip():
            result.skipped.append(Skipped(where, why.EMPTY))
            continue
        rid = record.get(fields.id)
        doc_id = f"{path}#id={rid}" if isinstance(rid, (str, int)) else f"{path}#{position}"
        if doc_id in seen:
            result.skipped.append(Skipped(where, why.DUPLICATE_ID, f"{fields.id}={rid!r}"))
            continue
        seen.add(doc_id)
        title = record.get(fields.title)
        result.documents.append(
            Document(doc_id=doc_id, title=title.strip() if isinstance(title, str) else "", text=text,
                     source=where)
        )
    return result


def _musique_passages(path: Path, items: list[dict]) -> ReadResult:
    """Every distinct (title, text) among the items' `ctxs` is one document, named by its content."""
    result = ReadResult()
    seen: set[str] = set()
    for n, item in enumerate(items):
        for m, ctx in enumerate(item["ctxs"]):
            text = ctx.get("text") if isinstance(ctx, dict) else None
            if not isinstance(text, str) or not text.strip():
                reason = why.EMPTY if isinstance(text, str) else why.NO_TEXT_FIELD
                result.skipped.append(Skipped(f"{path}:item {n} ctx {m}", reason))
                continue
            title = ctx.get("title") if isinstance(ctx.get("title"), str) else ""
            digest = hashlib.blake2b(f"{title}\0{text}".encode(), digest_size=8).hexdigest()
            if digest in seen:
                result.merged_duplicates += 1
                continue
            seen.add(digest)
            result.documents.append(
                Document(doc_id=f"{path}#{digest}", title=title.strip(), text=text, source=str(path))
            )
    return result


_SINGLE: dict[str, Callable[[Path], Document]] = {
    ".md": read_markdown, ".markdown": read_markdown, ".mdown": read_markdown, ".mkd": read_markdown,
    ".html": read_html, ".htm": read_html, ".xhtml": read_html,
    ".pdf": read_pdf,
}
_RECORDS = {".json": read_json, ".jsonl": read_jsonl, ".ndjson": read_jsonl}


def read_path(path: Path, fields: JsonFields) -> ReadResult:
    """The documents in one file; a file that can't be used becomes one `Skipped`, never an error."""
    suffix = path.suffix.lower()
    try:
        if suffix in _RECORDS:
            return _RECORDS[suffix](path, fields)
        reader = _SINGLE.get(suffix, read_text)  # anything else: text if it decodes as text
        return ReadResult(documents=[reader(path)])
    except Unreadable as exc:
        return ReadResult(skipped=[Skipped(str(path), exc.reason, exc.detail)])
    except OSError as exc:
        return ReadResult(skipped=[Skipped(str(path), why.UNREADABLE, exc.strerror or str(exc))])
    except (ValueError, RecursionError, UnicodeError) as exc:  # a reader choking on odd input
        return ReadResult(skipped=[Skipped(str(path), why.UNREADABLE, f"{type(exc).__name__}: {exc}"[:200])])
