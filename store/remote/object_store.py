"""A bucket and key prefix on S3-compatible object storage (`s3://bucket/prefix`), over obstore's S3Store.

Credentials and the endpoint come from the usual AWS variables: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
AWS_SESSION_TOKEN, AWS_REGION (or AWS_DEFAULT_REGION), AWS_ENDPOINT_URL (or AWS_ENDPOINT) for a server other
than AWS. Plain http is allowed to a loopback endpoint (a test or a local gateway) and elsewhere only with
AWS_ALLOW_HTTP=true. Keys are relative to the prefix. Every failure but "no such object" becomes a KvragError
of one line naming the store, the request and the key.

Requests run in the caller's thread, or on the store's thread pool: `map` (several at once) and `submit` (one,
for the ranged reads of store/remote/ranged.py). `latency_s` (0 unless a bench sets it) is slept before each
request: a network's round trip, simulated on a loopback server (requests run on threads, so the sleeps overlap as
round trips do).
"""

from __future__ import annotations

import ipaddress
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TypeVar
from urllib.parse import urlsplit

import obstore
from obstore.exceptions import AlreadyExistsError, BaseError, NotFoundError, PreconditionError
from obstore.store import S3Store

from kvrag.errors import KvragError

T = TypeVar("T")
R = TypeVar("R")

CONCURRENCY = 16  # requests in flight at once for `map` (ranged reads of several chunks)
TIMEOUT = "30s"
RETRIES = 3  # obstore's default (10 retries over 3 minutes) would hang a question on a dead endpoint
LOOPBACK_NAMES = ("localhost",)
NOT_FOUND = (FileNotFoundError, NotFoundError)  # obstore raises the first for a missing key, the second too


class ObjectChanged(KvragError):
    """A conditional read (If-Match) found the object replaced since its ETag was taken."""


@dataclass(frozen=True)
class ObjectInfo:
    key: str  # relative to the store's prefix
    size: int
    etag: str | None
    modified: float | None = None  # seconds since the epoch, where the store says (a listing does)


@dataclass(frozen=True)
class S3Location:
    bucket: str
    prefix: str  # "" or a path without leading/trailing slashes

    @classmethod
    def parse(cls, url: str) -> S3Location:
        parts = urlsplit(url)
        if parts.scheme != "s3" or not parts.netloc:
            raise KvragError(f"not an object-store URL: {url!r} (expected s3://bucket/prefix)")
        return cls(parts.netloc, parts.path.strip("/"))

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"


@dataclass
class RequestCounts:
    """What this client asked of the store: requests by method, bytes received and sent (answered or not)."""

    requests: dict[str, int] = field(default_factory=dict)
    bytes_in: int = 0
    bytes_out: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, method: str, bytes_in: int = 0, bytes_out: int = 0) -> None:
        with self._lock:  # `map` requests from several threads
            self.requests[method] = self.requests.get(method, 0) + 1
            self.bytes_in += bytes_in
            self.bytes_out += bytes_out

    def snapshot(self) -> dict:
        with self._lock:
            return {"requests": dict(self.requests), "bytes_in": self.bytes_in, "bytes_out": self.bytes_out}


