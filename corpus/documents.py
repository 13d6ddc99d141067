"""What readers produce: documents to chunk, and inputs skipped with a reason."""

from __future__ import annotations

from dataclasses import dataclass, field

# Skip reasons, as counted in the summary. Each reader reports one of these.
BINARY = "binary file"
UNDECODABLE = "undecodable text"
EMPTY = "empty"
BROKEN_PDF = "broken PDF"
BROKEN_JSON = "broken JSON"
BROKEN_JSON_LINE = "broken JSON line"
NO_TEXT_FIELD = "no text field"
DUPLICATE_ID = "duplicate id"
UNREADABLE = "unreadable file"


@dataclass(frozen=True)
class Document:
    """One unit of text to chunk. `doc_id` is stable across runs (source path, plus a record id)."""

    doc_id: str
    title: str
    text: str
    source: str  # the file it came from, for messages


@dataclass(frozen=True)
class Skipped:
    source: str
    reason: str  # one of the constants above
    detail: str = ""


class Unreadable(Exception):
    """Raised by a reader for a whole file it cannot use; becomes a `Skipped`."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


@dataclass
class ReadResult:
    documents: list[Document] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    merged_duplicates: int = 0  # identical passages folded into one document (MuSiQue format)

    def extend(self, other: ReadResult) -> None:
        self.documents.extend(other.documents)
        self.skipped.extend(other.skipped)
        self.merged_duplicates += other.merged_duplicates
