"""Block bookkeeping (plain Python) and the torch pool: tables, refcounts, copy-on-write, gathers."""

from __future__ import annotations

import pytest
import torch

from kvrag.errors import KvragError
from kvrag.kvcache.allocator import BlockAllocator, BlockLayout, BlockTable, OutOfBlocks
from kvrag.kvcache.block_pool import BlockPool

L, H, D, B = 3, 2, 4, 4
LAYOUT = BlockLayout(L, H, D, "float32", B)


def _fork(pool: BlockPool, table: BlockTable) -> BlockTable:
    """A second table over the same blocks (no copy), as a tier shares identical blocks: writing either copies."""
    pool.share(table.blocks)
    return BlockTable(list(table.blocks), table.n_tokens, table.block_size)


def kv(n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, H, D, generator=g), torch.randn(n, H, D, generator=g)) for _ in range(L)]


def stacked(layers) -> torch.Tensor:
    return torch.stack([torch.stack([k, v]) for k, v in layers])  # [L, 2, T, H, D]


# --- layout and allocator (no torch needed) ------------------------------------------------------


def test_layout_bytes_of_default_model():
    smol = BlockLayout.for_codec(30, 3, 64, "fp16")
    assert smol.bytes_per_token == 23_040
    assert smol.bytes_per_block == 16 * 23_040
    assert BlockPool.for_budget(smol, 4 << 30, None).num_blocks == (4 << 30) // (16 * 23_040)
    assert smol.blocks_for(1) == 1 and smol.blocks_for(16) == 1 and smol.blocks_for(17) == 2
    assert BlockLayout.for_codec(30, 3, 64, "int8").dtype == "float16"
    with pytest.raises(KvragError):
        BlockLayout(30, 3, 64, "int4")
    with pytest.raises(KvragError):
        BlockLayout.for_codec(30, 3, 64, "zip")


def test_allocator_free_list_and_refcounts():
    a = BlockAllocator(4)
    x = a.allocate(3)
    assert x == [0, 1, 2] and a.num_free == 1
    with pytest.raises(OutOfBlocks):
        a.allocate(2)
    assert a.num_free == 1  # a failed request takes nothing
    a.incref([1])
    assert a.decref(x) == [0, 2]  # block 1 is still shared
    assert a.refcount(1) == 1 and a.num_free == 3
    assert a.decref([1]) == [1]
    with pytest.raises(ValueError, match="double free"):
        a.decref([1])
    with pytest.raises(ValueError, match="free"):
        a.incref([3])
    a.check()
    # any free blocks serve: no fragmentation, whatever the order of frees
    assert sorted(a.allocate(4)) == [0, 1, 2, 3]


def test_block_table_validates_and_maps_slots():
    t = BlockTable([5, 2], 6, 4)
    assert t.slots() == [20, 21, 22, 23, 8, 9]
    assert t.blocks_of([0, 3, 4]) == [0, 1]
    with pytest.raises(ValueError):
        BlockTable([5], 6, 4)
    with pytest.raises(ValueError):
        BlockTable([], 0, 4)


# --- pool ------------------------------------------------------------------------------------------


def test_write_gather_roundtrip_across_scattered_blocks():
    pool = BlockPool(LAYOUT, 8)
    hole = pool.allocate(5)  # fragment the free list first
    a = pool.allocate(7)
    pool.free(hole)
    b = pool.allocate(10)  # reuses the freed blocks: any free block serves
    la, lb = kv(7, 0), kv(10, 1)
    pool.write(a, la)
    pool.write(b, lb)
    out = pool.gather([a, b])  # [L, 2, 17, H, D]
    assert out.shape == (L, 2, 17, H, D)
    assert torch.equal(out, torch.cat([stacked(la), stacked(lb)], dim=2))
    k1, v1 = pool.gather_layer([b, a], 1)
    assert torch.equal(k1, torch.cat([lb[1][0], la[1][0]])) and torch.equal(v1, torch.cat([lb[1][1], la[1][1]]))
    assert k1.is_contiguous() and out[2, 0].is_contiguous()
    out.zero_()  # a fresh tensor: the pool is untouched
    assert torch.equal(pool.gather([a]), stacked(la))


