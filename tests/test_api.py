"""The Python API as a user calls it: the README's example runs as written against the demo store, and the
API's promises hold (concurrent callers, cancellation, one-line errors, the same answer as `kvrag ask`)."""

from __future__ import annotations

import contextlib
import io
import json
import re
import threading
from pathlib import Path

import pytest

from kvrag.errors import KvragError
from kvrag.tests.conftest import run_kvrag

pytestmark = pytest.mark.real_model
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def demo_store(tmp_path_factory, smol) -> Path:
    store = tmp_path_factory.mktemp("api") / "store"
    run_kvrag("index", str(ROOT / "corpus" / "sample"), "--store", str(store))
    run_kvrag("precompute", "--store", str(store))
    return store


@pytest.fixture(scope="module")
def rag(demo_store):
    from kvrag import KVRag

    with KVRag(demo_store) as opened:
        yield opened


def readme_example() -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Python API", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_readme_example_runs_as_written(demo_store):
    code = readme_example().replace('".kvrag/demo-store"', repr(str(demo_store)))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {})  # noqa: S102 - the README's own example
    printed = out.getvalue()
    for expected in ("Margaret Ross", "Elo", "Switzerland"):  # (the LMDB answer misses on AVX2-only CPUs: test_demo)
        assert expected in printed, printed
    assert len(printed.strip().splitlines()) >= 5  # and every answer came out, the fourth too


def test_ask_answers_as_the_cli_does(rag, demo_store):
    question = "Who was the last keeper of the Skerry Point lighthouse?"
    cli = json.loads(run_kvrag("ask", question, "--store", str(demo_store), "--json").stdout)
    answer = rag.ask(question)
    assert answer.token_ids == cli["token_ids"]
    assert [s["chunk_id"] for s in answer.sources] == [s["chunk_id"] for s in cli["sources"]]
    assert answer.to_json()["schema"] == cli["schema"]


def test_many_threads_submit_at_once_and_each_gets_its_own_answer(rag):
    questions = [json.loads(line)["question"] for line in (ROOT / "corpus" / "demo-questions.jsonl").open()]
    alone = {q: rag.ask(q, max_tokens=12).token_ids for q in questions}
    got: dict[str, list[int]] = {}

    def ask(q: str) -> None:
        got[q] = rag.ask(q, max_tokens=12).token_ids

    threads = [threading.Thread(target=ask, args=(q,)) for q in questions]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert got == alone


def test_a_cancelled_generation_ends_and_gives_its_memory_back(rag):
    job = rag.submit("Who was the last keeper of the Skerry Point lighthouse?", max_tokens=200, mode="full")
    next(iter(job))  # the first text has come: it is running
    job.cancel()
    answer = job.result(timeout=60)
    assert answer.finish_reason == "interrupted" and len(answer.token_ids) < 200
    kv = rag.engine.kv
    rag.ask("Who designed the Elo rating system?", max_tokens=2)  # a step after the cancel has run
    assert kv.pool.num_free == kv.pool.num_blocks - len(kv.shared)


def test_bad_input_is_one_line(rag):
    with pytest.raises(KvragError, match="question is empty"):
        rag.submit("  ")
    with pytest.raises(KvragError, match="ratio"):
        rag.submit("Who?", ratio="most")
    with pytest.raises(KvragError, match="mode"):
        rag.submit("Who?", mode="fastest")
    with pytest.raises(KvragError):
        rag.submit("Who?", chunk_ids=["no-such-chunk"])
    with pytest.raises(KvragError, match="context"):
        rag.submit("Who?", passages=[("long", "word " * 9000)])


def test_own_passages_answer_from_them(rag):
    answer = rag.ask("Who invented the Quarn loom?", passages=[
        ("Quarn loom", "The Quarn loom was invented in 1791 by Beatrix Olufsen, a weaver from Trondheim.")])
    assert "Olufsen" in answer.text


def test_own_passages_are_salted_per_key_and_never_written_to_the_store(rag):
    """A request's own passages are computed for it under its key's salt: the store never grows by them (an
    authenticated client could fill the disk), and another key sending the same passage is computed afresh rather
    than served the first key's copy (whose timing would tell it the passage was sent). A passage the corpus holds
    reads the corpus's stored KV."""
    from kvrag.store.chunks import ChunkRecord, ChunkTable

    passage = [("Quarn loom", "The Quarn loom was invented in 1791 by Beatrix Olufsen, a weaver from Trondheim.")]
    env, engine = rag.chunks.env, rag.engine
    kv = engine.prefiller.source.table
    stored = sum(1 for _ in kv.iter_chunks())
    first = rag.ask("Who invented the Quarn loom?", passages=passage, salt="tenant-a", max_tokens=2)
    again = rag.ask("Who invented the Quarn loom?", passages=passage, salt="tenant-a", max_tokens=2)
    other = rag.ask("Who invented the Quarn loom?", passages=passage, salt="tenant-b", max_tokens=2)
    engine.writes.drain()
    ids = [a.sources[0]["chunk_id"] for a in (first, again, other)]
    assert ids[0] == ids[1] != ids[2]
    assert [a.chunk_tiers[0] for a in (first, other)] == ["computed", "computed"]  # b never reads a's copy
    assert sum(1 for _ in kv.iter_chunks()) == stored and set(kv.missing(ids)) == set(ids)

    record: ChunkRecord = next(ChunkTable(env).iter())  # a corpus chunk, sent as a passage of one's own
    ids = rag.runtime.prompts.passage_ids(record.title, record.text)
    if tuple(ids) == tuple(record.token_ids):  # the corpus's chunks are tokenized as passages are
        corpus = rag.ask("What is this about?", passages=[(record.title, record.text)], salt="tenant-a", max_tokens=2)
        assert corpus.sources[0]["chunk_id"] == record.chunk_id and corpus.chunk_tiers[0] != "computed"
