"""`kvrag bench gpu` (issue 28): the CPU smoke run end to end (every section, every number positive; the floor is
not held against CPU times), the refusal without a GPU, the 8B-shaped config's size, and the byte and FLOP
formulas on hand-computed cases."""

from __future__ import annotations

import json
import math

import pytest
import torch

from kvrag.bench import gpu_e2e, gpu_kernels
from kvrag.tests.conftest import run_cli_in_process

SECTIONS = ("## Device peaks", "## Kernels", "## End to end", "## Targets")


def test_the_cpu_smoke_run_reports_every_part(smol, tmp_path, kvrag):
    # in a process of its own: the run turns Triton's interpreter on, which must come before its kernels load
    out = tmp_path / "bench-gpu.json"
    stdout = kvrag("bench", "gpu", "--cpu-smoke", "--out", str(out)).stdout
    assert all(s in stdout for s in SECTIONS), stdout
    report = json.loads(out.read_text())
    assert report["smoke"] and all(report["peaks"][k] > 0 for k in ("matmul_tflops", "copy_gbps", "h2d_gbps"))
    sizes = gpu_kernels.SMOKE_KERNELS
    kernels = [k["kernel"] for k in report["kernels"]]
    assert kernels.count("decode_attention") == len(sizes.batches) * len(sizes.contexts)
    assert kernels.count("rows_attention") == 1 and kernels.count("load_layers") == 2
    for k in report["kernels"]:
        assert k["ms"] > 0 and k["gbps"] > 0 and k["bytes"] > 0, k
        assert k["kernel"] == "load_layers" or k["tflops"] > 0, k
        assert k["baseline"] is None or (k["baseline_ms"] > 0 and k["speedup"] > 0), k
    models = report["e2e"]
    assert len(models) == 2 and all(m["items"] == 2 and m["store"]["passages"] > 0 for m in models)
    for m in models:
        for key in ("full_ms", "blend_ms", "floor_full_ms", "floor_blend_ms", "loaded_mb_mean", "blend_vs_full"):
            assert m[key] > 0, (m["model"], key)
        for r in m["records"]:
            assert 0 < r["recomputed"] < r["chunk_rows"] < r["prompt_tokens"]
            assert 0 < r["blend_flops"] < r["full_flops"]
        # the tier run: the first chunk an exact path of depth 1 (its stored KV), every other from the host tier
        assert m["tier_ms"] > 0 and m["tier_from_store"] == 0, m["model"]
        for r in m["records"]:
            n = sum(r["tier_chunks"].values())
            assert n > 1 and r["tier_chunks"] == {"tree": 1, "host": n - 1} and r["tier_bytes_loaded"] == 0, r
        launches = m["launches"]
        assert launches["full"]["ops"] > 0 and launches["blend"]["ops"] > 0
        assert all(c["kernels"] is None and c["copies"] is None for c in launches.values())  # no GPU here
    judged = [t["what"] for t in report["targets"]]
    assert len(judged) == 4 and all(isinstance(t["met"], bool) for t in report["targets"])
    assert any("tier_vs_full" in w for w in judged) and any("full_vs_floor" in w for w in judged)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_without_a_gpu_it_refuses_in_one_line(monkeypatch, capsys):
    code, stdout, err = run_cli_in_process(monkeypatch, capsys, "bench", "bench", "gpu", "--items", "3")
    assert code != 0 and stdout == ""
    assert len(err.strip().splitlines()) == 1 and "needs a CUDA GPU" in err


def test_the_8b_shaped_config_has_llama_3_1_8b_parameter_count():
    cfg = gpu_e2e.llama8b_config()
    d, inter, v = 4096, 14336, 128256
    per_layer = 2 * d * d + 2 * d * 1024 + 3 * d * inter + 2 * d  # q, o; k, v (8 heads of 128); MLP; two norms
    assert gpu_e2e.param_count(cfg) == 2 * v * d + d + 32 * per_layer == 8_030_261_248  # HF's count for the model
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.rope_scaling.rope_type) == (32, 8, 128, "llama3")


def test_kernel_bytes_and_flops_on_a_hand_computed_case():
    # 2 sequences of 10 keys, 2 query heads over 1 KV head of dim 4, bf16: K and V 2*2*10*4*2 = 320 bytes,
    # q 2*2*4*2 = 32, float32 out 2*2*4*4 = 64; FLOPs 4*2*2*10*4 = 640
    assert gpu_kernels.decode_work(2, 10, 2, 1, 4) == (416, 640)
    # rows seeing 3 and 5 keys: K and V up to 5 rows 2*5*4*2 = 80, q and out 2*2*4*(2+4) = 96; 4*2*4*(3+5) = 256
    assert gpu_kernels.rows_work(torch.tensor([3, 5]), 2, 1, 4) == (176, 256)
    # 2 layers x 3 tokens x 1 head x 4: int8 read 2*24, bf16 written 2*24*2, scales 4*(2*4 + 2*3)
    assert gpu_kernels.load_bytes(2, 3, 1, 4, 1, 2, True) == 48 + 96 + 56
    assert gpu_kernels.load_bytes(2, 3, 1, 4, 2, 2, False) == 96 + 96


TINY = gpu_e2e.ModelConfig(**{**vars(gpu_e2e.smoke_config()), "vocab_size": 10, "hidden_size": 4,
                              "intermediate_size": 8, "n_layers": 3, "n_heads": 2, "n_kv_heads": 1, "head_dim": 2})


def test_prefill_flops_on_a_hand_computed_case():
    # a row passes through q 4x4, k and v 2 x 4x2, o 4x4, MLP 3 x 4x8: P = 16 + 16 + 16 + 96 = 144 (K/V: 16);
    # attention costs 4 * Hq * hd = 16 a (row, visible key)
    assert gpu_e2e.layer_params(TINY) == (144, 16)
    # full prefill of 4 rows (positions 0..3 see 1+2+3+4 = 10 keys): layers 0 and 1 each 2*144*4 + 16*10 = 1312;
    # the last: K/V of 4 rows 2*16*4 = 128, the rest for one row 2*128 = 256 and its 4 keys 16*4 = 64; head 2*10*4
    full = gpu_e2e.PromptRows(preamble=1, chunks=2, exact=1, suffix=1)
    assert gpu_e2e.full_flops(TINY, full) == 2 * 1312 + 128 + 256 + 64 + 80
    # blend: preamble 1, chunks at positions 1..4 of which 1..2 exact, suffix at 5. Layer 0 computes chunk rows 3, 4
    # (4 and 5 keys) and the suffix (6): 2*144*3 + 16*15 = 1104; layer 1 one selected row, taken at the middle
    # (4.5 keys), and the suffix: 2*144*2 + 16*10.5 = 744; the last: K/V of those 2 rows 64, one row 256 + 16*6
    blend = gpu_e2e.PromptRows(preamble=1, chunks=4, exact=2, suffix=1)
    assert gpu_e2e.blend_flops(TINY, blend, selected=1) == 1104 + 744 + 64 + 256 + 96 + 80
    # the floor is the larger of loading (2 GB at 20 GB/s) and computing (1 TFLOP at 500 TFLOP/s)
    assert math.isclose(gpu_e2e.floor_s(2e9, 1e12, {"h2d_gbps": 20, "matmul_tflops": 500}), 0.1)
