"""kvrag's benchmarks, each a `kvrag bench <what>` subcommand (commands.py, commands_parts.py, commands_systems.py),
registered on the CLI by plugin.py, which the CLI finds by name: nothing in the library imports them, and they need
the `bench` extra (matplotlib, openai).

    rag/              `kvrag bench --dataset ...`: every method on the same questions (the RAG comparison)
    engine_decode.py  `kvrag bench engine`: the resident engine's batched decode against the memory floor
    decode.py         `kvrag bench decode`: one stream's decode steps (or, with --batches, the batched kernel)
    cold.py           `kvrag bench cold`: a cold `kvrag ask` per process
    codec.py          `kvrag bench codec`: first-token KL of a lossy KV codec against fp16
    precompute.py     `kvrag bench precompute`: what storing costs precompute
    tiers.py          `kvrag bench tiers`: the cache-policy ablation over a Zipf workload
    replay.py         that workload and its replay through the tiers' bookkeeping (no model runs)
    model.py          `kvrag bench model`: load times, prefill speed, bf16 fidelity
    load.py           `kvrag bench load`: staging stored KV against memcpy, copies and launches a layer
    gpu*.py           `kvrag bench gpu`: the Triton kernels and TTFT against the floor on a CUDA GPU
"""
