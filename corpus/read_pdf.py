"""PDF: the text layer, page by page (no OCR: a scanned PDF without text is reported as empty)."""

from __future__ import annotations

import logging
from pathlib import Path

from kvrag.corpus.documents import BROKEN_PDF, EMPTY, Document, Unreadable


def read_pdf(path: Path) -> Document:
    import pypdf  # imported here: only PDF corpora pay for it
    from pypdf.errors import PyPdfError

    # pypdf logs recoverable damage as warnings; the summary reports what matters.
    logging.getLogger("pypdf").setLevel(logging.ERROR)
    try:
        reader = pypdf.PdfReader(path)
        if reader.is_encrypted and not reader.decrypt(""):
            raise Unreadable(BROKEN_PDF, "encrypted")
        pages = [(page.extract_text() or "").strip() for page in reader.pages]
        meta = reader.metadata
        title = (meta.title or "").strip() if meta else ""
    except Unreadable:
        raise
    except (PyPdfError, ValueError, KeyError, TypeError, AttributeError, IndexError,
            RecursionError, OSError, NotImplementedError) as exc:
        # pypdf raises many types on damaged files; none of them is worth a traceback.
        raise Unreadable(BROKEN_PDF, f"{type(exc).__name__}: {exc}"[:200]) from None
    text = "\n\n".join(page for page in pages if page)
    if not text:
        raise Unreadable(EMPTY, "no text layer")
    return Document(doc_id=str(path), title=title or path.stem, text=text, source=str(path))
