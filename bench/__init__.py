"""kvrag's benchmarks, each a `kvrag bench <what>` subcommand (cli/bench_cmd.py, cli/bench_more.py).

They import the library; nothing in the library imports them.

    rag/              `kvrag bench --dataset ...`: every method on the same questions (the RAG comparison)
    engine_decode.py  `kvrag bench engine`: the resident engine's batched decode against the memory floor
    decode.py         `kvrag bench decode`: one stream's decode steps (or, with --batches, the batched kernel)
    cold.py           `kvrag bench cold`: a cold `kvrag ask` per process
    codec.py          `kvrag bench codec`: first-token KL of a lossy KV codec against fp16
    precompute.py     `kvrag bench precompute`: what storing costs precompute
    tiers.py          `kvrag bench tiers`: the cache-policy ablation over a Zipf workload
    replay.py         that workload and its replay through the tiers' bookkeeping (no model runs)
    model.py          `kvrag bench model`: load times, prefill speed, bf16 fidelity
"""
