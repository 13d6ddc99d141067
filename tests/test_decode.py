"""Decoding over our own KV cache against transformers' `generate`."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvrag.errors import KvragError
from kvrag.kernels import decode_step as native_decode
from kvrag.kernels.attention import attend_few_rows
from kvrag.model.cache import DecodeCache
from kvrag.model.decode import decode_step, decode_step_reference, generate
from kvrag.model.files import resolve_model
from kvrag.model.prefill import extend, prefill
from kvrag.model.sampling import SamplingConfig, choose
from kvrag.model.transformer import RESCORED, Transformer


def _greedy_ours(path, ids: torch.Tensor, n: int) -> list[int]:
    local = resolve_model(str(path))
    model = Transformer.from_safetensors(local.config, local.weight_files(), torch.float32)
    with torch.no_grad():
        logits, cache = prefill(model, ids, extra=n)
        return list(generate(model, cache, logits, SamplingConfig(max_tokens=n), stop=set()))


def _greedy_hf(path, ids: torch.Tensor, n: int) -> list[int]:
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(ids[None], max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          attention_mask=torch.ones_like(ids[None]), pad_token_id=0, eos_token_id=None)
    return out[0, ids.shape[0]:].tolist()


def test_tiny_greedy_matches_generate(tiny_qwen2_dir):
    ids = torch.randint(0, 49152, (40,), generator=torch.Generator().manual_seed(3))
    assert _greedy_ours(tiny_qwen2_dir, ids, 32) == _greedy_hf(tiny_qwen2_dir, ids, 32)


@pytest.mark.real_model
def test_real_greedy_32_tokens_match_generate(smol, smol_tokenizer, invented_items):
    from kvrag.model.prompt import PromptBuilder

    builder = PromptBuilder(smol_tokenizer)
    item = invented_items[1]
    ids = torch.tensor(builder.build([builder.passage_ids("", item["ctxs"][0]["text"])], item["question"]).flat())
    assert _greedy_ours(smol.path, ids, 32) == _greedy_hf(smol.path, ids, 32)


def test_decode_step_logits_equal_a_full_prefill(tiny_llama_dir):
    """Logits after feeding tokens one by one equal a full forward of the whole sequence."""
    local = resolve_model(str(tiny_llama_dir))
    model = Transformer.from_safetensors(local.config, local.weight_files(), torch.float32)
    ids = torch.randint(0, 49152, (30,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        _, cache = prefill(model, ids[:20], extra=10)
        for t in ids[20:]:
            step_logits = decode_step(model, cache, int(t))
        ref, _ = extend(model, None, ids)
    torch.testing.assert_close(step_logits, ref, rtol=1e-4, atol=1e-4)


def test_full_cache_refuses_another_token(tiny_llama_dir):
    local = resolve_model(str(tiny_llama_dir))
    model = Transformer.from_safetensors(local.config, local.weight_files(), torch.float32)
    cache = DecodeCache(model, capacity=1)
    decode_step(model, cache, 5)
    with pytest.raises(KvragError):
        decode_step(model, cache, 6)


def test_sampling_rules_by_hand():
    logits = torch.tensor([0.0, 3.0, 2.9, -5.0])
    assert choose(logits, SamplingConfig(), None) == 1  # greedy
    # top_p small enough keeps only the most likely token, whatever the seed
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        assert choose(logits, SamplingConfig(temperature=1.0, top_p=0.3), g) == 1
    # with top_p=1 and a high temperature every token is reachable; a seed makes it repeatable
    draws = [choose(logits, SamplingConfig(temperature=5.0), torch.Generator().manual_seed(s)) for s in range(200)]
    assert set(draws) == {0, 1, 2, 3}
    again = [choose(logits, SamplingConfig(temperature=5.0), torch.Generator().manual_seed(s)) for s in range(200)]
    assert draws == again


@pytest.mark.parametrize("bad", [dict(max_tokens=0), dict(temperature=-1), dict(top_p=0), dict(top_p=1.5)])
def test_sampling_config_is_validated(bad):
    with pytest.raises(KvragError):
        SamplingConfig(**bad)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("rows, keys, kv_heads, group", [(1, 1, 3, 3), (1, 517, 3, 3), (5, 64, 2, 4), (8, 300, 4, 1)])
def test_decode_attention_equals_sdpa(dtype, tol, rows, keys, kv_heads, group):
    """The few-rows path decoding takes (two float32 matmuls) against SDPA over expanded heads, the reference."""
    g = torch.Generator().manual_seed(rows * 1000 + keys)
    q = torch.randn(rows, kv_heads * group, 64, generator=g).to(dtype)  # [R, Hq, hd]
    k = torch.randn(keys, kv_heads, 64, generator=g).to(dtype) * 3  # [S, Hkv, hd]
    v = torch.randn(keys, kv_heads, 64, generator=g).to(dtype)
    expand = lambda x: x.repeat_interleave(group, dim=1).transpose(0, 1)[None].float()  # noqa: E731  [1, Hq, S, hd]
    ref = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1)[None].float(), expand(k), expand(v))
    got = attend_few_rows(q, k, v, group)
    torch.testing.assert_close(got.float(), ref[0].transpose(0, 1).reshape(rows, -1), rtol=tol, atol=tol)


# ---- the one-row decode path (RowStep) against the reference step ---------------------------------------------

def _load(path, dtype) -> Transformer:
    local = resolve_model(str(path))
    return Transformer.from_safetensors(local.config, local.weight_files(), dtype)


def _steps(model, step, ids: torch.Tensor, feed: list[int]) -> list[torch.Tensor]:
    """Logits [V] after the prompt ids and after each token of `feed`, through `step`."""
    logits, cache = prefill(model, ids, extra=len(feed))
    out = [logits]
    for token in feed:
        out.append(step(model, cache, token).clone())
    return out


def _greedy(model, step, ids: torch.Tensor, n: int) -> list[int]:
    logits, cache = prefill(model, ids, extra=n)
    tokens = []
    for _ in range(n):
        tokens.append(int(torch.argmax(logits)))
        logits = step(model, cache, tokens[-1])
    return tokens


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_row_step_gives_the_reference_bits_in_float32(fixture, request):
    """Off the native kernels (float32), the one-row step runs the reference's own ops: the same bits."""
    model = _load(request.getfixturevalue(fixture), torch.float32)
    ids = torch.randint(0, 49152, (37,), generator=torch.Generator().manual_seed(5))
    feed = torch.randint(0, 49152, (12,), generator=torch.Generator().manual_seed(6)).tolist()
    for new, ref in zip(_steps(model, decode_step, ids, feed), _steps(model, decode_step_reference, ids, feed),
                        strict=True):
        torch.testing.assert_close(new, ref, rtol=0, atol=0)


