"""Where kvrag keeps its files: models converted once, default stores, profiles."""

import os
from pathlib import Path

import platformdirs


def kvrag_home() -> Path:
    """`$KVRAG_HOME`, else the platform's cache directory (e.g. ~/.cache/kvrag)."""
    env = os.environ.get("KVRAG_HOME")
    home = Path(env).expanduser() if env else Path(platformdirs.user_cache_dir("kvrag"))
    home.mkdir(parents=True, exist_ok=True)
    return home


def default_store_dir() -> Path:
    """`$KVRAG_STORE`, else `<home>/store`."""
    env = os.environ.get("KVRAG_STORE")
    return Path(env).expanduser() if env else kvrag_home() / "store"
