"""The batched decode step over a paged KV pool (kernels/decode.cpp through BatchStep) against the one-row step
(WholeStep) of each sequence alone on its own contiguous cache: the same bits, whatever the batch, the order
of the blocks and the number of threads. Each test runs on every build of the kernels this CPU runs (the `isa`
fixture), each build against its own one-row step (the builds' sums run in other orders, so other bits)."""

from __future__ import annotations

import shutil

import pytest
import torch

from kvrag.kernels import decode_step as native_decode
from kvrag.kernels import native, quant
from kvrag.kvcache.allocator import BlockLayout
from kvrag.kvcache.block_pool import BlockPool
from kvrag.model.files import TOKENIZER_FILES, resolve_model
from kvrag.model.prefill import prefill
from kvrag.model.quant import quantize_layers
from kvrag.model.transformer import Transformer

pytestmark = pytest.mark.skipif(not native_decode.available(), reason="kvrag's native kernels are not built here")

# The products' two paths: float32 FMAs everywhere, VDPBF16PS in the AVX-512 build where the CPU has AVX512-BF16
# (the default there); a test of the second skips where its build cannot run it.
DOT_PATHS = [False, True]


def _skip_without_bf16_dot(dot_bf16: bool = True) -> None:
    if dot_bf16 and not native_decode.dot_bf16_default():
        pytest.skip(f"VDPBF16PS products: the avx512 build on a CPU with AVX512-BF16 (this is {native.isa()})")


def _load(path) -> Transformer:
    local = resolve_model(str(path))
    return Transformer.from_safetensors(local.config, local.weight_files(), torch.bfloat16)


def _feeds(model, n_seqs: int, steps: int, seed: int) -> torch.Tensor:
    return torch.randint(0, model.cfg.vocab_size, (n_seqs, steps), generator=torch.Generator().manual_seed(seed))


def _prefilled(model, lengths: list[int], steps: int, seed: int) -> list:
    """Each sequence's contiguous DecodeCache after a random prompt of that many tokens, room for `steps` more."""
    g = torch.Generator().manual_seed(seed)
    return [prefill(model, torch.randint(0, model.cfg.vocab_size, (n,), generator=g), extra=steps)[1]
            for n in lengths]


def _scrambled_pool(model, n_blocks: int, block_size: int, seed: int) -> BlockPool:
    """A bf16 BlockPool whose free blocks come out in a random order (so tables list them out of order), every
    row NaN until written: a row read before it is written, or written where it should not be, shows."""
    c = model.cfg
    pool = BlockPool(BlockLayout(c.n_layers, c.n_kv_heads, c.head_dim, "bfloat16", block_size), n_blocks)
    pool.kv.fill_(float("nan"))
    singles = [pool.allocate(1) for _ in range(n_blocks)]
    for j in torch.randperm(n_blocks, generator=torch.Generator().manual_seed(seed)).tolist():
        pool.free(singles[j])
    return pool


def _into_pool(pool: BlockPool, cache, steps: int):
    """A table for the cache's prompt and `steps` new tokens, holding the prompt's K/V rows."""
    n = cache.length
    table = pool.allocate(n + steps)
    layers = [(cache.k[layer, :n + steps], cache.v[layer, :n + steps]) for layer in range(cache.k.shape[0])]
    pool.write(table, layers, rows=torch.arange(n))
    return table