_exact_step = partial(decode_step, native=False)


def test_row_step_in_bf16_gives_the_reference_bits(tiny_llama_hd64_dir):
    model = _load(tiny_llama_hd64_dir, torch.bfloat16)
    ids = torch.randint(0, 49152, (90,), generator=torch.Generator().manual_seed(7))
    feed = torch.randint(0, 49152, (20,), generator=torch.Generator().manual_seed(8)).tolist()
    for new, ref in zip(_steps(model, _exact_step, ids, feed), _steps(model, decode_step_reference, ids, feed),
                        strict=True):
        torch.testing.assert_close(new, ref, rtol=0, atol=0)


needs_native = pytest.mark.skipif(not native_decode.available(), reason="kvrag's native kernels are not built here")


def _native_step(model, cache, token):
    """decode_step's default, held to running the native whole step (on a CPU whose kernels serve the model)."""
    logits = decode_step(model, cache, token)
    assert cache.stepper.whole is not None
    return logits


# The native step's two product paths: float32 FMAs, and VDPBF16PS where the CPU has AVX512-BF16 (its default).
DOT_PATHS = [False, True] if native_decode.available() and native_decode.dot_bf16_default() else [False]


@needs_native
@pytest.mark.parametrize("dot_bf16", DOT_PATHS)
@pytest.mark.parametrize("fixture", ["tiny_llama_hd64_dir", "tiny_llama_dir", "tiny_qwen2_dir"])
def test_native_whole_step_stays_within_bf16_of_the_reference(fixture, dot_bf16, request, monkeypatch):
    """bf16 through the native whole step: every op rounds where the reference's does and only the order of
    float32 sums differs, so its logits are as close to the float32 model's as the reference's own are (within
    1.5x their error), and within a few bf16 steps of the reference's (2^-6 relative, 4x that error). Each
    product path (the row step builds its WholeStep with the CPU's default: held here to one)."""
    monkeypatch.setattr(native_decode, "dot_bf16_default", lambda: dot_bf16)
    path = request.getfixturevalue(fixture)
    model, exact = _load(path, torch.bfloat16), _load(path, torch.float32)
    ids = torch.randint(0, 49152, (90,), generator=torch.Generator().manual_seed(7))
    feed = torch.randint(0, 49152, (20,), generator=torch.Generator().manual_seed(8)).tolist()
    new, ref = _steps(model, _native_step, ids, feed), _steps(model, decode_step_reference, ids, feed)
    truth = _steps(exact, decode_step_reference, ids, feed)
    for a, b, t in zip(new, ref, truth, strict=True):
        ref_err = (b - t).abs().max()
        assert (a - t).abs().max() <= 1.5 * ref_err + 1e-3
        torch.testing.assert_close(a, b, rtol=2 ** -6, atol=4 * ref_err)


