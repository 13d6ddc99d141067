"""`kvrag bench gpu`, end to end: TTFT of a full prefill and of blend@0.15 per MuSiQue item, against the physical
floor (issue 28).

Models: SmolLM2 (the default, its real weights) and a Llama-3.1-8B-shaped model whose bf16 weights are drawn at
random on the device (speed only: it answers nothing), prompted through SmolLM2's tokenizer (ids < its vocab). A
model's store is filled first (every passage's KV after the preamble, fp16, uncompressed, into a temporary
directory: timed apart), then each item is prefilled in full and blended at 0.15, in alternating order, each
between torch.cuda.synchronize() calls, after one untimed item that warms both up. Then the same blend with every
chunk's stored KV in the host tier (pinned on a GPU) and no path of them on the knowledge tree but the first chunk's
(reused exactly, as the store's blend does): the tier is warmed by a blend of the item's chunks in reverse order,
then this order is timed. Last, one item's kernels and
copies on the device (torch's profiler) per mode: what a question launches.

The floor of a prefill is max(bytes loaded / host-to-device GB/s, FLOPs / bf16 matmul TFLOP/s), both measured
(bench/gpu_kernels.py), with FLOPs = 2 * params_per_token * rows + attention FLOPs, counted per layer:
    a layer computing r rows whose queries see k keys on average:  2 P r + 4 Hq hd r k
        P = D Hq hd (q) + 2 D Hkv hd (k, v) + Hq hd D (o) + 3 D I (MLP): the matmul weights a row passes through
    the last layer:  K and V of its r rows (2 * 2 D Hkv hd r), the rest of the layer for the last row alone
        (2 (P - 2 D Hkv hd) + 4 Hq hd N), and the LM head (2 V D)
    full prefill:  r = N at every layer, k = (N + 1) / 2 (the row at position p sees p + 1 keys)
    blend:  before the check layer, the chunk rows but the first chunk's (reused exactly as loaded) and the suffix;
        from it on, the selected chunk rows and the suffix, selected rows taken at the middle of the chunk rows
        that can be selected. The check layers' wider selection and their unselected rows' K/V are left out: the
        floor is a bound from below.
"""

from __future__ import annotations

import math
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from kvrag.bench.keyformer_load import item_chunks
from kvrag.blend.config import BlendConfig
from kvrag.engine.memory import build_cache
from kvrag.engine.prefiller import Prefiller
from kvrag.model.config import ModelConfig, RopeScaling
from kvrag.model.device import resolve_triton
from kvrag.model.files import LocalModel, resolve_model
from kvrag.model.prompt import PromptBuilder
from kvrag.model.runtime import Runtime
from kvrag.model.transformer import Transformer
from kvrag.precompute.plain import chunk_kv, layers_to_numpy
from kvrag.store.env import StoreEnv

RATIO = 0.15
CODEC = "fp16"  # its first chunk is reused exactly (Prefiller._exact_first_rows), as in `kvrag ask`
EXTRA = 16  # decode slots a prefill reserves past the prompt
HOST_TIER = {"cuda": "4GiB", "cpu": "256MiB"}  # an item's stored KV and its blended path (8B-shaped, 6k: 1.6 GB)
FLOOR = ("floor = max(bytes loaded / pinned H2D GB/s, FLOPs / bf16 matmul TFLOP/s); FLOPs = 2 * params_per_token "
         "* rows + 4 Hq hd * rows * visible keys, per layer (rows: every prompt row for a full prefill; for the "
         "blend, its chunk rows but the first chunk's and the suffix before the check layer, the selected rows "
         "and the suffix after), + 2 V D for the LM head")


def llama8b_config() -> ModelConfig:
    """Llama-3.1-8B's shape, written out (nothing downloaded)."""
    return ModelConfig(architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                       n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128, rms_eps=1e-5, rope_theta=500000.0,
                       rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 8192), qkv_bias=False,
                       tie_embeddings=False, max_positions=131072)