def _one_at_a_time(model, caches: list, feeds: torch.Tensor,
                   dot_bf16: bool | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each sequence stepped alone by WholeStep over its own cache: per step, (logits [B, V], h [B, D])."""
    steps = []
    for cache in caches:
        steps.append(native_decode.WholeStep(model.step_weights(), cache.k, cache.v,
                                             *model.positions_cos_sin(torch.arange(cache.capacity)), dot_bf16))
    out = []
    for j in range(feeds.shape[1]):
        logits = torch.empty(len(caches), model.lm_head.shape[0])  # [B, V]
        h = model.embed_tokens[feeds[:, j]].clone()  # [B, D]
        for b, (cache, step) in enumerate(zip(caches, steps, strict=True)):
            step(cache.length, h[b], logits[b])
            cache.length += 1
        out.append((logits, h))
    return out


def _batched(model, pool: BlockPool, tables: list, lengths: list[int], feeds: torch.Tensor,
             n_threads: int | None, dot_bf16: bool | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """All sequences stepped together by BatchStep over the pool: per step, (logits [B, V], h [B, D])."""
    most = max(lengths) + feeds.shape[1]
    step = native_decode.BatchStep(model.step_weights(), pool.kv, *model.positions_cos_sin(torch.arange(most)), dot_bf16)
    width = max(len(t.blocks) for t in tables)
    table = torch.tensor([t.blocks + [-1] * (width - len(t.blocks)) for t in tables])  # [B, M], -1: never read
    out = []
    for j in range(feeds.shape[1]):
        positions = torch.tensor(lengths) + j  # [B]
        logits = torch.empty(len(lengths), model.lm_head.shape[0])  # [B, V]
        h = model.embed_tokens[feeds[:, j]].clone()  # [B, D]
        step(positions, table, h, logits, n_threads)
        out.append((logits, h))
    return out


def _check_batch_equals_alone(model, lengths: list[int], steps: int, block_size: int | None,
                              threads: list[int | None], dot_bf16: bool | None = None) -> None:
    """Batched steps (each thread count) against each sequence alone: bit-equal logits, outputs, and K/V rows;
    blocks of no table stay untouched. block_size None: one block a sequence (a contiguous cache each).
    dot_bf16: both steps' product path (None: the CPU's default)."""
    feeds = _feeds(model, len(lengths), steps, seed=sum(lengths))
    alone = _prefilled(model, lengths, steps, seed=7)
    want = _one_at_a_time(model, alone, feeds, dot_bf16)
    for n_threads in threads:
        caches = _prefilled(model, lengths, steps, seed=7)
        size = block_size or max(c.capacity for c in caches)
        blocks = sum(-(-c.capacity // size) for c in caches) + 3  # three blocks no table lists
        pool = _scrambled_pool(model, blocks, size, seed=len(lengths) + size)
        tables = [_into_pool(pool, cache, steps) for cache in caches]
        got = _batched(model, pool, tables, lengths, feeds, n_threads, dot_bf16)
        for (logits, h), (ref_logits, ref_h) in zip(got, want, strict=True):
            assert torch.equal(logits, ref_logits) and torch.equal(h, ref_h)
        for cache, table in zip(alone, tables, strict=True):
            kv = pool.gather([table])  # [L, 2, T, Hkv, hd]: the prompt's rows and every step's new one
            assert torch.equal(kv[:, 0], cache.k) and torch.equal(kv[:, 1], cache.v)
        used = {b for t in tables for b in t.blocks}
        idle = [b for b in range(pool.num_blocks) if b not in used]
        assert len(idle) == 3 and pool.kv[:, :, idle].isnan().all()


@pytest.mark.real_model
def test_real_batch_steps_equal_each_sequence_alone(isa, smol):
    """SmolLM2: prompts of 5, 40 and 130 tokens, 20 steps each across 16-token block edges, in one batch over
    scrambled blocks, against each stepped alone over its own contiguous cache."""
    _check_batch_equals_alone(_load(smol.path), [5, 40, 130], 20, 16, [None])


@pytest.mark.parametrize("dot_bf16", DOT_PATHS)
@pytest.mark.parametrize("fixture", ["tiny_llama_hd64_dir", "tiny_llama_dir", "tiny_qwen2_dir"])
def test_batch_of_six_equals_each_alone_on_any_thread_count(isa, fixture, dot_bf16, request):
    """Six sequences (AVX-512: a 4-input tile and a 2-input tail in every product; AVX2: three 2-input tiles;
    positions at, before and after a block edge), q/k/v biases (Qwen2) and none, on 1, 2 and 3 threads; each
    product path."""
    _skip_without_bf16_dot(dot_bf16)
    _check_batch_equals_alone(_load(request.getfixturevalue(fixture)), [1, 15, 16, 17, 40, 70], 6, 16, [1, 2, 3],
                              dot_bf16)


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_packed_matrices_batch_as_alone(isa, tiny_llama_hd64_dir, weights):
    """Every matrix packed (model/quant.py): the batch's rows still give each sequence's own bits, on any thread
    count (the tiles split over the threads; each output's sums run in one order)."""
    if not quant.available():
        pytest.skip(f"quant.cpp does not run in the {isa} build here (its AVX-512 build needs AVX512-VNNI)")
    model = _load(tiny_llama_hd64_dir)
    quantize_layers(model, weights)
    assert native_decode.step_serves(model.step_weights())
    _check_batch_equals_alone(model, [1, 15, 16, 17, 40, 70], 6, 16, [1, 2, 3])


@pytest.mark.parametrize("lengths", [[33], [9, 50, 21]])
def test_one_block_a_sequence_is_the_contiguous_cache(isa, tiny_llama_hd64_dir, lengths):
    """Block size = capacity: each sequence's table is one block laid out as a DecodeCache's rows."""
    _check_batch_equals_alone(_load(tiny_llama_hd64_dir), lengths, 4, None, [2])


@pytest.fixture(scope="module")
def tiny_odd_dir(tmp_path_factory, smol):
    """A random tiny llama whose every product's K is an odd multiple of 16 (hidden 48, MLP 80, 3 heads of 16):
    each ends on half a VDPBF16PS vector."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", vocab_size=1000, hidden_size=48, intermediate_size=80,
                                  num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=1,
                                  max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(4321)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():  # random init has unit norms: make them count too
            p.normal_(0, 0.08) if p.dim() > 1 else p.add_(torch.randn_like(p) * 0.1)
    path = tmp_path_factory.mktemp("tiny") / "odd"
    model.save_pretrained(str(path), safe_serialization=True)
    for name in TOKENIZER_FILES:  # (a model directory needs a tokenizer; these tests feed token ids)
        if (smol.path / name).exists():
            shutil.copy(smol.path / name, path / name)
    return path


@pytest.mark.parametrize("dot_bf16", DOT_PATHS)
def test_widths_of_odd_sixteens_batch_as_alone(isa, tiny_odd_dir, dot_bf16):
    """K of 48 and 80 in every product (a whole 32-column step and a half one): batched equals alone."""
    _skip_without_bf16_dot(dot_bf16)
    _check_batch_equals_alone(_load(tiny_odd_dir), [3, 20, 33], 4, 16, [1, 2], dot_bf16)


@pytest.mark.parametrize("fixture", ["tiny_odd_dir", "tiny_qwen2_dir"])
def test_bf16_dot_products_stay_within_bf16_of_the_float32_path(isa, fixture, request):
    """VDPBF16PS sums the same exact products in another order, so the logits may differ from the float32 path's,
    but only by the rounding of the sums (a few bf16 steps of the largest). Whether they differ at all is luck:
    each sum is rounded to bf16, which hides a float32 ulp but for about 3 logits in 100,000 (8 of 294,912 on
    tiny_qwen2, none of tiny_odd's 6,000 on an AMX Xeon); that the flag reaches the kernel is the next test."""
    _skip_without_bf16_dot()
    model = _load(request.getfixturevalue(fixture))
    lengths, feeds = [5, 30], _feeds(model, 2, 3, seed=3)
    fast, plain = (_one_at_a_time(model, _prefilled(model, lengths, 3, seed=7), feeds, path) for path in (True, False))
    for (a, _), (b, _) in zip(fast, plain, strict=True):
        scale = b.abs().amax(dim=-1, keepdim=True)  # [B, 1]
        assert ((a - b).abs() <= 2 ** -5 * scale).all()


def test_the_bf16_flag_reaches_the_kernel(isa, tiny_odd_dir):
    """VDPBF16PS treats a subnormal input as zero whatever MXCSR says, the float32 FMAs do not: an LM head that
    reads one channel alone, through a final-norm weight that makes that channel subnormal (2^-130, below
    bf16's least normal 2^-126), gives 0 on the VDPBF16PS path and x * 2^100 != 0 on the float32 path."""
    _skip_without_bf16_dot()
    model = _load(tiny_odd_dir)
    channel = 5
    model.final_norm.fill_(1.0)[channel] = 2.0 ** -130
    model.lm_head.zero_()[:, channel] = 2.0 ** 100
    logits = {}
    for path in (True, False):
        cache = _prefilled(model, [4], 1, seed=1)[0]
        logits[path] = _one_at_a_time(model, [cache], _feeds(model, 1, 1, seed=2), path)[0][0][0]  # [V]
    assert (logits[True] == 0).all()
    assert (logits[False] != 0).all() and logits[False].abs().max() < 2.0 ** -20


def test_batch_step_refuses_positions_and_blocks_it_cannot_take(isa, tiny_llama_hd64_dir):
    """A position past its table or the rotary tables, a block outside the pool, or a wrong dtype is refused
    before anything is written."""
    model = _load(tiny_llama_hd64_dir)
    c, vocab = model.cfg, model.lm_head.shape[0]
    pool = BlockPool(BlockLayout(c.n_layers, c.n_kv_heads, c.head_dim, "bfloat16", 16), 4)
    pool.kv.zero_()
    step = native_decode.BatchStep(model.step_weights(), pool.kv, *model.positions_cos_sin(torch.arange(40)))
    h, logits = model.embed_tokens[:2].clone(), torch.empty(2, vocab)
    for positions, table in [([3, 16], [[0], [1]]),  # position 16 is in a second block the table lacks
                             ([3, 40], [[0, 2, 3], [1, 2, 3]]),  # no rotary angles for position 40
                             ([3, 5], [[0], [4]]),  # block 4 of a 4-block pool
                             ([3, 5], [[0], [-1]])]:
        with pytest.raises(RuntimeError):
            step(torch.tensor(positions), torch.tensor(table), h, logits, 1)
    assert not pool.kv.any()
    with pytest.raises(ValueError):
        step(torch.tensor([3, 5], dtype=torch.int32), torch.tensor([[0], [1]]), h, logits, 1)
    with pytest.raises(ValueError):
        step(torch.tensor([3, 5]), torch.tensor([[0], [1]]), h.float(), logits, 1)


def test_bf16_dot_products_are_refused_where_the_build_has_none(isa, tiny_odd_dir):
    """dot_bf16=True asked of a build without VDPBF16PS (AVX2) is refused when the step is made; a step made for
    it in the AVX-512 build and then called in an AVX2 build is refused by the kernel (code 4), nothing written."""
    model = _load(tiny_odd_dir)
    cache = _prefilled(model, [4], 1, seed=1)[0]
    angles = model.positions_cos_sin(torch.arange(cache.capacity))
    if not native_decode.dot_bf16_default():
        with pytest.raises(ValueError, match="dot_bf16"):
            native_decode.WholeStep(model.step_weights(), cache.k, cache.v, *angles, dot_bf16=True)
        return
    step = native_decode.WholeStep(model.step_weights(), cache.k, cache.v, *angles, dot_bf16=True)
    before, h = cache.k.clone(), model.embed_tokens[0].clone()
    for other in [b for b in native.runnable() if b != "avx512"]:
        native.use(other)  # (the fixture restores the process's build)
        with pytest.raises(RuntimeError, match="code 4"):
            step(cache.length, h, torch.empty(model.lm_head.shape[0]), 1)
        # bits, not values: the cache past its length is uninitialised memory, which may hold NaNs
        assert torch.equal(cache.k.view(torch.int16), before.view(torch.int16))
        assert torch.equal(h, model.embed_tokens[0])