def test_fork_copy_on_write():
    pool = BlockPool(LAYOUT, 6)
    src = pool.allocate(6)  # 2 blocks
    layers = kv(6, 2)
    pool.write(src, layers)
    fork = _fork(pool, src)
    assert fork.blocks == src.blocks and pool.allocator.refcount(src.blocks[0]) == 2
    assert pool.num_free == 4  # sharing costs nothing
    rows = torch.tensor([5])  # in block 1 only
    changed = [(k.clone(), v.clone()) for k, v in layers]
    changed[2][0][5], changed[2][1][5] = 7.0, -7.0  # layer 2's K and V at row 5
    pool.write(fork, changed, rows)
    assert fork.blocks[0] == src.blocks[0] and fork.blocks[1] != src.blocks[1]  # only the written block copied
    assert pool.num_free == 3
    assert torch.equal(pool.gather([src]), stacked(layers))  # the original never changes
    expect = stacked(layers).clone()
    expect[2, 0, 5], expect[2, 1, 5] = 7.0, -7.0
    assert torch.equal(pool.gather([fork]), expect)
    pool.write(fork, [(k * 2, v * 2) for k, v in changed], rows)  # now private: written in place
    assert pool.num_free == 3
    pool.free(src)
    assert pool.allocator.refcount(fork.blocks[0]) == 1
    pool.free(fork)
    assert pool.num_free == 6
    pool.allocator.check()


def test_write_of_a_shared_block_copies_it_and_full_pool_refuses():
    pool = BlockPool(LAYOUT, 2)
    src = pool.allocate(8)
    pool.write(src, kv(8, 3))
    fork = _fork(pool, src)
    with pytest.raises(OutOfBlocks):
        pool.write(fork, kv(8, 4))
    assert pool.free(src) == []  # the fork still holds both blocks
    with pytest.raises(ValueError, match="freed"):
        pool.gather([src])
    with pytest.raises(ValueError, match="freed"):
        pool.free(src)


def test_partial_rows_write_and_equal_blocks():
    pool = BlockPool(LAYOUT, 8)
    t = pool.allocate(9)  # 3 blocks, the last holds 1 token
    base = kv(9, 5)
    pool.write(t, base)
    changed = [(k.clone(), v.clone()) for k, v in base]
    changed[1][0][5] += 1  # token 5 (block 1), layer 1
    assert pool.equal_blocks(t, base) == [True, True, True]
    assert pool.equal_blocks(t, changed) == [True, False, True]
    pool.write(t, changed, rows=torch.tensor([4, 5, 6, 7]))
    assert torch.equal(pool.gather([t]), stacked(changed))
    assert pool.equal_blocks(t, kv(8, 0)) == [False] * 3  # another length never matches


def test_copy_between_pools_and_budget():
    host = BlockPool.for_budget(LAYOUT, 5 * LAYOUT.bytes_per_block + 17)
    assert host.num_blocks == 5 and host.capacity_bytes <= 5 * LAYOUT.bytes_per_block + 17
    gpu = BlockPool(LAYOUT, 3)
    t = host.allocate(10)
    layers = kv(10, 6)
    host.write(t, layers)
    u = gpu.copy_from(host, t)
    assert torch.equal(gpu.gather([u]), stacked(layers))
    assert host.used_bytes == 3 * LAYOUT.bytes_per_block


def test_bookkeeping_only_pool():
    pool = BlockPool(LAYOUT, 4, device=None)
    t = pool.allocate(9)
    f = _fork(pool, t)
    pool.make_private(f, [0])  # copy-on-write still accounts blocks
    assert pool.num_free == 0 and not pool.materialized
    with pytest.raises(RuntimeError, match="bookkeeping only"):
        pool.gather([t])


def test_bookkeeping_imports_without_torch():
    """DESIGN: keys, tree, block tables and policies are plain Python, testable without torch."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['torch'] = None\n"
            "from kvrag.store.tiers import knowledge_tree, policies, cost_profile, reorder, config\n"
            "from kvrag.kvcache import allocator, prefix_cache\n"
            "a = allocator.BlockAllocator(3); a.allocate(2); a.check()\n"
            "tree = knowledge_tree.KnowledgeTree(); tree.add(tree.root, 'c', 5)\n"
            "print(len(tree), reorder.order_priority(1, 2))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "0.5"]