class ObjectStore:
    """get, ranged get, put, head, list and delete on one bucket and prefix; `map` runs requests at once.
    `counts` tallies the requests made (`kvrag bench remote` reports them per question)."""

    def __init__(self, client: S3Store, location: S3Location, concurrency: int = CONCURRENCY, latency_s: float = 0.0):
        self.client = client
        self.location = location
        self.counts = RequestCounts()
        self.latency_s = latency_s  # slept before each request (a bench's simulated round trip)
        self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="kvrag-s3")

    @classmethod
    def from_url(cls, url: str, env: Mapping[str, str], concurrency: int = CONCURRENCY) -> ObjectStore:
        """The store at `url`, configured from `env`: the AWS variables, as the edge read them (config.py)."""
        location = S3Location.parse(url)
        config = {name: env[var] for name, var in (("access_key_id", "AWS_ACCESS_KEY_ID"),
                                                   ("secret_access_key", "AWS_SECRET_ACCESS_KEY"),
                                                   ("token", "AWS_SESSION_TOKEN")) if env.get(var)}
        endpoint = env.get("AWS_ENDPOINT_URL") or env.get("AWS_ENDPOINT")
        if endpoint:
            config["endpoint"] = endpoint
        region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "us-east-1"
        client_options = {"timeout": TIMEOUT, "connect_timeout": "5s", "allow_http": _allow_http(endpoint, env)}
        retry = {"max_retries": RETRIES, "retry_timeout": timedelta(seconds=20),
                 "backoff": {"init_backoff": timedelta(milliseconds=100), "max_backoff": timedelta(seconds=2),
                             "base": 2}}
        try:
            client = S3Store(location.bucket, prefix=location.prefix or None, region=region,
                             client_options=client_options, retry_config=retry, **config)
        except (BaseError, ValueError) as exc:
            raise KvragError(f"{location.url}: cannot configure the object store: {_first_line(exc)}") from None
        return cls(client, location, concurrency)

    @property
    def url(self) -> str:
        return self.location.url

    # --- requests --------------------------------------------------------------------------------

    def get(self, key: str) -> bytes | None:
        """The whole object; None when there is none."""
        got = self.fetch(key)
        return None if got is None else got[0]

    def fetch(self, key: str, length: int | None = None) -> tuple[bytes, ObjectInfo] | None:
        """The object (its first `length` bytes, or all of it when shorter) and its size and ETag, in one request;
        None when there is no object."""
        self._round_trip()
        try:
            result = obstore.get(self.client, key, options={"range": (0, length)} if length else None)
            data = bytes(result.bytes())
            self.counts.add("GET", len(data))
            return data, _info(result.meta)
        except NOT_FOUND:
            self.counts.add("GET")
            return None
        except BaseError as exc:
            info = self.head(key) if length else None  # an empty object refuses any range (416): look first
            if info is not None and info.size == 0:
                return b"", info
            raise self._error("GET", key, exc) from None

    def get_range(self, key: str, start: int, end: int, if_match: str | None = None) -> bytes | None:
        """Bytes [start, end) (fewer where the object ends sooner); None when there is no object. With
        `if_match` (an ETag), ObjectChanged when the object was replaced since."""
        options = {"range": (start, end)} | ({"if_match": if_match} if if_match else {})
        self._round_trip()
        try:
            data = bytes(obstore.get(self.client, key, options=options).bytes())
        except NOT_FOUND:
            self.counts.add("GET")
            return None
        except PreconditionError:
            raise ObjectChanged(f"{self.url}: {key} changed while it was read") from None
        except BaseError as exc:
            raise self._error("GET", key, exc) from None
        self.counts.add("GET", len(data))
        return data

    def head(self, key: str) -> ObjectInfo | None:
        self.counts.add("HEAD")
        self._round_trip()
        try:
            return _info(obstore.head(self.client, key))
        except NOT_FOUND:
            return None
        except BaseError as exc:
            raise self._error("HEAD", key, exc) from None

    def put(self, key: str, data: bytes, *, create: bool = False) -> bool:
        """One PUT of the whole object (atomic: readers see the old object, none, or all of it). `create`: only
        where no object is (If-None-Match); False when one already was."""
        self.counts.add("PUT", bytes_out=len(data))
        self._round_trip()
        try:
            obstore.put(self.client, key, data, mode="create" if create else "overwrite", use_multipart=False)
            return True
        except AlreadyExistsError:
            return False
        except BaseError as exc:
            raise self._error("PUT", key, exc) from None

    def delete(self, key: str) -> None:
        self.counts.add("DELETE")
        self._round_trip()
        try:
            obstore.delete(self.client, key)
        except NOT_FOUND:
            return
        except BaseError as exc:
            raise self._error("DELETE", key, exc) from None

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object under the folder `prefix` (S3 lists up to 1000 keys a request)."""
        try:
            for page in obstore.list(self.client, prefix or None):
                self.counts.add("LIST")
                self._round_trip()  # after the page came: the same total
                yield from (_info(meta) for meta in page)
        except (*NOT_FOUND, BaseError) as exc:  # not found here: the bucket
            raise self._error("LIST", prefix, exc) from None

    def check(self) -> None:
        """One LIST request: KvragError now, in one line, when the bucket or the credentials are wrong."""
        self.counts.add("LIST")
        self._round_trip()
        try:
            next(iter(obstore.list(self.client, chunk_size=1)), None)
        except (*NOT_FOUND, BaseError) as exc:
            raise self._error("LIST", "", exc) from None

    def map(self, fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
        """fn(item) for every item, CONCURRENCY at a time (requests wait on the network, not the GIL)."""
        return list(self._pool.map(fn, items))

    def submit(self, fn: Callable[..., R], *args) -> Future[R]:
        """fn(*args) on the store's pool (a request that the caller does not wait for)."""
        return self._pool.submit(fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def _round_trip(self) -> None:
        if self.latency_s > 0:
            time.sleep(self.latency_s)

    def _error(self, op: str, key: str, exc: BaseException) -> KvragError:
        return KvragError(f"{self.url}: {op} {key or '/'} failed: {_first_line(exc)}")


def _info(meta) -> ObjectInfo:
    modified = meta.get("last_modified")
    return ObjectInfo(meta["path"], int(meta["size"]), meta.get("e_tag"), modified.timestamp() if modified else None)


def _allow_http(endpoint: str | None, env: Mapping[str, str]) -> bool:
    """http only to a loopback endpoint unless AWS_ALLOW_HTTP says so; https everywhere else."""
    if not endpoint or not endpoint.startswith("http://"):
        return False
    if env.get("AWS_ALLOW_HTTP", "").lower() in ("1", "true", "yes"):
        return True
    host = urlsplit(endpoint).hostname or ""
    try:
        loopback = host in LOOPBACK_NAMES or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise KvragError(f"refusing plain http to {endpoint}: use https, or set AWS_ALLOW_HTTP=true")
    return True


def _first_line(exc: BaseException) -> str:
    """obstore's messages carry the server's XML body and a debug dump after the first line: keep the line."""
    line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return line.split(": <?xml")[0][:300]
