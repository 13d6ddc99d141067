"""bench/keyformer.py: the question's attention against transformers' own, and the run's figures on a tiny model."""

from __future__ import annotations

import torch

from kvrag.bench import keyformer as bench
from kvrag.model.runtime import Runtime


def test_question_attention_is_transformers_attention_summed_over_layers(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    runtime = Runtime.load(str(tiny_llama_dir), "float32")
    ids = list(range(2000, 2060))
    with torch.inference_mode():
        got = bench.question_attention(runtime, ids, 7)
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32,
                                              attn_implementation="eager").eval()
    with torch.no_grad():
        attentions = hf(torch.tensor(ids)[None], output_attentions=True).attentions
    want = sum(a[0, :, -7:, :].mean(dim=(0, 1)) for a in attentions)  # [S]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_run_on_invented_items(tiny_llama_dir, invented_items):
    item = invented_items[0]
    result = bench.run([{**item, "ctxs": item["ctxs"][:3]}], str(tiny_llama_dir), "float32")
    kept, nbytes = result["attention_kept"], result["bytes_per_token"]
    for rule in bench.RULE_NAMES:
        assert kept[f"{rule}@1"] == 1.0
        assert all(0 < kept[f"{rule}@{k:g}"] < 1 for k in bench.KEEPS[1:])
    for codec in bench.CODECS:
        sizes = [nbytes[f"{codec}@{k:g}"] for k in bench.KEEPS]
        assert sizes == sorted(sizes, reverse=True)
    assert nbytes["int8@1"] < nbytes["fp16@1"]
    assert "| 0.5 |" in bench.markdown(result)


def test_the_load_bench_resumes_from_its_records(tiny_llama_dir, invented_items, tmp_path):
    """bench keyformer --load --records: each item's records land in the file as it ends; a rerun over more items
    takes the finished ones from the file (the file grows by the new item only) and a file of another run is
    refused."""
    import json

    import pytest

    from kvrag.bench import keyformer_load
    from kvrag.errors import KvragError

    items = [{**item, "ctxs": item["ctxs"][:2]} for item in invented_items[:2]]
    records = tmp_path / "records.jsonl"
    kwargs = {"store": tmp_path / "store", "model": str(tiny_llama_dir), "dtype": "float32", "codecs": ["fp16"],
              "rules": ["window"], "keeps": [1.0, 0.5], "max_tokens": 2, "records": records}
    first = keyformer_load.run(items[:1], **kwargs)
    assert len(records.read_text().splitlines()) == 2  # the header and item 0
    second = keyformer_load.run(items, **kwargs)
    lines = [json.loads(line) for line in records.read_text().splitlines()]
    assert [line["question"] for line in lines[1:]] == [item["question"] for item in items]
    for name, rows in first["records"].items():
        assert second["records"][name][0] == rows[0]  # item 0 read back, not run again
    summary = second["summary"]
    assert summary["fp16:window@0.5"]["store_bytes_per_token"] < summary["fp16:full"]["store_bytes_per_token"]
    assert summary["fp16:window@0.5"]["load_bytes_mean"] < summary["fp16:full"]["load_bytes_mean"]
    with pytest.raises(KvragError, match="another run"):
        keyformer_load.run(items, **{**kwargs, "max_tokens": 3})


def test_rouge_l_by_hand():
    from kvrag.bench.keyformer_budget import rouge_l

    # LCS of "a b c d" and "a c d e" is "a c d": P = R = 3/4
    assert rouge_l("a b c d", "a c d e") == 0.75
    assert rouge_l("a b", "a b") == 1.0 and rouge_l("x", "y") == 0.0 and rouge_l("", "") == 1.0


def test_the_budget_bench_resumes_from_its_records(tiny_llama_dir, invented_items, tmp_path):
    """bench keyformer --budget: every rule@share scored against the unbudgeted answer of the same batch; each item's
    records land in the file as it ends, a rerun over more items adds only the new one, and a file of other settings
    is refused."""
    import json

    import pytest

    from kvrag.bench import keyformer_budget
    from kvrag.config import KV_RULE
    from kvrag.errors import KvragError

    records = tmp_path / "budget.jsonl"
    kwargs = {"model": str(tiny_llama_dir), "dtype": "float32", "tokens": 24, "rules": ["keyformer", "window"],
              "shares": [0.6], "passages": 3, "records": records}
    first = keyformer_budget.run(invented_items[:1], **kwargs)
    assert len(records.read_text().splitlines()) == 2  # the header and item 0
    second = keyformer_budget.run(invented_items[:2], **kwargs)
    assert len(records.read_text().splitlines()) == 3
    assert second["per_item"][0] == first["per_item"][0] and second["items"] == 2
    assert set(second["rouge_l"]) == {"keyformer@0.6", "window@0.6"} and second["default"] == KV_RULE
    for item in second["per_item"]:
        assert item["none@1"]["rouge_l"] == 1.0 and item["none@1"]["same_prefix"] == item["none@1"]["tokens"]
        assert item["none@1"]["agree"] == 1.0  # fed its own answer, the unbudgeted model chooses it at every step
        # the budget (0.6 of prompt + 24) is under the prompt: rows are cut at once
        assert 0.6 * (item["prompt"]["tokens"] + 24) < item["prompt"]["tokens"]
        for key in second["rouge_l"]:
            assert 0 <= item[key]["rouge_l"] <= 1 and item[key]["same_prefix"] <= item["none@1"]["tokens"]
            # agreement counts every step, so it is at least the share before the first difference
            assert item[key]["same_prefix"] / item["none@1"]["tokens"] <= item[key]["agree"] <= 1
    assert f"**{KV_RULE}** (default)" in keyformer_budget.markdown(second)
    lines = [json.loads(line) for line in records.read_text().splitlines()]
    assert lines[0]["rules"] == ["keyformer", "window"]
    with pytest.raises(KvragError, match="another run"):
        keyformer_budget.run(invented_items[:1], **{**kwargs, "tokens": 12})
    with pytest.raises(KvragError, match="KV budget rule"):
        keyformer_budget.run(invented_items[:1], **{**kwargs, "rules": ["keyformer:wide"]})