@needs_native
@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_native_whole_step_writes_the_reference_kv_rows(fixture, request):
    """The keys and values the native step writes into the cache: layer 0's are the reference's bf16 values up
    to one rounding step (only the projection's sum order differs before them), the later layers' within a few
    (their inputs carry the earlier layers' differences)."""
    model = _load(request.getfixturevalue(fixture), torch.bfloat16)
    ids = torch.randint(0, 49152, (50,), generator=torch.Generator().manual_seed(10))
    feed = torch.randint(0, 49152, (8,), generator=torch.Generator().manual_seed(11)).tolist()
    _, native = prefill(model, ids, extra=len(feed))
    _, ref = prefill(model, ids, extra=len(feed))
    for token in feed:
        _native_step(model, native, token)
        decode_step_reference(model, ref, token)
    assert native.length == ref.length == 58
    for got, want in ((native.k, ref.k), (native.v, ref.v)):  # [L, cap, Hkv, hd]
        torch.testing.assert_close(got[:, :50], want[:, :50], rtol=0, atol=0)  # the prompt's rows: untouched
        new, old = got[:, 50:].float(), want[:, 50:].float()  # [L, 8, Hkv, hd]
        scale = old.abs().amax(dim=(-1, -2), keepdim=True)  # [L, 8, 1, 1] each row's largest
        assert ((new[0] - old[0]).abs() <= 2 ** -8 * (old[0].abs() + scale[0])).all()
        assert ((new - old).abs() <= 2 ** -5 * (old.abs() + scale)).all()


@needs_native
def test_native_whole_step_numbers_do_not_depend_on_the_thread_count(tiny_qwen2_dir):
    """The step picks one thread or torch's count by speed as it goes: either gives the same bits."""
    model = _load(tiny_qwen2_dir, torch.bfloat16)
    ids = torch.randint(0, 49152, (70,), generator=torch.Generator().manual_seed(13))
    results = []
    for threads in (1, 2, 3):
        _, cache = prefill(model, ids, extra=1)  # (inference tensors: written in inference mode below)
        _native_step(model, cache, 9)  # builds the stepper at position 70 ...
        cache.length = 70  # ... then rewrite that row with an explicit thread count
        step, logits = cache.stepper, torch.empty(49152)
        with torch.inference_mode():
            step.h.copy_(model.embed_tokens[9])
            step.whole(70, step.h[0], logits, threads)
        results.append((logits, step.h.clone(), cache.k[:, 70].clone(), cache.v[:, 70].clone()))
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            assert torch.equal(a, b)


def test_thread_picker_follows_the_faster_count_and_probes_the_other():
    picker = native_decode.ThreadPicker(2)
    timed = []
    for _ in range(2):  # each count timed once to begin with
        timed.append(picker.pick())
        picker.record(timed[-1], 0.010 if timed[-1] == 2 else 0.020)
    assert sorted(timed) == [1, 2]
    picks = [picker.pick() for _ in range(3 * native_decode.PROBE_EVERY)]
    assert picks.count(1) in (2, 3) and picks.count(2) == len(picks) - picks.count(1)  # one probe per round
    for _ in range(20):  # two threads slow down (a busy CPU): one thread takes over, probes aside
        picker.record(2, 0.090)
    assert picker.pick() == 1 or picker.pick() == 1
    assert native_decode.ThreadPicker(1).pick() == 1


def test_native_off_runs_the_reference_bits(tiny_llama_hd64_dir):
    """A model loaded with native=False (KVRAG_NATIVE=0, config.py): decode_step's default falls back to torch's
    ops, the reference's bits."""
    model = _load(tiny_llama_hd64_dir, torch.bfloat16)
    model.native = False  # as Runtime.load(native=False) sets it
    ids = torch.randint(0, 49152, (30,), generator=torch.Generator().manual_seed(12))
    feed = [3, 4, 5]
    for new, ref in zip(_steps(model, decode_step, ids, feed), _steps(model, decode_step_reference, ids, feed),
                        strict=True):
        torch.testing.assert_close(new, ref, rtol=0, atol=0)


def test_cache_rows_written_by_another_step_are_seen(tiny_llama_dir):
    """A row fed through the reference step between two one-row steps is attended to like any other."""
    model = _load(tiny_llama_dir, torch.float32)
    ids = torch.randint(0, 49152, (20,), generator=torch.Generator().manual_seed(9))
    _, mixed = prefill(model, ids, extra=3)
    _, plain = prefill(model, ids, extra=3)
    for step, token in zip([decode_step, decode_step_reference, decode_step], [5, 6, 7], strict=True):
        got = step(model, mixed, token)
        want = decode_step_reference(model, plain, token)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


