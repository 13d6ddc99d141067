"""kvrag's settings, resolved once at the edge (the CLI, the server, the API's constructor) and passed down.

Each setting is taken from the caller's option where one is given (not None), else from its environment variable,
else from its default; nothing below this module reads the environment (home.py aside: where kvrag keeps its files).

    setting          variable               default
    model            KVRAG_MODEL            None: smollm2 (SmolLM2-135M-Instruct); else a short name (model/names.py),
                                            a .gguf file, or a local Hugging Face directory
    dtype            KVRAG_DTYPE            auto (bfloat16 on CUDA and on CPUs with AMX or AVX512-BF16, else float32)
    device           KVRAG_DEVICE           auto (cuda where torch sees one)
    kernels          KVRAG_KERNELS          auto (Triton's on a GPU); torch: SDPA and per-sequence decode
    threads          KVRAG_THREADS          None: every core
    native           KVRAG_NATIVE           True; 0 turns kvrag's C++ CPU kernels off
    isa              KVRAG_ISA              auto: the best build of those kernels this CPU runs (avx512, avxvnni, avx2);
                                            a lower one by name (an AVX2 machine's path on an AVX-512 one), none: off
    compiler         CXX                    None: c++ or g++ on the PATH (to build those kernels once)
    malloc_defaults  KVRAG_MALLOC_DEFAULTS  False: keep freed memory in the process (faster prefills on a CPU)
    max_map_size     KVRAG_MAX_MAP_SIZE     None: LMDB's map may grow to 1 TiB (bytes; mainly to simulate a full disk)
    remote_cache     KVRAG_REMOTE_CACHE     10GiB: the local cache of a store on object storage
    mirror_dir       KVRAG_MIRROR_DIR       None: <home>/remote/<bucket>/<prefix>
    host_cache       KVRAG_HOST_CACHE       4GiB: the host memory tier (0: none)
    gpu_cache        KVRAG_GPU_CACHE        None: 0, or on a GPU a share of its memory (store/tiers/config.py)
    cache_policy     KVRAG_CACHE_POLICY     pgdsf (or gdsf, lru)
    reorder_window   KVRAG_REORDER_WINDOW   8: a waiting question is passed over at most this often (0: FIFO)
    chat_cache       KVRAG_CHAT_CACHE       1GiB: the most of the KV pool cached prompt blocks may hold (0: none)
    kept_passages    KVRAG_KEPT_PASSAGES    1GiB: the store's room for passages kept from clients' prompts, the least
                                            valuable (PGDSF) evicted to make room (0: none kept)
    prefix_store     KVRAG_PREFIX_STORE     4GiB: the store's room for the prefix cache's blocks, spilled there so that a
                                            chat outlives the server and any replica finds it (engine/prefix_spill.py; 0: none)
    model_check      KVRAG_MODEL_CHECK      True: blend only a model that passed its blending check (docs/model-check.md;
                                            0: skip the check, for tests and benchmarks that blend on purpose)
    check_budget     KVRAG_CHECK_BUDGET     300: seconds a model's first use may spend on its blending check's answers; a
                                            slower check is put off (answered in full until `kvrag model check` runs it)
    cuda_graphs      KVRAG_CUDA_GRAPHS      False: on a GPU, replay the decode step from CUDA graphs (engine/decode_graphs.py;
                                            off until the GPU check has measured it: docs/gpu.md)
    weights          KVRAG_WEIGHTS          auto: the layers' matrices dense, int8, int4 or mixed (model/quant.py)
    lead_in          KVRAG_LEAD_IN          None: 2,048 tokens of corpus text before each stored chunk of a model whose
                                            layers slide, none for the others (precompute/lead_in.py; 0: none)

The AWS_* variables (credentials, endpoint, region) are kept as they are for a store on object storage. The rest
(kv_budget, max_running, max_waiting, codec, keep, ...) are options alone, with the defaults below.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

from kvrag.errors import KvragError

DEFAULT_REORDER_WINDOW = 8  # RAGCache's reordering passes a request over at most this often
# retrieval's absolute cutoff (`min_score`, cosine similarity): under it a chunk is not about the question, and a
# request left with none is answered as plain chat; chosen on a tune split in docs/retrieval-cutoff.md
MIN_SCORE = 0.33
# The default rules of Keyformer's two uses (issue 41; docs/keyformer.md has the figures that chose them): which
# tokens a reduced stored chunk keeps, and which rows a decode-time budget keeps.
KEEP_RULE = "window"
KV_RULE = "keyformer"
DEFAULT_SELECTION = "chunks"  # the blend's selection rule (blend/selection.py, blend/config.py says why)


@dataclass(frozen=True)
class KVRagConfig:
    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    kernels: str = "auto"
    threads: int | None = None
    native: bool = True
    isa: str = "auto"  # which build of kvrag's kernels runs (kernels/native.py); none: torch's paths
    weights: str = "auto"  # the layers' matrices: dense, int8, int4, mixed or auto (model/quant.py)
    compiler: str | None = None
    malloc_defaults: bool = False
    max_map_size: int | None = None
    remote_cache: str = "10GiB"
    mirror_dir: str | None = None
    host_cache: str | None = None
    gpu_cache: str | None = None
    cache_policy: str | None = None
    reorder_window: int = DEFAULT_REORDER_WINDOW
    chat_cache: str = "1GiB"  # the most of the KV pool cached prompt blocks may hold (kvcache/prefix_cache.py); "0": none
    kept_passages: str = "1GiB"  # the most the clients' kept passages may take in the store (engine/kept_passages.py)
    prefix_store: str = "4GiB"  # the most the prefix cache's spilled blocks may take in the store (engine/prefix_spill.py)
    retrieval: str = "auto"  # where retrieval happens: RETRIEVAL, below
    model_check: bool = True  # run (once, then stored) engine/model_check.py; a model that fails it answers in full
    check_budget: int = 300  # seconds a first use may spend on the check's answers (engine/answer_check.py)
    cuda_graphs: bool = False  # the decode step replayed from CUDA graphs (Triton path on a GPU only)
    lead_in: int | None = None  # tokens of corpus text a stored chunk follows (None: the model's own, lead_in.py)
    # options alone
    codec: str = "fp16"
    kv_budget: str = "1GiB"  # memory for the KV of the sequences being answered
    max_running: int = 32
    max_waiting: int = 0  # refuse a new request (QueueFull) while this many wait (0: no bound)
    speculate: bool = False  # start a retrieved question's prefill on an IVF index's early stages (engine/speculation.py)
    keep: float = 1.0  # with keep_rule: read the reduced chunks `kvrag precompute --keep --keep-rule` stored (1: full)
    keep_rule: str = KEEP_RULE
    preload_retriever: bool = True  # load the retriever beside the model (else at the first retrieval)
    # let kvrag set torch's threads and keep freed memory in the C allocator for the whole process (faster prefills)
    tune_process: bool = False
    aws: Mapping[str, str] = field(default_factory=dict)  # the AWS_* variables: a store on object storage

    @classmethod
    def resolve(cls, environ: Mapping[str, str] | None = None, **options) -> KVRagConfig:
        """Options (None: not given) over `environ` (default: the process's environment) over the defaults;
        KvragError (one line) for an unknown option or a variable that does not parse."""
        environ = os.environ if environ is None else environ
        known = {f.name: f for f in fields(cls)}
        if unknown := sorted(set(options) - set(known)):
            raise KvragError(f"unknown setting(s): {', '.join(unknown)}")
        values = {}
        for name, spec in known.items():
            if options.get(name) is not None:
                values[name] = options[name]
            elif name in ENVIRONMENT and environ.get(ENVIRONMENT[name]):
                values[name] = _parse(ENVIRONMENT[name], environ[ENVIRONMENT[name]], spec.default)
        if options.get("aws") is None:
            values["aws"] = {k: v for k, v in environ.items() if k.startswith("AWS_")}
        config = cls(**values)
        if config.retrieval not in RETRIEVAL:
            raise KvragError(f"retrieval must be one of {', '.join(RETRIEVAL)}, got {config.retrieval!r}")
        if config.lead_in is not None and config.lead_in < 0:
            raise KvragError(f"the lead-in must be >= 0 tokens, got {config.lead_in}")
        if config.check_budget < 0:
            raise KvragError(f"the check's budget must be >= 0 seconds, got {config.check_budget}")
        if config.reorder_window < 0:
            raise KvragError(f"the reorder window must be >= 0, got {config.reorder_window}")
        return config


ENVIRONMENT = {"compiler": "CXX"} | {name: f"KVRAG_{name.upper()}" for name in (
    "model dtype device kernels threads native isa weights malloc_defaults max_map_size remote_cache mirror_dir host_cache "
    "gpu_cache cache_policy reorder_window chat_cache kept_passages prefix_store model_check check_budget retrieval cuda_graphs lead_in").split()}
# auto: retrieve for a question unless its prompt carries passages of its own (stored ones, or passage-like text);
# server: always (a request's `rag: false` aside); client: never, the application sends its passages
RETRIEVAL = ("auto", "server", "client")
MODES = ("blend", "full", "prefix", "reuse")  # how a prompt's KV is made (engine/prefiller.py)


def _parse(variable: str, text: str, default):
    """A variable's text as its setting's type (the default's; None defaults are text, or an int for threads)."""
    if isinstance(default, bool):
        return text.strip().lower() not in ("0", "false", "no", "off", "")
    if isinstance(default, int) or variable in ("KVRAG_THREADS", "KVRAG_MAX_MAP_SIZE", "KVRAG_LEAD_IN"):
        try:
            return int(text)
        except ValueError:
            raise KvragError(f"{variable} must be an integer, got {text!r}") from None
    return text
