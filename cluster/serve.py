"""`kvrag serve --ray-serve N`: N engine replicas behind Ray Serve, each running `kvrag serve`'s app (server/app.py)
in-process. A Front (no model) checks a request's key and finds its chunks (cluster/route_key.py), and the handle
call carries them to the ChunkRouter (cluster/routers.py), which picks the replica whose tiers hold them; the
replica's response streams back (docs/cluster.md draws it).

The replicas share the store: a local one on one machine, or one on object storage (`--store s3://...`), each
through its own mirror. A replica that dies before a response's first body bytes are out has its request sent to
another (FAILOVER_TRIES in all); once a stream has begun, its client sees the stream end. `/metrics` is every
replica's page with a `replica` label (cluster/federate.py).
"""

from __future__ import annotations

import asyncio
import logging
import math
from contextlib import suppress
from dataclasses import dataclass, replace
from pathlib import Path

import ray
from prometheus_client import CONTENT_TYPE_LATEST
from ray import serve
from ray.serve.config import RequestRouterConfig
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from kvrag.api import KVRag, KVRagConfig, KvragError
from kvrag.cluster.asgi_call import HttpRequest, Start, call
from kvrag.cluster.federate import MetricsBoard, federated_page
from kvrag.cluster.route_key import RouteKeys
from kvrag.cluster.routers import ROUTE_KWARG, ROUTERS
from kvrag.cluster.routing import BALANCE, WINDOW
from kvrag.server.app import ServerSettings, create_app
from kvrag.server.errors import ApiError, error_body
from kvrag.server.responses import sse

APP = "kvrag"
BOARD = "kvrag-metrics-board"
FAILOVER_TRIES = 3
LOST_MID_STREAM = "the engine replica answering was lost mid-stream; send the request again"
REPLICA_HEADER = "x-kvrag-replica"  # which replica answered, and on which Ray node: for operators and the tests
NODE_HEADER = "x-kvrag-node"
HEAD = {"node:__internal_head__": 0.001}  # Ray's resource of the head node: the front stays where the proxy is
RETRYABLE = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)


@dataclass(frozen=True)
class ClusterSettings:
    replicas: int = 2
    address: str | None = None  # None or "local": a local Ray cluster started here; "auto", "ray://host:10001": join
    router: str = "chunk"  # chunk | round-robin (cluster/routers.py)
    balance: float = BALANCE  # the chunk router's load caps: c x an even share (cluster/routing.py)
    window: int = WINDOW  # the chunk router's recent routings, over which a replica's share is capped
    cpus: float = 1.0  # per replica
    gpus: float = 0.0  # per replica: 1 puts each on a device of its own
    stats_period_s: float = 2.0  # how often each replica reports its held chunks (and its metrics)
    held_limit: int = 4096  # chunk ids a report carries, at most
    max_ongoing: int = 64  # requests a replica takes at once (its engine queues them)

    def __post_init__(self) -> None:
        if self.replicas < 1 or self.router not in ROUTERS:
            raise KvragError(f"--ray-serve takes at least 1 replica and a router in {', '.join(ROUTERS)}")
        if self.balance < 1:
            raise KvragError(f"--ray-balance must be at least 1 (an even share), got {self.balance}")


class EngineReplica:
    """One replica: a KVRag over the store and kvrag's app on it."""

    def __init__(self, store: str, config: KVRagConfig, settings: ServerSettings, held_limit: int):
        self.rag = KVRag(store, config)
        self.app = create_app(self.rag, settings)
        self.held_limit = held_limit
        self.name = serve.get_replica_context().replica_id.unique_id
        self.node = ray.get_runtime_context().get_node_id()
        self.board = ray.get_actor(BOARD, namespace="serve")

    async def handle(self, request: HttpRequest, **_):
        async for item in call(self.app, request):
            if isinstance(item, Start):
                item = Start(item.status, [*item.headers, (REPLICA_HEADER, self.name), (NODE_HEADER, self.node)])
            yield item

    def record_routing_stats(self) -> dict:
        held = self.rag.held_chunks(self.held_limit)
        self.board.put.remote(self.name, self.app.state.server.metrics.text().decode(), len(held))
        return {"chunks": held}

    def __del__(self):
        with suppress(Exception):
            self.rag.close()