PASSAGES = [
    ("Lake Baikal in Siberia is the deepest lake on Earth, over 1,600 metres deep, and holds about a fifth of "
     "the world's unfrozen fresh water. ", "How deep is Lake Baikal?"),
    ("The Amazon carries more water than any other river on Earth. It rises in the Andes of Peru and reaches the "
     "Atlantic in Brazil. ", "Where does the Amazon rise?"),
    ("Marie Curie was born in Warsaw in 1867. She won the Nobel Prize in Physics in 1903 and in Chemistry in "
     "1911, the first person to win it twice. ", "In which city was Marie Curie born?"),
]


@pytest.mark.real_model
@pytest.mark.parametrize("passage, question", PASSAGES)
def test_real_row_step_greedy_tokens_equal_the_reference(smol, smol_tokenizer, passage, question):
    """SmolLM2 in bf16 (the demo's dtype here): the same greedy answer, token for token and logit for logit, as
    the reference step; the native kernels' logits stay within bf16 steps of it (teacher-forced on its tokens)."""
    from kvrag.model.prompt import PromptBuilder

    model = Transformer.from_safetensors(smol.config, smol.weight_files(), torch.bfloat16)
    builder = PromptBuilder(smol_tokenizer)
    ids = torch.tensor(builder.build([builder.passage_ids("", passage * 4)], question).flat())
    tokens = _greedy(model, decode_step_reference, ids, 40)
    assert _greedy(model, _exact_step, ids, 40) == tokens
    ref = _steps(model, decode_step_reference, ids, tokens)
    for new, want in zip(_steps(model, _exact_step, ids, tokens), ref, strict=True):
        torch.testing.assert_close(new, want, rtol=0, atol=0)


NEAR_TIE = 0.125  # a top-2 logit margin under one bf16 step at logits 16-32: a coin toss between bf16 paths


def _invented_prompt(builder, item) -> torch.Tensor:
    return torch.tensor(builder.build([builder.passage_ids(c["title"], c["text"]) for c in item["ctxs"][:1]],
                                      item["question"]).flat())


@needs_native
@pytest.mark.real_model
def test_real_native_logits_as_close_to_float32_as_the_reference(smol, smol_tokenizer, invented_items):
    """SmolLM2, teacher-forced on the reference's 64 greedy tokens: the head of the native step's distribution
    (the reference's best RESCORED logits) is as close to the float32 model's as the reference's own (mean error
    within 1.25x, measured 0.21-0.24 for both), so the two bf16 paths differ by independent roundings: at most
    1.25 here (measured up to 0.8, near twice the reference's own largest error of 0.5-0.6)."""
    from kvrag.model.prompt import PromptBuilder

    model = Transformer.from_safetensors(smol.config, smol.weight_files(), torch.bfloat16)
    exact = Transformer.from_safetensors(smol.config, smol.weight_files(), torch.float32)
    ids = _invented_prompt(PromptBuilder(smol_tokenizer), invented_items[0])
    tokens = _greedy(model, decode_step_reference, ids, 64)
    ref, new = _steps(model, decode_step_reference, ids, tokens), _steps(model, _native_step, ids, tokens)
    truth = _steps(exact, decode_step_reference, ids, tokens)
    ref_err, new_err = [], []
    for a, b, t in zip(new, ref, truth, strict=True):
        top = b.topk(RESCORED).indices  # [K]
        assert (a[top] - b[top]).abs().max() <= 1.25
        ref_err.append(float((b[top] - t[top]).abs().mean()))
        new_err.append(float((a[top] - t[top]).abs().mean()))
    assert sum(new_err) <= 1.25 * sum(ref_err)


@needs_native
@pytest.mark.real_model
def test_real_native_greedy_parts_from_the_reference_only_at_near_ties(smol, smol_tokenizer, invented_items):
    """64 greedy tokens on six invented prompts: the native answer is the reference's token for token until, if
    ever, a step whose reference top-2 margin is a near-tie (bf16 noise picks either there). Measured on a
    2-core EPYC: 3 of 6 identical, the others parting at margins of 0.004-0.025; at least 2 must be whole."""
    from kvrag.model.prompt import PromptBuilder

    model = Transformer.from_safetensors(smol.config, smol.weight_files(), torch.bfloat16)
    builder, whole = PromptBuilder(smol_tokenizer), 0
    for item in invented_items[:6]:
        ids = _invented_prompt(builder, item)
        tokens = _greedy(model, decode_step_reference, ids, 64)
        new = _greedy(model, _native_step, ids, 64)
        first = next((i for i, (a, b) in enumerate(zip(new, tokens, strict=True)) if a != b), None)
        whole += first is None
        if first is not None:
            logits = _steps(model, decode_step_reference, ids, tokens[:first])[-1]  # before token `first`
            best = logits.topk(2).values
            assert best[0] - best[1] < NEAR_TIE, f"parted at token {first} with a margin of {best[0] - best[1]:.3f}"
    assert whole >= 2


# ---- kernels/decode.cpp against torch ------------------------------------------------------------------------