def smoke_config() -> ModelConfig:
    """The same architecture at CPU-smoke size (SmolLM2's vocab: its tokenizer's ids must fit)."""
    return replace(llama8b_config(), vocab_size=49152, hidden_size=64, intermediate_size=128, n_layers=2,
                   n_heads=4, n_kv_heads=2, head_dim=16)


def hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Llama checkpoint by its Hugging Face name, with its shape."""
    d, q, kv, inter = cfg.hidden_size, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.intermediate_size
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, d), "model.norm.weight": (d,)}
    if not cfg.tie_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, d)
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (q, d), p + "self_attn.k_proj.weight": (kv, d),
                       p + "self_attn.v_proj.weight": (kv, d), p + "self_attn.o_proj.weight": (d, q),
                       p + "mlp.gate_proj.weight": (inter, d), p + "mlp.up_proj.weight": (inter, d),
                       p + "mlp.down_proj.weight": (d, inter), p + "input_layernorm.weight": (d,),
                       p + "post_attention_layernorm.weight": (d,)})
    return shapes


def param_count(cfg: ModelConfig) -> int:
    return sum(math.prod(shape) for shape in hf_shapes(cfg).values())


class RandomWeights(Mapping):
    """A checkpoint's tensors by HF name, each drawn on the device when Transformer takes it (std 0.02, norms 1),
    so the q/k/v and gate/up it fuses never stand beside the whole model."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int = 0):
        self.shapes, self.dtype, self.device, self.seed = hf_shapes(cfg), dtype, device, seed

    def __getitem__(self, name: str) -> torch.Tensor:
        shape = self.shapes[name]
        if len(shape) == 1:
            return torch.ones(shape, dtype=self.dtype, device=self.device)
        gen = torch.Generator(self.device).manual_seed(self.seed + list(self.shapes).index(name))
        return torch.randn(shape, generator=gen, dtype=self.dtype, device=self.device).mul_(0.02)

    def __contains__(self, name: object) -> bool:  # without drawing the tensor, as Mapping's would
        return name in self.shapes

    def __iter__(self):
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


def random_runtime(cfg: ModelConfig, device: torch.device, dtype: torch.dtype,
                   tokens: LocalModel | None = None) -> Runtime:
    """A Runtime of random weights of the shape cfg, with the tokenizer and prompts of `tokens` (default: the
    installed SmolLM2's)."""
    smol = tokens or resolve_model(None)
    model = Transformer(cfg, RandomWeights(cfg, dtype, device), dtype, device)
    model.triton = resolve_triton(None, device)
    local = LocalModel(f"random {cfg.n_layers}x{cfg.hidden_size}", smol.path, cfg,
                       f"random-{cfg.n_layers}x{cfg.hidden_size}-{cfg.vocab_size}", smol.tokenizer_fingerprint)
    tokenizer = smol.load_tokenizer()
    return Runtime(local, model, tokenizer, PromptBuilder(tokenizer))


# ---- the floor -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PromptRows:
    preamble: int
    chunks: int  # chunk rows
    exact: int  # leading chunk rows a blend reuses exactly (the first chunk's)
    suffix: int

    @property
    def total(self) -> int:
        return self.preamble + self.chunks + self.suffix


def layer_params(cfg: ModelConfig) -> tuple[int, int]:
    """(P, the K/V part of P): the matmul weights a row passes through in one layer (module doc)."""
    d, hd = cfg.hidden_size, cfg.head_dim
    kv = 2 * d * cfg.n_kv_heads * hd
    return 2 * d * cfg.n_heads * hd + kv + 3 * d * cfg.intermediate_size, kv


