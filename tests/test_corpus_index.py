"""The indexer end to end with the real tokenizer and embedder: formats, bad input, re-indexing,
crash safety, index types, and retrieval sanity (MuSiQue recall@10 is marked slow)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvrag.corpus.chunking import ChunkConfig, PassageTokenizer
from kvrag.corpus.embedder import Embedder, bf16_is_fast
from kvrag.corpus.indexer import IndexOptions, index_corpus
from kvrag.corpus.retrieve import Retriever
from kvrag.corpus.sources import expand_paths
from kvrag.corpus.vector_index import VectorIndex
from kvrag.errors import KvragError
from kvrag.model.prompt import render_passage
from kvrag.store.chunks import ChunkTable
from kvrag.store.env import StoreEnv
from kvrag.tests.corpus_samples import make_pdf

TOPICS = {
    "volcano": "Mount Ardent is a stratovolcano that last erupted in 1783, burying the valley town of Lisk in ash.",
    "cheese": "Brennkase is a smoked sheep cheese from the Alpine village of Obergau, aged for nine months in caves.",
    "rocket": "The Kestrel-9 rocket engine burns liquid methane and oxygen and first flew from Andøya in 2031.",
    "violin": "Luthier Marta Quell carved her violins from maple felled in the winter of a full moon.",
    "tides": "The Bay of Fundy has the highest tides on Earth, rising sixteen metres twice a day.",
}


@pytest.fixture(scope="module")
def passages(smol, smol_tokenizer) -> PassageTokenizer:
    return PassageTokenizer(smol_tokenizer, render_passage, smol.tokenizer_fingerprint)


@pytest.fixture(scope="module")
def embedder() -> Embedder:
    return Embedder()


def make_corpus(root: Path) -> Path:
    """One document per format, each about one topic, plus one of every kind of bad input."""
    corpus = root / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "volcano.txt").write_text(TOPICS["volcano"] + "\n", encoding="utf-8")
    (corpus / "sub" / "cheese.md").write_text("# Brennkase\n\n" + TOPICS["cheese"] + "\n", encoding="utf-8")
    (corpus / "rocket.html").write_text(f"<html><head><title>Kestrel</title><script>bad()</script></head>"
                                        f"<body><p>{TOPICS['rocket']}</p></body></html>", encoding="utf-8")
    (corpus / "violin.pdf").write_bytes(make_pdf([TOPICS["violin"]], title="Quell"))
    (corpus / "records.jsonl").write_text(
        json.dumps({"id": "t1", "title": "Tides", "text": TOPICS["tides"]}) + "\n{not json\n", encoding="utf-8")
    (corpus / "musique.json").write_text(json.dumps([
        {"question": "q", "answers": ["a"], "ctxs": [{"title": "", "text": "Passage about owls hunting at night."},
                                                     {"title": "", "text": "Passage about bees making honey."}]},
        {"question": "q2", "answers": ["b"], "ctxs": [{"title": "", "text": "Passage about bees making honey."}]},
    ]), encoding="utf-8")
    (corpus / "blob.bin").write_bytes(bytes(range(256)) * 8)
    (corpus / "empty.txt").write_bytes(b"")
    (corpus / "broken.pdf").write_bytes(b"%PDF-1.4 truncated")
    (corpus / "broken.json").write_text("[{", encoding="utf-8")
    return corpus


def run(passages, embedder, store: Path, *paths: Path, **options):
    chunking = ChunkConfig(options.pop("chunk_tokens", 512), options.pop("overlap", 0))
    files = expand_paths([str(p) for p in paths], exclude=store)
    return index_corpus(files, store, passages, embedder, IndexOptions(chunking=chunking, **options))


def snapshot(store: Path) -> dict:
    """Everything a re-index must keep or change: chunk records, documents, index ids and generation."""
    with StoreEnv.open(store, readonly=True) as env:
        table = ChunkTable(env)
        chunks = {r.chunk_id: r for r in table.iter()}
        docs = table.docs()
    index = VectorIndex.load(store)
    pointer = json.loads((store / "index" / "current.json").read_text())
    return {"chunks": chunks, "docs": docs, "index_ids": index.ids, "generation": pointer["generation"]}


def search(store: Path, embedder, query: str, k: int = 3):
    with StoreEnv.open(store, readonly=True) as env:
        return Retriever(env, embedder).search(query, k)


def test_every_format_is_indexed_and_bad_input_is_counted(tmp_path, passages, embedder, smol_tokenizer):
    store = tmp_path / "store"
    summary = run(passages, embedder, store, make_corpus(tmp_path))
    assert summary.files == 10
    assert (summary.documents, summary.docs_new, summary.merged_duplicates) == (7, 7, 1)
    assert summary.skipped_by_reason() == {"binary file": 1, "empty": 1, "broken PDF": 1, "broken JSON": 1,
                                           "broken JSON line": 1}
    assert summary.index_type == "Flat" and summary.index_bytes > 0
    state = snapshot(store)
    assert set(state["index_ids"]) == set(state["chunks"]) and len(state["chunks"]) == summary.chunks == 7
    texts = {r.text: r for r in state["chunks"].values()}
    assert set(texts) == {*(t for k, t in TOPICS.items() if k != "cheese"), "# Brennkase\n\n" + TOPICS["cheese"],
                          "Passage about owls hunting at night.", "Passage about bees making honey."}
    for r in state["chunks"].values():  # the ids later stages splice in: exactly the prompt's passage
        assert list(r.token_ids) == smol_tokenizer(render_passage(r.title, r.text), add_special_tokens=False)["input_ids"]
    assert summary.tokens == sum(len(r.token_ids) for r in state["chunks"].values())
    assert texts[TOPICS["rocket"]].title == "Kestrel" and texts[TOPICS["tides"]].title == "Tides"
    with StoreEnv.open(store, readonly=True) as env:
        config = ChunkTable(env).read_config()
    assert (config.chunk_tokens, config.overlap, config.index_type) == (512, 0, "Flat")
    assert config.tokenizer_fingerprint == passages.fingerprint


def test_search_finds_the_document_about_the_query(tmp_path, passages, embedder):
    store = tmp_path / "store"
    run(passages, embedder, store, make_corpus(tmp_path))
    for query, topic in [("When did the volcano erupt?", "volcano"), ("smoked sheep cheese", "cheese"),
                         ("methane rocket engine", "rocket"), ("who made violins from maple", "violin"),
                         ("highest tides", "tides")]:
        hits = search(store, embedder, query)
        assert TOPICS[topic] in hits[0].chunk.text, (query, hits[0].chunk.text)
        assert [h.rank for h in hits] == [1, 2, 3]
        assert hits[0].score > hits[1].score and 0 < hits[0].score <= 1.0001


def test_reindexing_an_unchanged_corpus_changes_nothing(tmp_path, passages, embedder):
    store, corpus = tmp_path / "store", make_corpus(tmp_path)
    run(passages, embedder, store, corpus)
    before = snapshot(store)
    again = run(passages, embedder, store, corpus)
    assert (again.docs_unchanged, again.docs_new, again.chunks_new, again.embedded, again.chunks_removed) == (7, 0, 0, 0, 0)
    assert snapshot(store) == before  # same records, same index generation: nothing rewritten


def test_changed_added_and_removed_documents(tmp_path, passages, embedder):
    store, corpus = tmp_path / "store", tmp_path / "long"
    corpus.mkdir()
    paragraphs = [f"Paragraph {i}. " + " ".join(f"Fact {i}.{j} about lighthouse keeping." for j in range(8))
                  for i in range(6)]
    (corpus / "lighthouse.txt").write_text("\n\n".join(paragraphs), encoding="utf-8")
    for name, topic in [("cheese.txt", "cheese"), ("tides.txt", "tides")]:
        (corpus / name).write_text(TOPICS[topic], encoding="utf-8")
    run(passages, embedder, store, corpus, chunk_tokens=96)
    first = snapshot(store)
    lighthouse = [c.chunk_id for c in first["docs"][str(corpus / "lighthouse.txt")].chunks]
    assert len(lighthouse) >= 3

    # change the last paragraph only, remove one file, add one
    paragraphs[-1] = "Paragraph 5 now tells of a storm that broke the lamp."
    (corpus / "lighthouse.txt").write_text("\n\n".join(paragraphs), encoding="utf-8")
    (corpus / "cheese.txt").unlink()
    (corpus / "rocket.txt").write_text(TOPICS["rocket"], encoding="utf-8")
    summary = run(passages, embedder, store, corpus, chunk_tokens=96)
    assert (summary.docs_changed, summary.docs_new, summary.docs_unchanged, summary.docs_removed) == (1, 1, 1, 0)
    second = snapshot(store)
    new_lighthouse = [c.chunk_id for c in second["docs"][str(corpus / "lighthouse.txt")].chunks]
    assert new_lighthouse[:-1] == lighthouse[:-1]  # unchanged chunks keep their ids ...
    for chunk_id in new_lighthouse[:-1]:
        assert second["chunks"][chunk_id] == first["chunks"][chunk_id]  # ... and their records
    assert new_lighthouse[-1] != lighthouse[-1] and lighthouse[-1] not in second["chunks"]
    assert summary.embedded == summary.chunks_new == 2  # the new last chunk and the rocket
    assert str(corpus / "cheese.txt") in second["docs"]  # not pruned: still searchable
    assert TOPICS["cheese"] in search(store, embedder, "smoked sheep cheese")[0].chunk.text

    pruned = run(passages, embedder, store, corpus, chunk_tokens=96, prune=True)
    assert (pruned.docs_removed, pruned.chunks_removed, pruned.embedded) == (1, 1, 0)
    third = snapshot(store)
    assert str(corpus / "cheese.txt") not in third["docs"]
    assert set(third["index_ids"]) == set(third["chunks"]) == {c.chunk_id for d in third["docs"].values() for c in d.chunks}
    assert all(TOPICS["cheese"] not in h.chunk.text for h in search(store, embedder, "smoked sheep cheese", k=10))


def test_identical_chunks_are_stored_once_and_outlive_their_first_document(tmp_path, passages, embedder):
    store, path = tmp_path / "store", tmp_path / "dups.jsonl"
    same = {"title": "Tides", "text": TOPICS["tides"]}
    path.write_text("\n".join(json.dumps({"id": i, **same}) for i in ("a", "b")) + "\n", encoding="utf-8")
    summary = run(passages, embedder, store, path)
    assert (summary.documents, summary.chunks) == (2, 1)
    state = snapshot(store)
    (chunk_id,) = state["chunks"]
    assert state["chunks"][chunk_id].doc_id == f"{path}#id=a"

    path.write_text(json.dumps({"id": "b", **same}) + "\n", encoding="utf-8")
    summary = run(passages, embedder, store, path, prune=True)
    assert (summary.docs_removed, summary.chunks_removed, summary.embedded) == (1, 0, 0)
    assert snapshot(store)["chunks"][chunk_id].doc_id == f"{path}#id=b"


def test_other_chunk_settings_are_refused_unless_rechunk(tmp_path, passages, embedder):
    store, corpus = tmp_path / "store", make_corpus(tmp_path)
    run(passages, embedder, store, corpus)
    before = snapshot(store)
    with pytest.raises(KvragError, match=r"chunk_tokens 512 -> 128.*--rechunk"):
        run(passages, embedder, store, corpus, chunk_tokens=128)
    other_tokenizer = PassageTokenizer(passages.tokenizer, passages.render_passage, "another-tokenizer")
    with pytest.raises(KvragError, match="tokenizer_fingerprint"):
        index_corpus(expand_paths([str(corpus)]), store, other_tokenizer, embedder, IndexOptions())
    assert snapshot(store) == before

    summary = run(passages, embedder, store, corpus / "volcano.txt", chunk_tokens=128, rechunk=True)
    assert (summary.documents, summary.docs_changed, summary.docs_removed) == (1, 1, 6)
    with StoreEnv.open(store, readonly=True) as env:
        assert ChunkTable(env).read_config().chunk_tokens == 128


def test_nothing_indexable_is_an_error_and_stores_nothing(tmp_path, passages, embedder):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "blob.bin").write_bytes(bytes(range(256)))
    (bad / "empty.md").write_text("")
    with pytest.raises(KvragError, match=r"nothing to index in 2 file\(s\) \(skipped: .*binary file.*empty"):
        run(passages, embedder, tmp_path / "store", bad)
    assert not (tmp_path / "store").exists()
    # and an existing store is left alone, even with --prune
    store = tmp_path / "store2"
    run(passages, embedder, store, make_corpus(tmp_path))
    before = snapshot(store)
    with pytest.raises(KvragError, match="nothing to index"):
        run(passages, embedder, store, bad, prune=True)
    assert snapshot(store) == before


def test_a_store_path_holding_other_files_is_refused(tmp_path, passages, embedder):
    (tmp_path / "notastore").mkdir()
    (tmp_path / "notastore" / "keep.txt").write_text("mine")
    with pytest.raises(KvragError, match="not empty and is not a kvrag store"):
        run(passages, embedder, tmp_path / "notastore", make_corpus(tmp_path))


class _CrashingEmbedder:
    def __init__(self, real: Embedder):
        self.fingerprint, self.dim = real.fingerprint, real.dim

    def embed(self, texts, advance=None):
        raise KeyboardInterrupt  # the user pressed Ctrl-C while embedding


def test_a_crash_mid_index_leaves_the_previous_index_usable_and_the_next_run_heals(tmp_path, passages, embedder):
    store, corpus = tmp_path / "store", make_corpus(tmp_path)
    run(passages, embedder, store, corpus)
    before = snapshot(store)
    (corpus / "volcano.txt").write_text(TOPICS["volcano"] + " It may erupt again.", encoding="utf-8")
    (corpus / "records.jsonl").unlink()
    with pytest.raises(KeyboardInterrupt):
        run(passages, _CrashingEmbedder(embedder), store, corpus, prune=True)

    during = snapshot(store)
    assert during["generation"] == before["generation"]  # the live index is the old one ...
    assert set(during["index_ids"]) <= set(during["chunks"])  # ... and every id it names resolves
    hits = search(store, embedder, "When did the volcano erupt?")
    assert hits[0].chunk.text == TOPICS["volcano"]

    healed = run(passages, embedder, store, corpus, prune=True)
    assert healed.embedded == 1  # the new volcano chunk; nothing else is embedded again
    after = snapshot(store)
    assert set(after["index_ids"]) == set(after["chunks"]) == {c.chunk_id for d in after["docs"].values() for c in d.chunks}
    assert TOPICS["tides"] not in {r.text for r in after["chunks"].values()}
    assert search(store, embedder, "When did the volcano erupt?")[0].chunk.text.endswith("It may erupt again.")


def test_index_factory_is_kept_until_auto(tmp_path, passages, embedder):
    store, corpus = tmp_path / "store", make_corpus(tmp_path)
    summary = run(passages, embedder, store, corpus, index_factory="IVF2,Flat")
    assert summary.index_type == "IVF2,Flat"
    hits = search(store, embedder, "methane rocket engine")
    assert TOPICS["rocket"] in hits[0].chunk.text  # nprobe covers both lists: as exact as Flat
    (corpus / "extra.txt").write_text(TOPICS["tides"] + " Extra.", encoding="utf-8")
    assert run(passages, embedder, store, corpus).index_type == "IVF2,Flat"
    assert run(passages, embedder, store, corpus, index_factory="auto").index_type == "Flat"
    with pytest.raises(KvragError, match="could not parse"):
        run(passages, embedder, store, corpus, index_factory="Bogus")
    assert VectorIndex.load(store).factory == "Flat"


def test_a_long_lived_retriever_follows_a_new_index_generation(tmp_path, passages, embedder):
    store = tmp_path / "store"
    run(passages, embedder, store, make_corpus(tmp_path))
    with StoreEnv.open(store, readonly=True) as env:
        retriever = Retriever(env, embedder)
        assert TOPICS["cheese"] in retriever.search("smoked sheep cheese")[0].chunk.text
        old = VectorIndex.load(store)  # as a later `kvrag index` would: a generation without the cheese
        keep = [i for i, chunk_id in enumerate(old.ids)
                if TOPICS["cheese"] not in ChunkTable(env).get(chunk_id).text]
        VectorIndex.build([old.ids[i] for i in keep], old.vectors[keep], "Flat", old.embedder).save(store)
        hits = retriever.search("smoked sheep cheese", k=10)
    assert len(hits) == len(keep) == len(old.ids) - 1
    assert all(TOPICS["cheese"] not in h.chunk.text for h in hits)


@pytest.mark.skipif(not bf16_is_fast("cpu"), reason="bf16 is emulated on this CPU: the embedder uses fp32")
def test_bf16_embeddings_agree_with_fp32(embedder):
    assert embedder.dtype == "bf16"
    reference = Embedder(dtype="fp32")
    texts = list(TOPICS.values()) + [q for q in ("volcano eruption", "sheep cheese", "tallest tides")]
    fast, exact = embedder.embed(texts), reference.embed(texts)
    assert np.allclose(np.linalg.norm(fast, axis=1), 1, atol=1e-5)
    assert float((fast * exact).sum(axis=1).min()) > 0.995
    docs = slice(0, len(TOPICS))
    assert (np.argmax(fast[len(TOPICS):] @ fast[docs].T, 1) == np.argmax(exact[len(TOPICS):] @ exact[docs].T, 1)).all()


@pytest.mark.slow
@pytest.mark.benchmark_data
def test_musique_recall_at_10_over_the_first_50_questions(musique_store, embedder, musique_items):
    """Every question finds at least one of its own passages in the top 10 (whole-passage chunks, as
    CacheBlend uses them; the store is `kvrag index MUSIQUE --chunk-tokens 1024`'s)."""
    items = musique_items[:50]
    with StoreEnv.open(musique_store, readonly=True) as env:
        records = list(ChunkTable(env).iter())
        assert (len({r.doc_id for r in records}), len(records)) == (1255, 1255)  # a passage a document, one chunk
        results = Retriever(env, embedder).search_batch([item["question"] for item in items], 10)
    found = [any(h.chunk.text == c["text"].strip() for h in hits for c in item["ctxs"])
             for item, hits in zip(items, results, strict=True)]
    assert sum(found) == len(items), f"recall@10 = {sum(found) / len(items):.2f}"


def test_staged_search_ends_on_search_and_yields_only_changes(tmp_path, passages, embedder):
    """Retriever.search_staged (speculative pipelining's search): every stage but the last brings other chunks than
    the one before it, and the last is `search`'s answer, cutoff included."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, text in enumerate(TOPICS.values()):
        for j in range(6):  # 30 short documents over 5 topics: IVF8's lists split them
            (corpus / f"d{i}{j}.txt").write_text(f"Note {j}. {text}", encoding="utf-8")
    store = tmp_path / "store"
    run(passages, embedder, store, corpus, index_factory="IVF8,Flat")
    with StoreEnv.open(store, readonly=True) as env:
        retriever = Retriever(env, embedder)
        assert retriever.index.index.nprobe > 1  # more than one stage to run
        staged_runs = 0
        for query in ["methane rocket", "smoked cheese caves", "highest tides", "violin maple", "ash valley"]:
            for cutoff in (0.0, 0.9):
                stages = list(retriever.search_staged(query, 4, cutoff, stages=4))
                want = retriever.search(query, 4, cutoff)
                assert [s.final for s in stages] == [False] * (len(stages) - 1) + [True]
                assert [(h.chunk.chunk_id, h.score) for h in stages[-1].hits] == \
                    [(h.chunk.chunk_id, h.score) for h in want]
                ids = [[h.chunk.chunk_id for h in s.hits] for s in stages]
                assert all(s.changed for s in stages[:-1]) and all(a != b for a, b in zip(ids[:-2], ids[1:-1], strict=True))
                staged_runs += len(stages) > 1
        assert staged_runs > 0  # some query's top-k did change between stages
