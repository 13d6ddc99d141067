"""Shared fixtures: an isolated KVRAG_HOME, the real default model (converted once per session),
tiny random Llama/Qwen2 models built from a config, which most tests use, and invented MuSiQue-shaped
items (tests/invented.py). Only tests marked `benchmark_data` read the real MuSiQue file
(KVRAG_TEST_DATA, default ../shared/data/musique_s.json); without it they skip and the rest still run."""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
# KVRag's first-use blending check (engine/model_check.py) off for the session, so no test pays for it or has its
# blend turned into a full prefill; the gate's own tests (marked model_check) turn it back on
os.environ["KVRAG_MODEL_CHECK"] = "0"
# The weights are not pinned: every test runs the form `auto` gives its model on this CPU (model/names.py's
# default_weights: dense for SmolLM2 and the tiny models, int8 for Qwen2.5-0.5B and mixed for the 1.5B where VNNI is),
# and the engine's tests run int8 too where it can run (WEIGHT_FORMS), each against its own reference
os.environ.pop("KVRAG_WEIGHTS", None)
XDIST_WORKER = bool(os.environ.get("PYTEST_XDIST_WORKER"))
# the user's KVRAG_HOME, before the session's own replaces it: models pulled for the tests (`make test` pulls
# Qwen2.5-Coder-0.5B there) are read from it, never pulled or converted by a test
USER_KVRAG_HOME = os.environ.get("KVRAG_HOME") or ""
if XDIST_WORKER:
    # `make test` runs the suite in one worker a core (pytest-xdist): each computes on one thread, and so does every
    # CLI it starts, or two workers' thread pools would fight over the cores (docs/testing.md)
    os.environ["OMP_NUM_THREADS"] = os.environ["KVRAG_THREADS"] = "1"

import signal  # noqa: E402

import torch  # noqa: E402

if XDIST_WORKER:
    torch.set_num_threads(1)  # (in case a plugin imported torch before the variable above was set)

from kvrag.tests.kernel_paths import isa  # noqa: E402,F401 - every kernel build this CPU runs, a test each
from kvrag.tests.passages import corpus, tiny_runtime  # noqa: E402,F401 - fixtures of the prompt-reuse tests

if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    # A suite started in the background of a non-interactive shell inherits SIGINT ignored, and so would every CLI
    # it starts: the Ctrl-C tests could not interrupt them. A handler (unlike SIG_IGN) resets to the default in a child.
    signal.signal(signal.SIGINT, signal.default_int_handler)

if not torch.cuda.is_available():
    # Triton's kernels run in its interpreter on the CPU, exactly enough to test them against their torch twins
    # (triton decides when a kernel is decorated, so before any kvrag.kernels.triton_* module is imported)
    os.environ.setdefault("TRITON_INTERPRET", "1")

def _weight_forms() -> list[str]:
    """dense, and int8 where its kernel runs here (the default form of the models whose answers it keeps)."""
    from kvrag.kernels import quant

    return ["dense", "int8"] if quant.available() else ["dense"]


WEIGHT_FORMS = _weight_forms()


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
MUSIQUE_DEFAULT = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "musique_s.json"


def pytest_configure(config):
    config.addinivalue_line("markers", "benchmark_data: reads the real MuSiQue file (KVRAG_TEST_DATA); skips without it")
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU; skips without one")
    config.addinivalue_line("markers", "model_check: runs with KVRag's first-use blending check on")


@pytest.fixture(scope="module", autouse=True)
def _collect_between_modules():
    """What a module's engines and stores leave in reference cycles is freed before the next module runs. Tests
    that fork the whole pytest process (Ray starting its node, multiprocessing's "fork") need its committed memory
    small: the kernel's overcommit heuristic refuses a fork whose private memory exceeds what is free (seen in a CI
    run as "Cannot allocate memory")."""
    yield
    gc.collect()


@pytest.fixture(scope="session")
def session_home(tmp_path_factory) -> Path:
    """One KVRAG_HOME for the whole session, so the default model is converted once. pytest-xdist's workers share
    its models/ and kernels/ folders, made for several processes at once (a conversion lock, atomic writes, builds
    renamed into place): the first converts SmolLM2, the other waits for it and reads its conversion."""
    home = tmp_path_factory.mktemp("kvrag-home")
    if XDIST_WORKER:
        for name in ("models", "kernels"):
            shared = _run_folder(tmp_path_factory) / f"kvrag-{name}"
            shared.mkdir(exist_ok=True)
            (home / name).symlink_to(shared, target_is_directory=True)
    os.environ["KVRAG_HOME"] = str(home)
    return home


