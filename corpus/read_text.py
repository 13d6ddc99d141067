"""Plain text and Markdown: bytes to text in whatever common encoding the file uses."""

from __future__ import annotations

import codecs
import re
from pathlib import Path

import charset_normalizer

from kvrag.corpus.documents import BINARY, EMPTY, UNDECODABLE, Document, Unreadable

# Longest BOMs first: the UTF-32-LE BOM starts with the UTF-16-LE one.
_BOMS = (
    (codecs.BOM_UTF32_LE, "utf-32"),
    (codecs.BOM_UTF32_BE, "utf-32"),
    (codecs.BOM_UTF8, "utf-8-sig"),
    (codecs.BOM_UTF16_LE, "utf-16"),
    (codecs.BOM_UTF16_BE, "utf-16"),
)
_SNIFF = 8192  # bytes looked at to call a file binary
# Control characters other than tab, newlines and form feed: text files hardly ever hold them.
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0e-\x1f\x7f]")
_FRONT_MATTER = re.compile(r"\A---\r?\n.*?\r?\n(?:---|\.\.\.)\r?\n", re.S)
_ATX_HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", re.M)
_FM_TITLE = re.compile(r"^title:[ \t]*['\"]?(.*?)['\"]?[ \t]*$", re.M)


def decode_bytes(data: bytes) -> str:
    """Decode `data` as text: BOM, then UTF-8, then charset-normalizer's best guess.

    Raises Unreadable(BINARY) for binary data and Unreadable(UNDECODABLE) when no encoding fits.
    """
    for bom, encoding in _BOMS:
        if data.startswith(bom):
            try:
                return data.decode(encoding)
            except UnicodeDecodeError as exc:
                raise Unreadable(UNDECODABLE, f"bad {encoding}: {exc.reason}") from None
    if b"\x00" in data[:_SNIFF]:
        # NUL bytes: binary, unless it is UTF-16/32 without a BOM.
        guess = charset_normalizer.from_bytes(data).best()
        if guess is None or not guess.encoding.startswith(("utf_16", "utf_32")):
            raise Unreadable(BINARY)
        return str(guess)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        guess = charset_normalizer.from_bytes(data).best()
        if guess is None:
            raise Unreadable(UNDECODABLE, "no text encoding fits") from None
        text = str(guess)
    if len(_CONTROL.findall(text[:_SNIFF])) > max(2, len(text[:_SNIFF]) // 100):
        raise Unreadable(BINARY)
    return text


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