def forward_flops(cfg: ModelConfig, layers: list[tuple[float, float]], last_rows: float, n_keys: int) -> float:
    """FLOPs of a prefill: `layers` (rows, their mean visible keys) for every layer but the last; the last one
    computes K/V of last_rows rows and the rest (over n_keys keys) for the last row, then the LM head."""
    per_row, kv = layer_params(cfg)
    attn = 4 * cfg.n_heads * cfg.head_dim  # per (query row, visible key): q.k and p.v
    body = sum(2 * per_row * rows + attn * rows * keys for rows, keys in layers)
    return body + 2 * kv * last_rows + 2 * (per_row - kv) + attn * n_keys + 2 * cfg.vocab_size * cfg.hidden_size


def full_flops(cfg: ModelConfig, p: PromptRows) -> float:
    n = p.total
    return forward_flops(cfg, [(n, (n + 1) / 2)] * (cfg.n_layers - 1), n, n)


def blend_flops(cfg: ModelConfig, p: PromptRows, selected: int, check_layer: int = 1) -> float:
    """A blend recomputing `selected` chunk rows from the check layer on (module doc)."""
    chunk_keys = p.preamble + (p.exact + p.chunks + 1) / 2  # mean visible keys of a computed chunk row
    suffix_keys = p.preamble + p.chunks + (p.suffix + 1) / 2

    def rows(chunk_rows: int) -> tuple[float, float]:
        n = chunk_rows + p.suffix
        return n, (chunk_rows * chunk_keys + p.suffix * suffix_keys) / max(n, 1)

    before, after = rows(p.chunks - p.exact), rows(selected)
    layers = [before] * check_layer + [after] * (cfg.n_layers - 1 - check_layer)
    return forward_flops(cfg, layers, after[0], p.total)


def floor_s(bytes_loaded: int, flops: float, peaks: dict) -> float:
    return max(bytes_loaded / (peaks["h2d_gbps"] * 1e9), flops / (peaks["matmul_tflops"] * 1e12))


# ---- the runs --------------------------------------------------------------------------------------------------


def fill_store(runtime: Runtime, engine: Prefiller, items: list[dict]) -> dict:
    """Every distinct passage's KV, computed after the preamble, into the engine's store."""
    start, seen, tokens = _now(), set(), 0
    with torch.inference_mode():
        for item in items:
            for cid, ids in item_chunks(runtime, item):
                if cid not in seen:
                    seen.add(cid)
                    tokens += len(ids)
                    engine.source.table.put_chunk(cid, ids, layers_to_numpy(chunk_kv(runtime, engine.preamble, ids), CODEC))
    return {"passages": len(seen), "tokens": tokens, "seconds": _now() - start}


def _now() -> float:
    """perf_counter once the device's queued work is done."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def time_item(runtime: Runtime, reference: Prefiller, engine: Prefiller, item: dict, blend_first: bool) -> dict:
    """One item's full prefill and blend@RATIO: TTFTs and what the floor needs."""
    chunks = item_chunks(runtime, item)
    runs = {"full": lambda: reference.prefill(chunks, item["question"], "full", extra=EXTRA),
            "blend": lambda: engine.prefill(chunks, item["question"], "blend", BlendConfig(RATIO), extra=EXTRA)}
    seconds, done = {}, {}
    for mode in (("blend", "full") if blend_first else ("full", "blend")):
        start = _now()
        done[mode] = runs[mode]()
        seconds[mode] = _now() - start
    blend = done["blend"]
    n_pre = len(runtime.prompts.preamble_ids)
    rows = PromptRows(n_pre, blend.chunk_tokens, len(chunks[0][1]) if chunks else 0,
                      done["full"].prompt_tokens - n_pre - blend.chunk_tokens)
    cfg = runtime.model.cfg
    return {"full_s": seconds["full"], "blend_s": seconds["blend"], "bytes_loaded": blend.bytes_loaded,
            "prompt_tokens": rows.total, "chunk_rows": rows.chunks, "recomputed": blend.recomputed_chunk_tokens,
            "full_flops": full_flops(cfg, rows), "blend_flops": blend_flops(cfg, rows, blend.recomputed_chunk_tokens)}


