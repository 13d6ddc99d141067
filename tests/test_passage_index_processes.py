"""The passage index of one process follows what other processes do to the store (replicas keeping and evicting
passages, `kvrag index` and `store gc`): it reads the chunk table's change log, not the whole table again, and the
kept passages' bound is the store's, not each replica's."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np

from kvrag.engine.kept_passages import PassageKeeper
from kvrag.engine.prompt_reuse import FIND_ENTRIES, PromptSpans
from kvrag.store import chunk_log
from kvrag.store.chunks import CLIENT_DOC, ChunkRecord, ChunkTable
from kvrag.store.env import StoreEnv


def _ids(seed: int, n: int = 80) -> tuple[int, ...]:
    return tuple(np.random.default_rng(seed).integers(100, 40000, n).tolist())


def _record(seed: int, doc: str = "d") -> ChunkRecord:
    return ChunkRecord(f"{seed:032x}", doc, "", "text", 0, 4, _ids(seed))


def _other_process(store, code: str) -> None:
    """Run `code` in another Python process with `table` (the store's ChunkTable) and `rec(seed, doc)` at hand."""
    script = textwrap.dedent(f"""
        import numpy as np
        from kvrag.store.chunks import ChunkRecord, ChunkTable
        from kvrag.store.env import StoreEnv
        def rec(seed, doc="d"):
            ids = tuple(np.random.default_rng(seed).integers(100, 40000, 80).tolist())
            return ChunkRecord(f"{{seed:032x}}", doc, "", "text", 0, 4, ids)
        env = StoreEnv.open({str(store)!r})
        table = ChunkTable(env)
    """) + textwrap.dedent(code) + "\nenv.close()\n"
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)


def _found(spans: PromptSpans, seed: int, salt: str = "") -> list[str]:
    return [s.chunk_id for s in spans.find([1, 2, *_ids(seed), 3], salt)]


def test_another_process_s_keeps_and_evictions_reach_the_index_without_a_rescan(tmp_path, monkeypatch):
    env = StoreEnv.open(tmp_path / "store", create=True)
    ChunkTable(env).put_records([_record(1)])
    spans = PromptSpans(env, evicted_elsewhere=(gone := []).append)
    assert _found(spans, 1) == [f"{1:032x}"]  # the first look reads the table

    def no_rescan():
        raise AssertionError("the whole chunk table read again")

    monkeypatch.setattr(spans, "_records", no_rescan)
    _other_process(tmp_path / "store", f"""
        table.put_records([rec(2, "{CLIENT_DOC}bob"), rec(3, "{CLIENT_DOC}bob")])  # a replica keeps two passages
        table.delete_records([f"{{1:032x}}", f"{{3:032x}}"])  # gc drops a corpus chunk; the replica evicts one
    """)
    assert _found(spans, 2, "bob") == [f"{2:032x}"] and _found(spans, 2) == []  # bob's, for bob alone
    assert _found(spans, 1) == [] and _found(spans, 3, "bob") == []  # what went is found no more
    assert spans.kept_passages() == {f"{2:032x}": ("bob", 80)}
    assert gone == []  # 3 was added and deleted before this process saw it: it never knew it as kept

    _other_process(tmp_path / "store", 'table.delete_records([f"{2:032x}"])')
    assert _found(spans, 2, "bob") == [] and spans.kept_passages() == {}
    assert gone == [f"{2:032x}"]  # the engine's source told: a copy computed here is not stored back
    env.close()


def test_a_big_write_elsewhere_is_indexed_a_few_entries_a_prompt(tmp_path):
    """Another process indexes 9 log entries' worth of chunks at once: each prompt's probe takes FIND_ENTRIES of
    them, so no prompt waits for the whole write to be indexed."""
    env = StoreEnv.open(tmp_path / "store", create=True)
    spans = PromptSpans(env)
    spans.fill()
    last = 100 + 8 * chunk_log.ENTRY_IDS  # 8 full entries and one of a single chunk
    _other_process(tmp_path / "store", f"table.put_records([rec(s) for s in range(100, {last + 1})])")
    head = ChunkTable(env).log_head()
    assert head == 9
    probes = 0
    while spans._seen != head:
        before = spans._seen
        spans.find([1, 2, 3])
        assert 0 < spans._seen - before <= FIND_ENTRIES
        probes += 1
    assert probes == 3
    assert _found(spans, 100) == [f"{100:032x}"] and _found(spans, last) == [f"{last:032x}"]
    env.close()


def test_an_index_behind_the_trimmed_log_reads_the_table_again(tmp_path):
    env = StoreEnv.open(tmp_path / "store", create=True)
    spans = PromptSpans(env)
    spans.fill()
    _other_process(tmp_path / "store", """
        for s in range(20, 26):
            table.put_records([rec(s)])
        table.delete_records([f"{20:032x}"])
        table.trim_log(keep=2)
    """)
    with env.reader() as txn:
        assert chunk_log.since(txn, env.db("meta"), spans._seen) is None  # what it missed is gone from the log
    assert _found(spans, 21) == [f"{21:032x}"] and _found(spans, 25) == [f"{25:032x}"]
    assert _found(spans, 20) == []
    env.close()


def test_the_bound_on_kept_passages_counts_every_process_s(tmp_path, smol_tokenizer):
    """Hand-computed: bob's replica kept 3 x 80 tokens, then evicted one and kept another (the table's count
    unchanged); alice's needs 80 more under a bound of 250. Held 240 + 80 > 250, and bob holds more than the equal
    share (125): one of the three he holds now goes, never the one already gone."""
    env = StoreEnv.open(tmp_path / "store", create=True)
    ChunkTable(env).put_records([_record(s, f"{CLIENT_DOC}bob") for s in (30, 31, 32)])
    spans = PromptSpans(env)
    spans.fill()
    keeper = PassageKeeper(spans, smol_tokenizer, "fp", 250)
    _other_process(tmp_path / "store", f"""
        table.delete_records([f"{{30:032x}}"])
        table.put_records([rec(33, "{CLIENT_DOC}bob")])
    """)
    spans.fill()
    victims = keeper.make_room(80, "alice")
    assert len(victims) == 1 and set(victims) < {f"{s:032x}" for s in (31, 32, 33)}
    env.close()
