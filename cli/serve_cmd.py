"""`kvrag serve`: the OpenAI-compatible RAG server (server/) over one store and one model, loaded once."""

from __future__ import annotations

from pathlib import Path

import typer

from kvrag.cli.common import (
    CACHE_POLICY_OPTION,
    CODEC_OPTION,
    DEVICE_OPTION,
    DTYPE_OPTION,
    GPU_CACHE_OPTION,
    HOST_CACHE_OPTION,
    KEEP_OPTION,
    KEEP_RULE_OPTION,
    MODEL_OPTION,
    STORE_OPTION,
    WEIGHTS_OPTION,
    check_cache_options,
    resolve_store,
    stderr_console,
)
from kvrag.cli.typer_apps import app


@app.command("serve")
def serve_command(
    store: Path = STORE_OPTION,
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0: every interface)."),
    port: int = typer.Option(8000, "--port", min=0, max=65535, help="Port to listen on (0: a free one)."),
    api_key: str = typer.Option(None, "--api-key", envvar="KVRAG_API_KEY",
                                help="Require `Authorization: Bearer KEY` on /v1/* (default: no key)."),
    model_name: str = typer.Option(None, "--model-name",
                                   help="The model id clients name (default: the model's name, e.g. SmolLM2-135M-Instruct or gemma-3-270m)."),
    max_waiting: int = typer.Option(64, "--max-waiting", min=0,
                                    help="Requests that may wait for a prefill; more get 429 (0: no bound)."),
    max_running: int = typer.Option(32, "--max-running", min=1, help="Sequences decoding together, at most."),
    max_tokens: int = typer.Option(256, "--max-tokens", min=1,
                                   help="Longest answer, in tokens, for a request that names no max_tokens."),
    kv_budget: str = typer.Option("1GiB", "--kv-budget", help="Memory for the running sequences' KV."),
    kept_passages: str = typer.Option(None, "--kept-passages", envvar="KVRAG_KEPT_PASSAGES",
                                      help="Store room for passages kept from clients' prompts (stored at their "
                                           "second sighting; the least valuable make room; 0: none) [default: 1GiB]"),
    prefix_store: str = typer.Option(None, "--prefix-store", envvar="KVRAG_PREFIX_STORE",
                                     help="Store room for the prefix cache's blocks (a chat's history), spilled there "
                                          "so that it outlives the server and every replica on the store finds it; "
                                          "the least valuable make room; 0: none [default: 4GiB]"),
    grace: float = typer.Option(10.0, "--grace", min=0.0,
                                help="Seconds running requests get to finish on SIGTERM or Ctrl-C."),
    codec: str = CODEC_OPTION,
    keep: float = KEEP_OPTION,
    keep_rule: str = KEEP_RULE_OPTION,
    host_cache: str = HOST_CACHE_OPTION,
    gpu_cache: str = GPU_CACHE_OPTION,
    cache_policy: str = CACHE_POLICY_OPTION,
    speculate: bool = typer.Option(False, "--speculate",
                                   help="Start a question's prefill on an IVF index's early search stages "
                                        "(RAGCache's speculative pipelining; nothing to gain on a Flat index)."),
    retrieval: str = typer.Option("auto", "--retrieval", envvar="KVRAG_RETRIEVAL",
                                  help="Where retrieval happens: auto (here, unless a prompt carries passages of its "
                                       "own), server (always here), client (never: the application sends its "
                                       "passages). Stored passages in any prompt are blended either way."),
    model: str = MODEL_OPTION,
    dtype: str = DTYPE_OPTION,
    device: str = DEVICE_OPTION,
    weights: str = WEIGHTS_OPTION,
    ray_serve: int = typer.Option(0, "--ray-serve", min=0, metavar="N",
                                  help="Serve with N engine replicas on Ray Serve (pip install 'kvrag[serve]'), each "
                                       "request routed to the replica whose memory holds its chunks (0: one process)."),
    ray: str = typer.Option("local", "--ray", metavar="local|ADDRESS",
                            help="With --ray-serve: `local` starts a Ray cluster here; `auto` or ray://host:10001 "
                                 "joins a running one (its nodes must see the store and the model at these paths, "
                                 "or use --store s3://...)."),
    ray_router: str = typer.Option("chunk", "--ray-router", help="With --ray-serve: chunk (by the request's "
                                   "chunks, load bounded) or round-robin."),
    ray_balance: float = typer.Option(1.25, "--ray-balance", min=1.0,
                                      help="With --ray-serve: a replica takes at most this times an even share of "
                                           "the requests in flight before the next by chunks is chosen."),
    ray_cpus: float = typer.Option(1.0, "--ray-cpus", min=0.0, help="With --ray-serve: CPUs per replica."),
    ray_gpus: float = typer.Option(0.0, "--ray-gpus", min=0.0,
                                   help="With --ray-serve: GPUs per replica (1: each on a device of its own)."),
) -> None:
    """Serve the store over HTTP with OpenAI's API: /v1/chat/completions, /v1/completions, /v1/models, /health,
    /metrics. SIGTERM or Ctrl-C stops accepting, lets running requests finish (--grace), then exits.

    Example: kvrag serve --store ./my-store --port 8000
             kvrag serve --store ./my-store --ray-serve 2     (two replicas behind Ray Serve, routed by chunk)
    """
    path = _checked_store(store, codec, retrieval, kv_budget, host_cache, gpu_cache, cache_policy,
                          {"--kept-passages": kept_passages, "--prefix-store": prefix_store})
    options = dict(model=model, dtype=dtype, device=device, weights=weights, codec=codec, kv_budget=kv_budget,
                   host_cache=host_cache, gpu_cache=gpu_cache, cache_policy=cache_policy, kept_passages=kept_passages,
                   prefix_store=prefix_store, max_running=max_running, max_waiting=max_waiting, keep=keep,
                   keep_rule=keep_rule, retrieval=retrieval)
    settings = dict(api_key=api_key or None, max_tokens=max_tokens, model_name=model_name)
    if ray_serve:
        from kvrag.cli.serve_ray import serve_on_ray
        from kvrag.config import KVRagConfig

        cluster = dict(replicas=ray_serve, address=ray, router=ray_router, cpus=ray_cpus, gpus=ray_gpus,
                       balance=ray_balance)
        return serve_on_ray(str(store) if str(store).startswith("s3://") else str(path),
                            KVRagConfig.resolve(**options), settings, cluster, host, port)
    _serve_one(path, {**options, "tune_process": True, "speculate": speculate}, settings, host, port, grace)