def warm_tier(tiered: Prefiller, item: dict, chunks: list) -> None:
    """The item's chunks blended in reverse order: the tier then holds each one's stored KV, and the tree no path
    of them in their own order but the first chunk alone (its stored KV is its exact KV after the preamble)."""
    tiered.prefill(chunks[::-1], item["question"], "blend", BlendConfig(RATIO), extra=EXTRA)
    tiered.flush_write_back()


def time_tier(runtime: Runtime, tiered: Prefiller, item: dict) -> dict:
    """blend@RATIO with the chunks' stored KV in the host tier and no prefix of them on the tree but the first
    chunk, as the store's blend reuses it (module doc)."""
    chunks, config = item_chunks(runtime, item), BlendConfig(RATIO)
    warm_tier(tiered, item, chunks)
    start = _now()
    done = tiered.prefill(chunks, item["question"], "blend", config, extra=EXTRA)
    seconds = _now() - start
    tiered.flush_write_back()
    return {"tier_s": seconds, "tier_chunks": dict(Counter(done.chunk_tiers)), "tier_bytes_loaded": done.bytes_loaded}


def count_launches(run: Callable[[], object]) -> dict:
    """What one call ran, by torch's profiler: `ops` the aten operators dispatched (on any device), and on a GPU
    `kernels` and `copies` (memcpy and memset) the device executed, `launch_calls` the host's kernel launches and
    `graph_launches` its CUDA graph launches; None where no GPU ran them."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    _now()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        run()
        _now()
    events = prof.events()
    device = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    host = [e.name for e in events if e.device_type != torch.autograd.DeviceType.CUDA]
    copies = sum(e.name.startswith(("Memcpy", "Memset")) for e in device)
    return {"ops": sum(name.startswith("aten::") for name in host),
            "kernels": len(device) - copies if cuda else None, "copies": copies if cuda else None,
            "launch_calls": sum("LaunchKernel" in name for name in host) if cuda else None,
            "graph_launches": sum("GraphLaunch" in name for name in host) if cuda else None}


def item_launches(runtime: Runtime, reference: Prefiller, engine: Prefiller, item: dict) -> dict:
    """count_launches of one item's full prefill and blend, warm (the blend reads the store)."""
    chunks = item_chunks(runtime, item)
    return {"full": count_launches(lambda: reference.prefill(chunks, item["question"], "full", extra=EXTRA)),
            "blend": count_launches(lambda: engine.prefill(chunks, item["question"], "blend", BlendConfig(RATIO),
                                                           extra=EXTRA))}


def run_model(name: str, runtime: Runtime, items: list[dict], peaks: dict, log: Callable[[str], None],
              on_item: Callable[[dict], None] | None = None) -> dict:
    """The store filled, a warm-up item, then every item timed (see the module doc); on_item(the summary so far)
    after each item, so a run cut short keeps what it measured."""
    device = runtime.model.device.type
    with tempfile.TemporaryDirectory(prefix="kvrag-bench-gpu-") as tmp, \
            StoreEnv.open(Path(tmp) / "store", create=True) as env:
        engine, reference = Prefiller.open(runtime, env, CODEC, compress=False), Prefiller.open(runtime, None)
        tiered = Prefiller.open(runtime, env, CODEC, compress=False,
                                cache=build_cache(runtime, CODEC, host_cache=HOST_TIER[device], gpu_cache="0"))
        store = fill_store(runtime, engine, items)
        log(f"{name}: store of {store['passages']} passages ({store['tokens']} tokens) in {store['seconds']:.1f} s")
        time_item(runtime, reference, engine, items[0], False)
        warm_tier(tiered, items[0], item_chunks(runtime, items[0]))  # not its own order: item 0 is timed below
        records = []
        for n, item in enumerate(items):
            r = time_item(runtime, reference, engine, item, n % 2 == 1)
            r.update(time_tier(runtime, tiered, item))
            r["floor_full_s"] = floor_s(0, r["full_flops"], peaks)
            r["floor_blend_s"] = floor_s(r["bytes_loaded"], r["blend_flops"], peaks)
            records.append(r)
            if on_item is not None:
                on_item(summarize(name, runtime.model.cfg, store, records))
        log(f"{name}: {len(items)} items timed")
        launches = item_launches(runtime, reference, engine, items[0])
    return {**summarize(name, runtime.model.cfg, store, records), "launches": launches}


