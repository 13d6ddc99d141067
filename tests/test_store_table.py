"""The KVTable protocol (store/table.py): every table implements it whole, and each, opened for real through the
chooser (store/open.py), hands out the same values for the same chunk. The local table is LMDB in a temp dir; the
remote and the cached ones run against SeaweedFS on loopback (the `s3` fixture of test_remote_store.py). The
reference is the layers written, rounded to fp16 as the codec stores them."""

from __future__ import annotations

import inspect
import json

import numpy as np
import pytest

from kvrag.store.codec import CorruptValue
from kvrag.store.env import StoreEnv
from kvrag.store.kv import LocalKVTable
from kvrag.store.open import MARKER, RemoteOptions, open_table, store_table
from kvrag.store.remote.cached_kv import CachedKVTable
from kvrag.store.remote.remote_kv import RemoteKVTable
from kvrag.store.table import KVTable, MissingChunk
from kvrag.tests.test_remote_store import s3  # noqa: F401  (s3: the SeaweedFS fixture, one per module)
from kvrag.tests.test_store_kv import layers_for, tokens_for

MODEL = "model-a"
N_LAYERS, N_TOKENS = 3, 11
TABLES = (LocalKVTable, RemoteKVTable, CachedKVTable)
METHODS = sorted(name for name, member in vars(KVTable).items() if inspect.isfunction(member) and name[0] != "_")
DEFAULTS = {"get_layer", "put_chunk"}  # the protocol's own, built on the rest


def parameters(fn) -> list[tuple]:
    return [(p.name, p.kind, p.default, p.annotation) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("table_type", TABLES, ids=lambda t: t.__name__)
def test_every_table_implements_the_protocol_whole(table_type):
    assert {"has", "missing", "record", "get_layer_raw", "layer_views", "put_encoded", "claim"} <= set(METHODS)
    assert KVTable in table_type.__mro__  # so it takes the protocol's defaults
    for name in METHODS:
        assert name in DEFAULTS or name in vars(table_type), f"{table_type.__name__} lacks {name}"
        assert parameters(getattr(table_type, name)) == parameters(getattr(KVTable, name)), name


@pytest.fixture
def tables(s3, tmp_path, request):  # noqa: F811  (the fixture imported above)
    """The three tables, each opened as the engine and precompute open them, each over a store of its own."""
    url = s3.url(f"table/{request.node.name}")
    with StoreEnv.open(tmp_path / "local", create=True) as local_env, \
            StoreEnv.open(tmp_path / "mirror", create=True) as mirror_env:
        (tmp_path / "mirror" / MARKER).write_text(json.dumps({"url": url + "-cached"}))
        opened = [store_table(local_env, MODEL), open_table(url, MODEL, aws=s3.env),
                  store_table(mirror_env, MODEL, remote=RemoteOptions(aws=s3.env, cache_bytes=1 << 30))]
        assert [type(t) for t in opened] == list(TABLES)
        yield opened


def test_every_table_gives_the_same_values_for_a_chunk(tables):
    ids, layers = tokens_for(1, N_TOKENS), layers_for(1, N_TOKENS, N_LAYERS)
    values = []
    for table in tables:
        assert all(isinstance(getattr(table, name), str | bool) for name in KVTable.__annotations__)
        assert (table.model_fp, table.codec, table.variant, table.compress) == (MODEL, "fp16", "", True)
        assert table.missing(["c1", "c2"]) == ["c1", "c2"]
        assert table.claim(["c1"]) == ["c1"]
        assert table.put_chunk("c1", ids, layers) and not table.put_chunk("c1", ids, layers)
        assert table.has("c1") and not table.has("c2") and table.missing(["c1", "c2"]) == ["c2"]
        assert table.claim(["c1", "c2"]) == ["c2"]
        table.release(["c2"])
        assert table.record("c1").n_tokens == N_TOKENS and table.record("c2") is None
        assert [c for c, _ in table.iter_chunks()] == ["c1"]
        for layer, (k, v) in enumerate(layers):
            got = table.get_layer("c1", layer, expect_token_ids=ids)
            np.testing.assert_array_equal(got.k, k.astype(np.float16))
            np.testing.assert_array_equal(got.v, v.astype(np.float16))
        with table.layer_views([("c2", None), ("c1", ids)], 2) as (gone, raw):
            values.append((bytes(raw.value), raw.shape, raw.codec))
            assert isinstance(gone, MissingChunk)  # in its place, the others served
        with table.layer_views([("c1", tokens_for(2, N_TOKENS))], 2) as (other,):
            assert isinstance(other, CorruptValue)  # another chunk's token ids: never its KV
        assert bytes(table.get_layer_raw("c1", 2).value) == values[-1][0]
        with pytest.raises(MissingChunk):
            table.get_layer_raw("c2", 0)
        with pytest.raises(CorruptValue):
            table.get_layer_raw("c1", N_LAYERS)
    assert values[0] == values[1] == values[2]  # the same bytes from every table
    for table in tables:
        assert table.delete_chunk("c1") >= 1 and not table.has("c1") and table.missing(["c1"]) == ["c1"]
