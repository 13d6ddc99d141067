"""Dynamic speculative pipelining through the Python API on an IVF index: a question answered with speculation is
answered exactly as without it (the reference: the same engine, speculation off), every speculative prefill is
either kept or cancelled, and the counters the server exports add up."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvrag.server.metrics import Metrics
from kvrag.tests.conftest import run_kvrag

TOPICS = [
    "Mount Ardent is a stratovolcano that last erupted in 1783, burying the valley town of Lisk in ash.",
    "Brennkase is a smoked sheep cheese from the Alpine village of Obergau, aged for nine months in caves.",
    "The Kestrel-9 rocket engine burns liquid methane and oxygen and first flew from Andoya in 2031.",
    "Luthier Marta Quell carved her violins from maple felled in the winter of a full moon.",
    "The Bay of Fundy has the highest tides on Earth, rising sixteen metres twice a day.",
]
QUESTIONS = ["When did Mount Ardent erupt?", "Where is Brennkase made?", "What does the Kestrel-9 burn?",
             "What wood did Marta Quell use?", "How high are the tides in the Bay of Fundy?"]


@pytest.fixture(scope="module")
def ivf_store(tmp_path_factory, smol):
    """30 short documents over five topics in an IVF index of 8 lists, every list probed: 8 search stages."""
    root = tmp_path_factory.mktemp("speculation")
    corpus = root / "corpus"
    corpus.mkdir()
    for i, text in enumerate(TOPICS):
        for j in range(6):
            (corpus / f"d{i}{j}.txt").write_text(f"Note {j} of {i}. {text}", encoding="utf-8")
    store = root / "store"
    run_kvrag("index", str(corpus), "--store", str(store), "--index-factory", "IVF8,Flat")
    return store


def test_speculation_answers_as_without_it_and_every_guess_ends(ivf_store, tiny_llama_dir):
    from kvrag import KVRag

    options = {"k": 3, "relative_cutoff": 0.0, "max_tokens": 6}
    with KVRag(ivf_store, model=str(tiny_llama_dir), host_cache="0") as plain:
        want = [plain.ask(q, **options) for q in QUESTIONS]
    with KVRag(ivf_store, model=str(tiny_llama_dir), host_cache="0", speculate=True) as rag:
        got = [rag.ask(q, **options) for q in QUESTIONS]
        counts = dict(rag.speculator.counts)
        exported = {s.labels["outcome"]: s.value for family in text_string_to_metric_families(
                    Metrics(rag).text().decode()) if family.name == "kvrag_speculative_prefills"
                    for s in family.samples}
        assert exported == counts  # what /metrics says
        assert rag.loop.waiting() == 0 and rag.engine.sequence_blocks == 0  # dropped guesses gave their blocks back
    for a, b in zip(got, want, strict=True):
        assert [s["chunk_id"] for s in a.sources] == [s["chunk_id"] for s in b.sources]
        assert a.token_ids == b.token_ids
    assert counts["started"] == counts["kept"] + counts["dropped"]
    assert counts["started"] > 0  # the early stages' top-k gave something to speculate on
    assert counts["dropped"] > 0  # some early top-k was wrong: its prefill was cancelled, and the answer still right
    assert counts["kept"] > 0  # and some was right: its prefill became the answer