def _checked_store(store: Path, codec: str, retrieval: str, kv_budget: str, host_cache: str, gpu_cache: str,
                   cache_policy: str, sizes: dict[str, str | None]) -> Path:
    """The store's local path, once every option is known good: a bad one is one line before anything loads.
    `sizes`: more byte sizes by their flag (None: not given)."""
    from kvrag.config import RETRIEVAL
    from kvrag.errors import KvragError
    from kvrag.store.env import StoreEnv
    from kvrag.store.keys import codec_id
    from kvrag.store.tiers.config import parse_bytes

    codec_id(codec)
    if retrieval not in RETRIEVAL:
        raise KvragError(f"--retrieval must be one of {', '.join(RETRIEVAL)}, got {retrieval}")
    parse_bytes(kv_budget, "--kv-budget")
    for flag, size in sizes.items():
        if size is not None:
            parse_bytes(size, flag)
    check_cache_options(host_cache, gpu_cache, cache_policy)
    path = resolve_store(store)
    StoreEnv.open(path).close()  # not a store: said before anything loads
    return path


def _serve_one(path: Path, options: dict, settings: dict, host: str, port: int, grace: float) -> None:
    """One process: bind first (a port in use is said at once), load the model, serve until SIGTERM or Ctrl-C."""
    from kvrag.api import KVRag
    from kvrag.cli.announce import announce, withdraw
    from kvrag.server.app import ServerSettings
    from kvrag.server.run import bind, listen, serve

    sock = bind(host, port)
    console = stderr_console()
    try:
        console.print(f"loading the model for {path} ...", soft_wrap=True)
        with KVRag(path, **options) as rag:
            served = ServerSettings(settings["model_name"] or rag.runtime.local.name, settings["api_key"],
                                    settings["max_tokens"])
            url = listen(sock)
            announced = announce(path, url, rag.config, bool(served.api_key))  # `kvrag ask` on this store asks here
            console.print(f"serving {served.model_name} on {url}/v1"
                          f"{' (API key required)' if served.api_key else ''}; SIGTERM or Ctrl-C stops",
                          soft_wrap=True)  # one line, whatever the width: scripts read the URL off it
            try:
                serve(rag, served, sock, grace)
            finally:
                withdraw(announced)
    finally:
        sock.close()
