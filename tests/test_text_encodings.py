"""Text files in legacy encodings read back as written: Western first, other scripts still right (issue #23)."""

from __future__ import annotations

import json

import pytest

from kvrag.corpus.documents import Unreadable
from kvrag.corpus.sources import read_markdown, read_text
from kvrag.corpus.text_encoding import decode_bytes
from kvrag.tests.conftest import run_cli_in_process

# Invented text. The French one is the case: charset-normalizer alone reads it as cp1250 (à -> ŕ).
FRENCH = (
    "À la fin de l'été, Hélène prépare un gâteau aux pêches pour la fête du village. Son frère Noël arrive "
    "à midi, sûr de lui, et goûte la crème brûlée avant tout le monde.\n\n"
    "Derrière la fenêtre, près du château, les enfants jouent à cache-cache. Où est passée la clé du "
    "grenier ? Personne ne le sait, mais la mère prétend qu'elle est tombée dans le puits.\n"
)
SHORT_FRENCH = "Le café est à côté de la gare, où l'on voit des bûches.\n"
INVOICE = (
    "Invoice 2024-117 for Müller & Söhne totals €1,250.00 — “payable on receipt”, as the office said. "
    "The café’s order… included crème brûlée at €3.50 and a Señor García special at €12.\n\n"
    "Please don’t send cheques; ‘bank transfer only’ is printed on page 2.\n"
)
JAPANESE = (
    "東京の朝はとても静かです。私たちは駅の近くにある小さな喫茶店でコーヒーを飲みました。"
    "店主はいつも笑顔で、季節の果物を使ったケーキを出してくれます。\n\n"
    "午後は川沿いを散歩して、古い本屋で地図を一枚買いました。夕方には雨が降り始めました。\n"
)
RUSSIAN = (
    "Вчера вечером мы гуляли по набережной. Погода была тёплая, и на реке плавали лодки. "
    "Потом мы зашли в кафе и заказали чай с вареньем.\n\n"
    "Утром бабушка испекла пирог с яблоками, а дедушка починил старый велосипед во дворе.\n"
)
CHINESE = (
    "今天早上我们去了公园散步。天气很好，湖边有很多人在钓鱼。"
    "中午我们在一家小饭馆吃了面条，味道非常好。\n\n"
    "下午我们参观了博物馆，看到了很多古代的瓷器和书画。晚上回家的时候，街上已经亮起了灯。\n"
)
GERMAN = "Die Straße führt über den Fluss nach Köln. Größere Häuser stehen dort, schön und groß.\n"


@pytest.mark.parametrize("text, encoding", [
    (FRENCH, "latin-1"),
    (SHORT_FRENCH, "latin-1"),  # one sentence: where guessing goes wrong
    (INVOICE, "cp1252"),  # €, curly quotes, dashes, ellipsis: bytes 0x80-0x9f that latin-1 lacks
    (FRENCH + RUSSIAN, "utf-16"),  # with its BOM
    (FRENCH + JAPANESE, "utf-8-sig"),
    (GERMAN * 3, "utf-16-le"),  # no BOM: NUL bytes, yet text
    (JAPANESE, "shift_jis"),
    (RUSSIAN, "cp1251"),
    (RUSSIAN, "koi8-r"),
    ("Привет, как дела?\n", "koi8-r"),  # charset-normalizer alone reads this as Shift-JIS
    (CHINESE, "gb2312"),
    (CHINESE, "gbk"),
], ids=["latin1", "latin1-one-sentence", "cp1252", "utf16-bom", "utf8-bom", "utf16le-no-bom", "shift-jis",
        "cp1251", "koi8r", "koi8r-short", "gb2312", "gbk"])
def test_a_text_file_reads_back_as_written(tmp_path, text, encoding):
    path = tmp_path / "notes.txt"
    path.write_bytes(text.encode(encoding))
    assert read_text(path).text == text


def test_markdown_in_latin1_keeps_its_heading_as_title(tmp_path):
    path = tmp_path / "ete.md"
    path.write_bytes(("# Été à Montréal\n\n" + FRENCH).encode("latin-1"))
    doc = read_markdown(path)
    assert (doc.title, doc.text) == ("Été à Montréal", "# Été à Montréal\n\n" + FRENCH)


def test_windows_line_ends_in_cp1252(tmp_path):
    path = tmp_path / "dos.txt"
    path.write_bytes(INVOICE.replace("\n", "\r\n").encode("cp1252"))
    assert read_text(path).text == INVOICE


def test_binary_and_undecodable_bytes_are_still_refused():
    with pytest.raises(Unreadable, match="undecodable"):
        decode_bytes(bytes(range(128, 256)) * 20)
    with pytest.raises(Unreadable, match="binary"):
        decode_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 8)


def test_kvrag_index_stores_the_decoded_text(smol, monkeypatch, capsys, tmp_path):
    """The real command on a folder of legacy files: what search returns is the text as written."""
    docs = tmp_path / "docs"
    docs.mkdir()
    files = {"ete.txt": (FRENCH, "latin-1"), "facture.md": (INVOICE, "cp1252"),
             "tokyo.txt": (JAPANESE, "shift_jis"), "vecher.txt": (RUSSIAN, "cp1251")}
    for name, (text, encoding) in files.items():
        (docs / name).write_bytes(text.encode(encoding))
    store = tmp_path / "store"
    code, out, err = run_cli_in_process(monkeypatch, capsys, "index_cmd", "index", str(docs), "--store", str(store),
                                        "--json")
    assert code == 0, err
    assert json.loads(out)["documents"] == 4
    code, out, err = run_cli_in_process(monkeypatch, capsys, "index_cmd", "search", "gâteau aux pêches", "-k", "10",
                                        "--store", str(store), "--json")
    assert code == 0, err
    stored = "\n".join(hit["text"] for hit in json.loads(out))
    for text, _ in files.values():
        for paragraph in text.split("\n\n"):
            assert _squash(paragraph) in _squash(stored)


def _squash(text: str) -> str:
    return " ".join(text.split())

