"""`kvrag serve --ray-serve N`: the application of cluster/serve.py on a Ray cluster, until SIGTERM or Ctrl-C."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

from kvrag.cli.announce import announce, withdraw
from kvrag.cli.common import stderr_console
from kvrag.config import KVRagConfig
from kvrag.errors import KvragError

INSTALL_HINT = "--ray-serve needs Ray Serve: pip install 'kvrag[serve]'"


def serve_on_ray(store: str, config: KVRagConfig, settings: dict, cluster: dict, host: str, port: int) -> None:
    try:
        from kvrag.cluster.serve import ClusterServer, ClusterSettings
    except ImportError:
        raise KvragError(INSTALL_HINT) from None
    from kvrag.model.files import resolve_model
    from kvrag.server.app import ServerSettings
    from kvrag.server.run import bind

    if port == 0:
        raise KvragError("--ray-serve needs a fixed --port: Ray Serve's proxy binds it itself")
    bind(host, port).close()  # a port in use is said now, not after the replicas load
    replicas = ClusterSettings(**cluster)  # bad settings are said before the model is resolved
    name = settings.pop("model_name") or resolve_model(config.model).name
    server = ClusterServer(store, config, ServerSettings(name, **settings), replicas, host, port)
    console = stderr_console()
    console.print(f"starting {cluster['replicas']} replicas of {name} on Ray Serve ...", soft_wrap=True)
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    announced = None
    try:
        server.start()
        if not store.startswith("s3://"):  # `kvrag ask` on this store asks the cluster (cli/announce.py)
            announced = announce(Path(store), server.url, config, bool(settings.get("api_key")))
        console.print(f"serving {name} on {server.url}/v1 ({cluster['replicas']} replicas, {cluster['router']} "
                      f"routing); SIGTERM or Ctrl-C stops", soft_wrap=True)
        stop.wait()
    finally:
        if announced is not None:
            withdraw(announced)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        server.stop()
