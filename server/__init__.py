"""kvrag serve: an OpenAI-compatible RAG server over one KVRag (one model, one engine)."""
