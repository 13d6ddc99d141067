"""Bytes to text: BOM, UTF-8, then the most likely legacy encoding, Western ones first when in doubt."""

from __future__ import annotations

import codecs
import re

import charset_normalizer
from charset_normalizer import CharsetMatch

from kvrag.corpus.documents import BINARY, UNDECODABLE, Unreadable

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

# charset-normalizer scores candidates by mess and by language coherence, yet on Latin text those barely
# differ (latin-1 French reads as cp1250 as "well" as cp1252). A Western candidate wins unless another one
# scores clearly better; other exact ties go to the more common encoding.
_WESTERN = ("cp1252", "latin_1", "cp1254", "iso8859_9")  # Latin-5 (cp1254) is latin-1 plus Turkish letters
_PRIOR = (
    _WESTERN,
    ("cp1250", "iso8859_2", "iso8859_15"),
    ("cp1251", "koi8_r", "koi8_u"),
    ("cp932", "shift_jis", "euc_jp"),
    ("gb18030", "gbk", "gb2312", "big5", "cp950"),
    ("cp949", "euc_kr"),
    ("cp1253", "iso8859_7", "cp1255", "iso8859_8", "cp1256", "cp1257", "cp874", "cp1258"),
)
_CLEARLY = (0.1, 0.1)  # margins of (mess, coherence) by which another candidate beats a Western one
_TIE = (0.01, 0.01)  # margins within which two candidates score the same (charset-normalizer's own 0.01)
_ROUNDS = 3  # queries, each excluding the implausible guesses of the one before
_CHECKED = 65536  # bytes of a candidate's reading looked at for plausibility (not the whole file's)
# C1 controls, private use, replacement: more than 1 in 100 non-ASCII characters and a reading is wrong.
_SUSPECT = re.compile(r"[\x80-\x9f\ue000-\uf8ff\ufffd]")
_HALFWIDTH_KANA = re.compile(r"[\uff61-\uff9f]")  # what Cyrillic bytes become when read as Shift-JIS


def decode_bytes(data: bytes) -> str:
    """Decode `data` as text: BOM, then UTF-8, then the best legacy candidate (`_legacy_decode`).

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
        text = _legacy_decode(data)
    if len(_CONTROL.findall(text[:_SNIFF])) > max(2, len(text[:_SNIFF]) // 100):
        raise Unreadable(BINARY)
    return text


def _legacy_decode(data: bytes) -> str:
    """A Western reading unless another is clearly better; else the most common of the best-scored."""
    found = _candidates(data)
    if not found:
        raise Unreadable(UNDECODABLE, "no text encoding fits")
    top = found[0]
    western = next((m for m in found if _rank(m) == 0 and _latin(_head(m, data))), None)
    if western is not None and _within(western, top, _CLEARLY):
        return str(western)
    return str(min((m for m in found if _within(m, top, _TIE)), key=_rank))  # first of equal ranks


def _within(match: CharsetMatch, top: CharsetMatch, margins: tuple[float, float]) -> bool:
    return match.chaos <= top.chaos + margins[0] and match.coherence >= top.coherence - margins[1]


def _candidates(data: bytes) -> list[CharsetMatch]:
    """charset-normalizer's plausible guesses, best first, and cp1252 among them whenever it reads."""
    excluded: list[str] = []
    first: list[CharsetMatch] = []
    found: list[CharsetMatch] = []
    for _ in range(_ROUNDS):
        matches = list(charset_normalizer.from_bytes(data, cp_exclusion=excluded or None))
        first = first or matches
        found = [m for m in matches if _plausible(_head(m, data))]
        if found or not matches:
            break
        # Its pruning can leave only implausible guesses (KOI8-R read as Shift-JIS): ask again without them.
        excluded += [name for m in matches for name in m.could_be_from_charset]
    found = found or first[:1]  # nothing plausible: its first guess, as before
    if not any("cp1252" in m.could_be_from_charset for m in found):
        western = charset_normalizer.from_bytes(data, cp_isolation=["cp1252"]).best()
        if western is not None and _plausible(_head(western, data)):
            found.append(western)
    return found


def _rank(match: CharsetMatch) -> int:
    names = {match.encoding, *match.could_be_from_charset}
    return next((i for i, group in enumerate(_PRIOR) if names.intersection(group)), len(_PRIOR))


def _head(match: CharsetMatch, data: bytes) -> str:
    return data[:_CHECKED].decode(match.encoding, errors="ignore")  # "ignore": a character cut in two


def _plausible(text: str) -> bool:
    """False for text no one writes: C1 controls, private-use characters, half-width kana soup."""
    foreign = sum(1 for c in text if c > "\x7f")
    return len(_SUSPECT.findall(text)) * 100 <= foreign and len(_HALFWIDTH_KANA.findall(text)) * 2 <= foreign


def _latin(text: str) -> bool:
    """Accented Latin letters among plain ones, not a whole other script read as Latin-1."""
    letters = [c for c in text if c.isalpha()]
    return sum(1 for c in letters if c > "\x7f") * 2 <= len(letters)