def _run_folder(tmp_path_factory) -> Path:
    """The temporary folder of the whole run: above each pytest-xdist worker's own, else the session's."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if XDIST_WORKER else base


@pytest.fixture(autouse=True)
def _isolated_home(session_home, monkeypatch, request):
    monkeypatch.setenv("KVRAG_HOME", str(session_home))
    if request.node.get_closest_marker("model_check") is not None:
        monkeypatch.delenv("KVRAG_MODEL_CHECK", raising=False)
    monkeypatch.delenv("KVRAG_MODEL", raising=False)
    monkeypatch.delenv("KVRAG_DTYPE", raising=False)
    monkeypatch.delenv("KVRAG_STORE", raising=False)


@pytest.fixture(scope="session")
def smol(session_home):
    """The real default model (SmolLM2-135M-Instruct), converted from its GGUF once per session; or the model
    folder KVRAG_TEST_MODEL names, where the GPU check runs the cuda tests without SmolLM2's weights (random ones
    on its tokenizer: bench/gpu_check_tests.py)."""
    from kvrag.model.files import resolve_model

    return resolve_model(os.environ.get("KVRAG_TEST_MODEL") or None)


@pytest.fixture(scope="session")
def qwen05(session_home):
    """Qwen2.5-Coder-0.5B-Instruct's real weights and tokenizer, as `kvrag model pull qwen2.5-coder-0.5b` left them
    in the user's KVRAG_HOME (`make test` pulls it first); skips where it was not pulled."""
    from kvrag.model.files import resolve_model
    from kvrag.model.names import KNOWN_MODELS, installed

    session = os.environ["KVRAG_HOME"]
    os.environ["KVRAG_HOME"] = USER_KVRAG_HOME
    if not USER_KVRAG_HOME:
        del os.environ["KVRAG_HOME"]  # the platform's default
    try:
        if not installed(KNOWN_MODELS["qwen2.5-coder-0.5b"]):
            pytest.skip("qwen2.5-coder-0.5b is not pulled: kvrag model pull qwen2.5-coder-0.5b (make test does)")
        return resolve_model("qwen2.5-coder-0.5b")
    finally:
        os.environ["KVRAG_HOME"] = session


@pytest.fixture(scope="session")
def smol_tokenizer(smol):
    return smol.load_tokenizer()


def _tiny_model_dir(root: Path, smol, arch: str, **overrides) -> Path:
    """A randomly initialised tiny model saved as a HF directory, with SmolLM2's tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    base = dict(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        rms_norm_eps=1e-5, tie_word_embeddings=arch == "qwen2", bos_token_id=1, eos_token_id=2,
    )
    if "text_config" in overrides:  # a multimodal model (Gemma 3): the tiny text model's fields go into its text_config
        overrides = dict(overrides)
        base = {"text_config": {**base, **overrides.pop("text_config")}}
    base.update(overrides)
    config = AutoConfig.for_model(arch, **base)
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # random init is near-trivial (zero biases, unit norms); make every weight count
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
            else:
                p.add_(torch.randn_like(p) * 0.1)
    path = root / arch
    model.save_pretrained(str(path), safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (smol.path / name).exists():
            shutil.copy(smol.path / name, path / name)
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smol) -> Path:
    return _tiny_model_dir(tmp_path_factory.mktemp("tiny"), smol, "llama")


@pytest.fixture(scope="session")
def tiny_llama_hd64_dir(tmp_path_factory, smol) -> Path:
    """Head dim 64 (two query heads over one KV head): the shape kvrag's AVX-512 row-attention kernel takes."""
    return _tiny_model_dir(tmp_path_factory.mktemp("tiny"), smol, "llama", hidden_size=128, num_attention_heads=2,
                           num_key_value_heads=1)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory, smol) -> Path:
    return _tiny_model_dir(tmp_path_factory.mktemp("tiny"), smol, "qwen2")


@pytest.fixture(scope="session")
def tiny_llama3_rope_dir(tmp_path_factory, smol) -> Path:
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256, "rope_theta": 500000.0}
    return _tiny_model_dir(tmp_path_factory.mktemp("tiny"), smol, "llama", rope_scaling=rope,
                           rope_parameters=rope)


