"""From command-line paths (files, folders, globs) to files, and from a file to documents."""

from __future__ import annotations

import glob
import os
from collections.abc import Callable
from pathlib import Path

from kvrag.corpus.documents import UNREADABLE, ReadResult, Skipped, Unreadable
from kvrag.corpus.read_html import read_html
from kvrag.corpus.read_json import JsonFields, read_json, read_jsonl
from kvrag.corpus.read_pdf import read_pdf
from kvrag.corpus.read_text import read_markdown, read_text
from kvrag.errors import KvragError

_SINGLE: dict[str, Callable[[Path], object]] = {
    ".md": read_markdown, ".markdown": read_markdown, ".mdown": read_markdown, ".mkd": read_markdown,
    ".html": read_html, ".htm": read_html, ".xhtml": read_html,
    ".pdf": read_pdf,
}
_RECORDS = {".json": read_json, ".jsonl": read_jsonl, ".ndjson": read_jsonl}


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
        return ReadResult(skipped=[Skipped(str(path), UNREADABLE, exc.strerror or str(exc))])
    except (ValueError, RecursionError, UnicodeError) as exc:  # a reader choking on odd input
        return ReadResult(skipped=[Skipped(str(path), UNREADABLE, f"{type(exc).__name__}: {exc}"[:200])])