class Front:
    """The ingress: checks each request's key, finds its chunks and forwards it to the replica the router picks."""

    def __init__(self, engine, store: str, config: KVRagConfig, api_key: str | None):
        self.engine = engine.options(stream=True)
        self.keys = RouteKeys(store, config, api_key)
        self.board = ray.get_actor(BOARD, namespace="serve")

    async def __call__(self, request: Request) -> Response:
        body = await request.body()
        if request.url.path == "/metrics":
            return Response(federated_page(await self.board.fresh.remote()), media_type=CONTENT_TYPE_LATEST)
        try:
            routed = await asyncio.to_thread(self.keys.route, request.url.path, request.headers.get("authorization"),
                                             body)
        except ApiError as exc:
            return exc.response()
        headers = [(k, v) for k, v in request.headers.raw if k.lower() != b"content-length"]
        forwarded = HttpRequest(request.method, request.url.path, request.url.query.encode(),
                                [*headers, (b"content-length", str(len(routed.body)).encode())], routed.body)
        return await self.forward(forwarded, routed.chunks)

    async def forward(self, request: HttpRequest, chunks) -> Response:
        """Send to the router's pick; on a replica lost before the first body bytes, to the next pick."""
        for _ in range(FAILOVER_TRIES):
            stream = self.engine.handle.remote(request, **{ROUTE_KWARG: chunks})
            try:
                start = await stream.__anext__()
                first = await anext(stream, b"")  # a stream's first event, or a whole answer
            except RETRYABLE:
                continue
            headers = dict(start.headers)
            events = headers.get("content-type", "").startswith("text/event-stream")
            return StreamingResponse(_rest(stream, first, events), status_code=start.status, headers=headers)
        return JSONResponse(error_body(503, "no engine replica could take the request"), status_code=503)


async def _rest(stream, first: bytes, events: bool):
    """The rest of a response. A replica lost mid-stream ends a stream of events with an error event, as `kvrag serve`
    ends a failed one (the OpenAI clients raise it); another body is cut short."""
    if first:
        yield first
    try:
        async for piece in stream:
            yield piece
    except RETRYABLE:
        logging.getLogger(__name__).warning("an engine replica died while streaming; the stream ends here")
        if events:
            yield (sse(error_body(503, LOST_MID_STREAM)) + sse("[DONE]")).encode()


def application(store: str, config: KVRagConfig, settings: ServerSettings, cluster: ClusterSettings):
    """The Serve application: the front over `cluster.replicas` engine replicas, routed by `cluster.router`."""
    router = RequestRouterConfig(request_router_class=ROUTERS[cluster.router],
                                 request_router_kwargs={"balance": cluster.balance, "window": cluster.window},
                                 request_routing_stats_period_s=cluster.stats_period_s)
    engine = serve.deployment(EngineReplica, name="Engine").options(
        num_replicas=cluster.replicas, max_ongoing_requests=cluster.max_ongoing, request_router_config=router,
        ray_actor_options={"num_cpus": cluster.cpus, "num_gpus": cluster.gpus})
    front = serve.deployment(Front, name="Front").options(ray_actor_options={"num_cpus": 0, "resources": HEAD},
                                                          max_ongoing_requests=10_000)
    config = replace(config, threads=config.threads or max(1, int(cluster.cpus)))  # torch's: the CPUs Ray gives it
    return front.bind(engine.bind(store, config, settings, cluster.held_limit), store, config, settings.api_key)


class ClusterServer:
    """The application on Ray Serve, on host:port; a local Ray cluster is started (and stopped) unless
    `cluster.address` names one. `with ClusterServer(...) as server: ... server.url ...`"""

    def __init__(self, store: str | Path, config: KVRagConfig, settings: ServerSettings, cluster: ClusterSettings,
                 host: str = "127.0.0.1", port: int = 8000):
        self.store, self.config, self.settings, self.cluster = str(store), config, settings, cluster
        self.host, self.port = host, port
        self.url = f"http://{host}:{port}"
        self._started_ray = False

    def __enter__(self) -> ClusterServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        if not ray.is_initialized():
            quiet = dict(logging_level=logging.ERROR, log_to_driver=False)
            if self.cluster.address in (None, "local"):
                cpus = math.ceil(self.cluster.replicas * self.cluster.cpus) + 1  # +1: the proxy and the front
                ray.init(address="local", num_cpus=cpus, include_dashboard=False, **quiet)
            else:
                ray.init(address=self.cluster.address, **quiet)
            self._started_ray = True
        # one proxy, on the head (with the front): on loopback every node's proxy would bind the same port
        serve.start(proxy_location="HeadOnly", http_options={"host": self.host, "port": self.port})
        ray.remote(num_cpus=0, resources=HEAD)(MetricsBoard).options(name=BOARD, namespace="serve",
                                                                     get_if_exists=True, lifetime="detached").remote()
        serve.run(application(self.store, self.config, self.settings, self.cluster), name=APP, route_prefix="/")

    def stop(self) -> None:
        with suppress(Exception):
            serve.shutdown()
        with suppress(Exception):  # on a cluster that outlives us, the board would outlive the app
            ray.kill(ray.get_actor(BOARD, namespace="serve"))
        if self._started_ray:
            ray.shutdown()
