"""HTML: the visible text, one paragraph per block element; scripts, styles and hidden parts dropped."""

from __future__ import annotations

import re
from pathlib import Path

from selectolax.lexbor import LexborHTMLParser

from kvrag.corpus.documents import EMPTY, Document, Unreadable
from kvrag.corpus.read_text import decode_bytes, read_bytes

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
    tree = LexborHTMLParser(decode_bytes(read_bytes(path)))
    title_node = tree.css_first("title") or tree.css_first("h1")
    title = _SPACES.sub(" ", title_node.text()).strip() if title_node is not None else ""
    text = visible_text(tree.body) if tree.body is not None else ""
    if not text:
        raise Unreadable(EMPTY, "no visible text")
    return Document(doc_id=str(path), title=title or path.stem, text=text, source=str(path))
