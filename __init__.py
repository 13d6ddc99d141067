"""kvrag: RAG over your own documents with precomputed, blended KV caches."""

__version__ = "0.1.0"


from kvrag.errors import KvragError

__all__ = ["KvragError", "__version__"]


def __getattr__(name: str):
    """`from kvrag import KVRag` without importing torch for `import kvrag` (the CLI's cold start)."""
    if name in ("KVRag", "Generation"):
        from kvrag import api

        return getattr(api, name)
    raise AttributeError(f"module 'kvrag' has no attribute {name!r}")