GEMMA_LAYERS = ["sliding_attention", "full_attention"] * 2
# Each family kvrag runs beyond the Llama fixtures above, as (model_type, config overrides): small sliding windows
# (64) so that a 300-token prompt crosses them.
FAMILIES = {
    "qwen3": ("qwen3", dict(head_dim=32)),  # q/k norms, head dim != hidden / heads
    "qwen3_window": ("qwen3", dict(head_dim=32, use_sliding_window=True, sliding_window=64, max_window_layers=1)),
    "phi3": ("phi3", dict(pad_token_id=0)),  # fused qkv_proj and gate_up_proj
    "phi3_longrope": ("phi3", dict(pad_token_id=0, max_position_embeddings=2048, original_max_position_embeddings=512,
                                   rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                    "partial_rotary_factor": 0.5, "short_factor": [1.0, 1.3, 1.7, 2.2],
                                                    "long_factor": [2.0, 3.0, 5.0, 8.0]})),
    "mistral_window": ("mistral", dict(sliding_window=64)),
    "llama_yarn": ("llama", dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                                  "original_max_position_embeddings": 256})),
    "llama_dynamic": ("llama", dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})),
    "qwen2_yarn": ("qwen2", dict(rope_parameters={"rope_type": "yarn", "factor": 2.0, "rope_theta": 1000000.0,
                                                  "original_max_position_embeddings": 128})),
    # (1+w) norms, post-attention/feedforward norms, scaled embeddings; caps small enough to bite at this scale
    "gemma2": ("gemma2", dict(head_dim=16, num_hidden_layers=4, sliding_window=64, layer_types=GEMMA_LAYERS,
                              query_pre_attn_scalar=24, attn_logit_softcapping=1.5, final_logit_softcapping=2.0,
                              tie_word_embeddings=True)),
    # q/k norms, and the sliding layers' own rope theta (the full layers' scaled, linear)
    "gemma3_text": ("gemma3_text", dict(head_dim=32, num_hidden_layers=4, sliding_window=64, layer_types=GEMMA_LAYERS,
                                        query_pre_attn_scalar=24, tie_word_embeddings=True, rope_parameters={
                                            "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                               "rope_theta": 1000000.0},
                                            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
    # a multimodal checkpoint (language_model.model.* weights beside a vision tower), run as its text model
    "gemma3": ("gemma3", dict(text_config=dict(model_type="gemma3_text", head_dim=32, num_hidden_layers=4,
                                               sliding_window=64, layer_types=GEMMA_LAYERS, query_pre_attn_scalar=24),
                              vision_config=dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64,
                                                 num_hidden_layers=1, num_attention_heads=2, image_size=28,
                                                 patch_size=14),
                              mm_tokens_per_image=4, tie_word_embeddings=True)),
}


@pytest.fixture(scope="session")
def tiny_family(tmp_path_factory, smol):
    """tiny_family(name) -> the directory of FAMILIES[name]'s tiny random model, built at its first use."""
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            arch, overrides = FAMILIES[name]
            built[name] = _tiny_model_dir(tmp_path_factory.mktemp(name), smol, arch, **overrides)
        return built[name]
    return get


@pytest.fixture(scope="session")
def musique_path() -> Path:
    """The real MuSiQue file, for the tests whose point is the data set itself (mark them `benchmark_data`)."""
    path = Path(os.environ.get("KVRAG_TEST_DATA") or MUSIQUE_DEFAULT)
    if not path.exists():
        pytest.skip(f"benchmark data set: {path} is not there (KVRAG_TEST_DATA names another copy)")
    return path


@pytest.fixture(scope="session")
def musique_store(musique_path, smol, tmp_path_factory) -> Path:
    """`kvrag index MUSIQUE --chunk-tokens 1024` (a passage a chunk, as `kvrag bench cutoff` builds it), made once a
    run: pytest-xdist's workers share it, the first builds it under a lock. Read-only for every test."""
    import fcntl

    shared = _run_folder(tmp_path_factory)
    store = shared / "musique-store"
    with open(shared / "musique-store.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (shared / "musique-store.done").exists():
            shutil.rmtree(store, ignore_errors=True)  # a worker stopped mid-build
            run_kvrag("index", str(musique_path), "--store", str(store), "--chunk-tokens", "1024")
            (shared / "musique-store.done").touch()
    return store


@pytest.fixture(scope="session")
def musique_items(musique_path) -> list[dict]:
    import json

    return json.loads(musique_path.read_text())


@pytest.fixture(scope="session")
def invented_items() -> list[dict]:
    """40 invented MuSiQue-shaped items (5-10 passages of ≈300-500 tokens each), the same on every run."""
    from kvrag.bench.invented import invented_items as make

    return make(40, seed=0)


# ---- a small indexed corpus and the CLI in a subprocess -------------------------------------------

DOCS = {
    "rivers.txt": "The Nile is the longest river in Africa. It flows north through Egypt.\n\n"
                  "The Amazon carries more water than any other river on Earth.",
    "lakes.md": "# Lakes\n\nLake Baikal in Siberia is the deepest lake, over 1,600 metres deep. " * 6,
    "peaks.txt": "Mount Everest is the highest mountain above sea level, at 8,849 metres. " * 4,
    "deserts.txt": "The Sahara is the largest hot desert. Antarctica is the largest cold desert. " * 5,
    "seas.txt": "The Dead Sea's shore is the lowest land on Earth, about 430 metres below sea level. " * 3,
}


@pytest.fixture
def short_items(tmp_path, invented_items) -> Path:
    """Two invented items in MuSiQue's format, four passages each cut to 40 words, as a file."""
    items = [{**it, "ctxs": [{"title": c["title"], "text": " ".join(c["text"].split()[:40])} for c in it["ctxs"][:4]]}
             for it in invented_items[:2]]
    path = tmp_path / "items_short.json"
    path.write_text(json.dumps(items))
    return path


def run_kvrag(*args: str, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "kvrag", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})})
    if check and proc.returncode != 0:
        raise AssertionError(f"kvrag {' '.join(args)} failed:\n{proc.stderr}")
    return proc


