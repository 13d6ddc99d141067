"""JSON and JSONL records, and the MuSiQue/CacheBlend question file (its `ctxs` are the passages)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from kvrag.corpus.documents import (
    BROKEN_JSON,
    BROKEN_JSON_LINE,
    DUPLICATE_ID,
    EMPTY,
    NO_TEXT_FIELD,
    Document,
    ReadResult,
    Skipped,
    Unreadable,
)
from kvrag.corpus.read_text import decode_bytes, read_bytes
from kvrag.errors import KvragError


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


def is_musique(data: object) -> bool:
    """A list of question items whose `ctxs` lists hold the passages."""
    return (
        isinstance(data, list)
        and bool(data)
        and all(isinstance(item, dict) and isinstance(item.get("ctxs"), list) for item in data)
    )


def read_json(path: Path, fields: JsonFields) -> ReadResult:
    text = decode_bytes(read_bytes(path))
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        if exc.msg == "Extra data":  # one object per line under a .json name
            return _records_from_lines(path, text, fields)
        raise Unreadable(BROKEN_JSON, f"line {exc.lineno}: {exc.msg}") from None
    if is_musique(data):
        return _musique_passages(path, data)
    records = data if isinstance(data, list) else [data]
    return _records(path, list(enumerate(records)), fields)


def read_jsonl(path: Path, fields: JsonFields) -> ReadResult:
    return _records_from_lines(path, decode_bytes(read_bytes(path)), fields)


def _records_from_lines(path: Path, text: str, fields: JsonFields) -> ReadResult:
    records: list[tuple[int, object]] = []
    broken: list[Skipped] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append((lineno, json.loads(line)))
        except json.JSONDecodeError as exc:
            broken.append(Skipped(f"{path}:{lineno}", BROKEN_JSON_LINE, exc.msg))
    try:
        result = _records(path, records, fields) if records else ReadResult()
    except Unreadable as exc:  # keep the broken lines in the count too
        result = ReadResult(skipped=[Skipped(str(path), exc.reason, exc.detail)])
    result.skipped[:0] = broken
    return result


def _records(path: Path, records: list[tuple[int, object]], fields: JsonFields) -> ReadResult:
    result = ReadResult()
    if not any(isinstance(r, dict) and isinstance(r.get(fields.text), str) for _, r in records):
        raise Unreadable(NO_TEXT_FIELD, f"no record has a string {fields.text!r} (see --text-field)")
    seen: set[str] = set()
    for position, record in records:
        where = f"{path}:{position}"
        if not isinstance(record, dict) or not isinstance(record.get(fields.text), str):
            result.skipped.append(Skipped(where, NO_TEXT_FIELD, f"no string {fields.text!r}"))
            continue
        text = record[fields.text]
        if not text.strip():
            result.skipped.append(Skipped(where, EMPTY))
            continue
        rid = record.get(fields.id)
        doc_id = f"{path}#id={rid}" if isinstance(rid, (str, int)) else f"{path}#{position}"
        if doc_id in seen:
            result.skipped.append(Skipped(where, DUPLICATE_ID, f"{fields.id}={rid!r}"))
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
                reason = EMPTY if isinstance(text, str) else NO_TEXT_FIELD
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