def summarize(name: str, cfg: ModelConfig, store: dict, records: list[dict]) -> dict:
    def median(f) -> float:
        return float(np.median([f(r) for r in records]))

    return {"model": name, "params": param_count(cfg), "layers": cfg.n_layers, "items": len(records),
            "store": store, "prompt_tokens_median": median(lambda r: r["prompt_tokens"]),
            "full_ms": 1e3 * median(lambda r: r["full_s"]), "blend_ms": 1e3 * median(lambda r: r["blend_s"]),
            "blend_vs_full": median(lambda r: r["blend_s"] / r["full_s"]),
            "tier_ms": 1e3 * median(lambda r: r["tier_s"]), "tier_vs_full": median(lambda r: r["tier_s"] / r["full_s"]),
            "tier_vs_floor": median(lambda r: r["tier_s"] / r["floor_blend_s"]),
            "tier_from_store": float(np.mean([r["tier_chunks"].get("store", 0) / sum(r["tier_chunks"].values())
                                              for r in records])),
            "floor_full_ms": 1e3 * median(lambda r: r["floor_full_s"]),
            "floor_blend_ms": 1e3 * median(lambda r: r["floor_blend_s"]),
            "full_vs_floor": median(lambda r: r["full_s"] / r["floor_full_s"]),
            "blend_vs_floor": median(lambda r: r["blend_s"] / r["floor_blend_s"]),
            "loaded_mb_mean": float(np.mean([r["bytes_loaded"] for r in records])) / 1e6,
            "recomputed_share": median(lambda r: r["recomputed"] / max(r["chunk_rows"], 1)),
            "records": records}


# issue 38's targets: (model index in the report, measure, bound); the decode ones are judged on the kernels
TARGETS = ((1, "blend_vs_full", 0.4), (1, "tier_vs_full", 0.25), (1, "blend_vs_floor", 3.0),
           (0, "full_vs_floor", 5.0))
DECODE_TARGET = ((16, 64), 1.0)  # decode_attention at these batches at least as fast as SDPA (flash where it runs)


def model_targets(model: dict, role: int) -> list[dict]:
    """The targets of TARGETS' model `role` (0 SmolLM2, 1 the 8B-shaped), judged on `model`'s medians."""
    return [{"what": f"{model['model']}: {key}", "value": model[key], "bound": f"<= {bound:g}",
             "met": model[key] <= bound} for i, key, bound in TARGETS if i == role]


def decode_targets(kernels: list[dict]) -> list[dict]:
    """decode_attention against SDPA at each of DECODE_TARGET's batches, on its slowest context."""
    batches, bound = DECODE_TARGET
    out = []
    for batch in batches:
        speedups = [k["speedup"] for k in kernels if k["kernel"] == "decode_attention" and k["speedup"]
                    and k["shape"].startswith(f"B={batch} ")]
        if speedups:
            out.append({"what": f"decode_attention vs SDPA, B={batch} (slowest context)", "value": min(speedups),
                        "bound": f">= {bound:g}", "met": min(speedups) >= bound})
    return out


def targets(models: list[dict], kernels: list[dict]) -> list[dict]:
    """Each target of issue 38 judged on the medians: {what, value, bound, met}; a decode target per batch (its
    slowest context)."""
    return [t for role, m in enumerate(models) for t in model_targets(m, role)] + decode_targets(kernels)
