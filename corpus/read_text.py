"""Plain text and Markdown, in whatever common encoding the file uses (see text_encoding)."""

from __future__ import annotations

import re
from pathlib import Path

from kvrag.corpus.documents import EMPTY, Document, Unreadable
from kvrag.corpus.text_encoding import decode_bytes

__all__ = ["decode_bytes", "read_bytes", "read_markdown", "read_text"]

_FRONT_MATTER = re.compile(r"\A---\r?\n.*?\r?\n(?:---|\.\.\.)\r?\n", re.S)
_ATX_HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", re.M)
_FM_TITLE = re.compile(r"^title:[ \t]*['\"]?(.*?)['\"]?[ \t]*$", re.M)


def read_bytes(path: Path) -> bytes:
    data = path.read_bytes()
    if not data.strip():
        raise Unreadable(EMPTY)
    return data


def read_text(path: Path) -> Document:
    text = decode_bytes(read_bytes(path)).replace("\r\n", "\n")
    if not text.strip():
        raise Unreadable(EMPTY)
    return Document(doc_id=str(path), title=path.stem, text=text, source=str(path))


def read_markdown(path: Path) -> Document:
    """Markdown is kept as written (the LLM reads it well); front matter is dropped.

    Title: front matter `title:`, else the first heading, else the file name.
    """
    text = decode_bytes(read_bytes(path)).replace("\r\n", "\n")
    title = ""
    front = _FRONT_MATTER.match(text)
    if front:
        found = _FM_TITLE.search(front.group(0))
        title = found.group(1).strip() if found else ""
        text = text[front.end():]
    if not text.strip():
        raise Unreadable(EMPTY)
    if not title:
        heading = _ATX_HEADING.search(text)
        title = heading.group(1).strip() if heading else path.stem
    return Document(doc_id=str(path), title=title, text=text, source=str(path))
