"""kvrag: RAG over your own documents with precomputed, blended KV caches."""

__version__ = "0.1.0"


class KvragError(Exception):
    """A user-facing error: the CLI prints its message as one line on stderr and exits 1."""
