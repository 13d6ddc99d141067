"""The LMDB environment of one store directory: its named databases and map growth.

Every other store module goes through `StoreEnv.write` / `StoreEnv.read`, so map growth,
resizes by other processes and "not a store" checks live in one place.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import lmdb

from kvrag.errors import KvragError

T = TypeVar("T")

# Named databases. meta: manifest and bookkeeping; chunks/docs: the corpus; kv: per-(chunk, layer) KV; prefix: the
# prefix cache's blocks spilled from a server's pool (store/prefix_table.py)
DB_NAMES = ("meta", "chunks", "docs", "kv", "prefix")
STORE_MARKER = b"kvrag-store"  # key in `meta` written when a store is created
INITIAL_MAP_SIZE = 64 << 20  # grows by doubling whenever LMDB reports the map full


DEFAULT_MAX_MAP_SIZE = 1 << 40  # LMDB's map may grow this far (config.py's max_map_size lowers it)


def is_store(path: Path) -> bool:
    return (Path(path) / "data.mdb").is_file()


class StoreEnv:
    """One LMDB environment (a directory with data.mdb/lock.mdb) and its named databases."""

    def __init__(self, env: lmdb.Environment, path: Path, readonly: bool, max_map_size: int = DEFAULT_MAX_MAP_SIZE):
        self.env = env
        self.path = path
        self.readonly = readonly
        self.max_map_size = max_map_size  # the map never grows past this (bytes)
        self.dbs = {}
        for name in DB_NAMES:  # a store made before a database was added has none of it, read-only
            try:
                self.dbs[name] = env.open_db(name.encode(), create=not readonly)
            except lmdb.NotFoundError:
                pass
        # transactions of several threads (the engine's write-back worker, a prefill's loaders) run side by side;
        # growing the map waits for them all: LMDB may only resize while no transaction of this process is open
        self._gate = TxnGate()
        self._writer = threading.Lock()  # one write transaction of this process at a time

    @classmethod
    def open(cls, path: Path | str, *, create: bool = False, readonly: bool = False,
             max_map_size: int | None = None) -> StoreEnv:
        """Open the store at `path`; with `create`, make it if the directory holds no store yet. `max_map_size`
        (config.py's, from KVRAG_MAX_MAP_SIZE; None: DEFAULT_MAX_MAP_SIZE) bounds LMDB's map: a full disk, or a test.

        Raises KvragError (one clear line) when the path is not a store, or is a non-empty
        directory of something else.
        """
        path = Path(path).expanduser()
        if path.exists() and not path.is_dir():
            raise KvragError(f"{path} is a file, not a store directory")
        if not is_store(path):
            if not create:
                if path.is_dir() and any(path.iterdir()):
                    raise KvragError(f"{path} is not a kvrag store (no data.mdb); check --store")
                raise KvragError(f"no kvrag store at {path} (run `kvrag index` first)")
            if path.exists() and any(path.iterdir()):
                raise KvragError(f"{path} is not empty and is not a kvrag store; choose another --store")
            path.mkdir(parents=True, exist_ok=True)
        limit = DEFAULT_MAX_MAP_SIZE if max_map_size is None else max_map_size
        try:
            env = lmdb.open(
                str(path),
                map_size=max(min(INITIAL_MAP_SIZE, limit), _current_file_size(path)),
                max_dbs=len(DB_NAMES) + 2,
                readonly=readonly,
                max_readers=256,
                readahead=False,  # values are read layer by layer, not sequentially
            )
        except lmdb.Error as exc:
            raise KvragError(f"cannot open store at {path}: {exc}") from None
        while True:
            try:
                return cls._check_and_mark(env, path, readonly, limit)
            except lmdb.MapResizedError:
                env.set_mapsize(0)  # another process grew the map meanwhile: adopt its size, retry

    @classmethod
    def _check_and_mark(cls, env: lmdb.Environment, path: Path, readonly: bool, limit: int) -> StoreEnv:
        if _has_foreign_data(env):  # checked before our databases are created in someone else's file
            env.close()
            raise KvragError(f"{path} holds an LMDB database that is not a kvrag store")
        store = cls(env, path, readonly, limit)
        if not readonly:
            with env.begin(write=True, db=store.dbs["meta"]) as txn:
                if txn.get(STORE_MARKER) is None:
                    txn.put(STORE_MARKER, b"1")
        elif store.read(lambda txn: txn.get(STORE_MARKER, db=store.dbs["meta"])) is None:
            env.close()
            raise KvragError(f"{path} holds an LMDB database that is not a kvrag store")
        return store

    def db(self, name: str):
        return self.dbs[name]

    def has_db(self, name: str) -> bool:
        return name in self.dbs

    def write(self, fn: Callable[[lmdb.Transaction], T]) -> T:
        """Run `fn(txn)` in one write transaction, growing the map and retrying it whole if full.

        `fn` must be safe to re-run: a MapFullError aborts everything it wrote.
        """
        with self._writer:
            return self._write(fn)

    def _write(self, fn: Callable[[lmdb.Transaction], T]) -> T:
        while True:
            try:
                with self._gate.open(), self.env.begin(write=True) as txn:
                    return fn(txn)
            except lmdb.MapFullError:
                with self._gate.alone():
                    self._grow()
            except lmdb.MapResizedError:
                self._adopt_size()  # another process grew the map
            except lmdb.Error as exc:  # e.g. a full disk: LMDB fails the commit with an I/O error
                raise KvragError(f"cannot write to the store at {self.path} ({exc}; is the disk full?); "
                                 "nothing stored was lost") from None

    def read(self, fn: Callable[[lmdb.Transaction], T]) -> T:
        """Run `fn(txn)` in a read transaction (readers never block another process's writer)."""
        while True:
            try:
                with self._gate.open(), self.env.begin(write=False) as txn:
                    return fn(txn)
            except lmdb.MapResizedError:
                self._adopt_size()

    @contextmanager
    def reader(self, buffers: bool = False) -> Iterator[lmdb.Transaction]:
        """A read transaction for code that iterates (cursors), or (`buffers`) reads values as views of the map,
        valid until the block ends; prefer `read` elsewhere."""
        while True:
            with self._gate.open():
                try:
                    txn = self.env.begin(write=False, buffers=buffers)
                except lmdb.MapResizedError:
                    txn = None
                if txn is not None:
                    try:
                        yield txn
                    finally:
                        txn.abort()
                    return
            self._adopt_size()

    def _adopt_size(self) -> None:
        """Take the map size another process grew the file to (no transaction of this process open meanwhile)."""
        with self._gate.alone():
            self.env.set_mapsize(0)

    def _grow(self) -> None:
        size = self.env.info()["map_size"]
        limit = self.max_map_size
        if size >= limit:
            raise KvragError(
                f"store at {self.path} is full ({size / 2**20:.1f} MiB, the limit); nothing stored was lost. "
                "Free disk space or raise KVRAG_MAX_MAP_SIZE."
            )
        self.env.set_mapsize(min(size * 2, limit))

    def close(self) -> None:
        self.env.close()

    def __enter__(self) -> StoreEnv:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class TxnGate:
    """Counts this process's open transactions; `alone` waits until none is open (and holds new ones back) for a
    map resize. A thread that already holds a transaction may open another while a resize waits."""

    def __init__(self):
        self._cond = threading.Condition()
        self._open = 0
        self._resizing = False
        self._held = threading.local()  # .depth: transactions the calling thread holds

    @contextmanager
    def open(self) -> Iterator[None]:
        depth = getattr(self._held, "depth", 0)
        with self._cond:
            while self._resizing and depth == 0:
                self._cond.wait()
            self._open += 1
        self._held.depth = depth + 1
        try:
            yield
        finally:
            self._held.depth = depth
            with self._cond:
                self._open -= 1
                self._cond.notify_all()

    @property
    def resizing(self) -> bool:
        """Whether a resize waits for the open transactions, or runs."""
        return self._resizing

    @contextmanager
    def alone(self) -> Iterator[None]:
        mine = getattr(self._held, "depth", 0)  # a resize under the caller's own transaction: LMDB's error, not a hang
        with self._cond:
            while self._resizing:
                self._cond.wait()
            self._resizing = True
            while self._open > mine:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._resizing = False
                self._cond.notify_all()


def _current_file_size(path: Path) -> int:
    data = path / "data.mdb"
    return data.stat().st_size if data.exists() else 0


def _has_foreign_data(env: lmdb.Environment) -> bool:
    """True when the main database names something other than our named databases."""
    ours = {name.encode() for name in DB_NAMES}
    with env.begin() as txn:
        return any(key not in ours for key, _ in txn.cursor())