@pytest.fixture(scope="session")
def indexed_store(tmp_path_factory, smol):
    """A store with the five small documents indexed (SmolLM2's tokenizer), made once per session and read by every
    module (a module that writes to it takes copied_store)."""
    root = tmp_path_factory.mktemp("precompute")
    docs = root / "docs"
    docs.mkdir()
    for name, text in DOCS.items():
        (docs / name).write_text(text)
    store = root / "store"
    model = ("--model", str(smol.path)) if os.environ.get("KVRAG_TEST_MODEL") else ()
    run_kvrag("index", str(docs), "--store", str(store), *model)
    before = _file_bytes(store)
    yield store
    # every module starts from this store: one that wrote to it (a server keeping what it computes) would change
    # what later modules see, and only in some orders (seen with pytest-xdist)
    assert _file_bytes(store) == before, "a test wrote to the session's indexed_store: give it copied_store()"


def _file_bytes(folder: Path) -> dict[str, bytes]:
    """A store's files (LMDB's lock file aside: readers register in it)."""
    return {str(p): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file() and p.name != "lock.mdb"}


def copied_store(store: Path, tmp_path_factory) -> Path:
    """A copy of a session-wide store for a module to write to: the server and the engine store the chunks they
    compute and the passages they keep, and the session's store is every module's starting point."""
    copy = tmp_path_factory.mktemp("store") / "store"
    shutil.copytree(store, copy)
    return copy


@pytest.fixture
def store_copy(indexed_store, tmp_path) -> Path:
    copy = tmp_path / "store"
    shutil.copytree(indexed_store, copy)
    return copy



@pytest.fixture
def kvrag():
    """Run the CLI in a subprocess: kvrag(*args, env=None, check=True) -> CompletedProcess."""
    return run_kvrag


def run_cli_in_process(monkeypatch, capsys, module: str, *args: str) -> tuple[int, str, str]:
    """Run `kvrag *args` in this process with only `kvrag.cli.<module>` registered (module "bench": the bench
    plugin): (exit code, stdout, stderr)."""
    import importlib

    import kvrag.cli.app as appmod

    def register():
        if module == "bench":
            importlib.import_module(appmod.BENCH_PLUGIN).register(appmod.app, appmod.model_app)
        else:
            importlib.import_module(f"kvrag.cli.{module}")

    monkeypatch.setattr(appmod, "_register_commands", register)
    monkeypatch.setattr(sys, "argv", ["kvrag", *args])
    try:
        appmod.main()
        code = 0
    except SystemExit as exc:
        code = exc.code or 0
    out = capsys.readouterr()
    return code, out.out, out.err
