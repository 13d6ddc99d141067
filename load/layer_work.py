"""What both layer loaders share (load/loader.py, load/staged_loader.py): the prompt's chunk refs, the reader
thread that reads layers ahead of the consumer, one read layer's decoding items, the pause that turns the
idle-priority decoder off when it starves, and the checks a stored layer must pass."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvrag.errors import KvragError
from kvrag.model import rotary
from kvrag.model.prefill import LayerKV
from kvrag.store.table import KVTable

# The idle-priority decoder starves when other processes keep every core busy; then a consumer waiting on a chunk
# it has begun (or on the GIL it holds) would wait for it too. A wait this long turns it off for a while.
STARVED_WAIT_S = 0.02
STARVED_PAUSE_S = 60.0
LOOKAHEAD = 4  # layers read (or decoded) ahead of the consumer at most


@dataclass
class DecoderPause:
    """Until when loaders decode at hand-over instead of at idle priority: shared by an engine's loaders, so a
    decoder that starved in one load stays off in the next ones for STARVED_PAUSE_S."""

    until: float = 0.0  # time.monotonic()

    def start(self) -> None:
        self.until = time.monotonic() + STARVED_PAUSE_S

    def active(self) -> bool:
        return time.monotonic() < self.until


class CorruptChunk(KvragError):
    def __init__(self, chunk_id: str, reason: str):
        super().__init__(f"chunk {chunk_id[:12]}: {reason}")
        self.chunk_id = chunk_id


@dataclass(frozen=True)
class ChunkRef:
    """One chunk of the prompt: its id and token ids, and its KV when it is already in memory. A reduced
    (Keyformer) chunk holds the rows of the tokens `kept` alone (indices into token_ids, rising; None: every token)."""

    chunk_id: str
    token_ids: Sequence[int]
    in_memory: LayerKV | None = None
    kept: np.ndarray | None = None
    read: bool = False  # in_memory was read from the store now (not computed): a lead-in store's near chunk

    @property
    def n_rows(self) -> int:
        return len(self.token_ids) if self.kept is None else len(self.kept)


class LayerReader:
    """A loader's reader thread: layers `layers` of `chunks` (their rows one after another) read in order by
    `_read`, at most LOOKAHEAD ahead of the consumer's `_take`, which raises a read's failure (for that layer and
    every later one). `positions` [C] and `inv_freq` [hd/2] float32 (the model's): the rows' absolute positions, to
    which keys are handed out rotated (`rotated`), else before rotary; or `rope` instead: their cos, sin
    [C, 1, hd] in the model's dtype (model.positions_cos_sin)."""

    def __init__(self, table: KVTable | None, chunks: Sequence[ChunkRef], layers: Sequence[int],
                 dtype: torch.dtype, device: torch.device, positions: torch.Tensor | None,
                 inv_freq: torch.Tensor | None, rope: tuple[torch.Tensor, torch.Tensor] | None):
        self.table, self.chunks, self.layers = table, list(chunks), list(layers)
        self.dtype, self.device = dtype, device
        if positions is not None:
            positions, inv_freq = positions.to(device).contiguous(), inv_freq.to(device)
            if rope is None:
                rope = rotary.cos_sin(inv_freq, positions, dtype)
        self.rope, self.positions, self.inv_freq = rope, positions, inv_freq
        # chunk i's rows of every layer are starts[i] .. starts[i + 1] - 1
        self._starts = list(itertools.accumulate((ref.n_rows for ref in self.chunks), initial=0))
        self._ready = {layer: threading.Event() for layer in self.layers}
        self._results: dict[int, object] = {}  # a read layer, or the failure to hand on
        self._lookahead = threading.Semaphore(LOOKAHEAD)
        self._stop = False
        # (kind, layer, start, end): "load", a layer read by the reader thread; the loaders add their own kinds
        self.spans: list[tuple[str, int, float, float]] = []
        self.bytes_read = 0
        self.reader_cpu_s = 0.0  # the reader thread's own CPU time: the host side's Python, GIL held or not
        self.ahead_cpu_s = 0.0  # LayerLoader's idle-priority decoder's CPU time
        self._thread = threading.Thread(target=self._run, name="kvrag-loader", daemon=True)

    def start(self):
        self._thread.start()
        return self

    @property
    def rotated(self) -> bool:
        """Whether `layer` hands out keys rotated to their positions (read by the blend)."""
        return self.rope is not None

    @property
    def busy_s(self) -> float:
        """Time spent loading: reads and decoding at hand-over (wall), and the idle-priority decoder's CPU time."""
        return sum(e - s for kind, _, s, e in self.spans if kind in ("load", "decode")) + self.ahead_cpu_s

    def close(self) -> None:
        self._stop = True
        for _ in self.layers:
            self._lookahead.release()
        if self._thread.ident is not None:
            self._thread.join(timeout=30)

    def _read(self, index: int, layer: int):
        raise NotImplementedError

    def _run(self) -> None:
        failure: BaseException | None = None
        for index, layer in enumerate(self.layers):
            self._lookahead.acquire()
            if self._stop:
                return
            if failure is None:
                try:
                    cpu, start = time.thread_time(), time.perf_counter()
                    self._results[layer] = self._read(index, layer)
                    self.spans.append(("load", layer, start, time.perf_counter()))
                    self.reader_cpu_s += time.thread_time() - cpu
                except BaseException as exc:  # handed to the consumer, which decides
                    failure = exc
            if failure is not None:
                self._results[layer] = failure
            self._ready[layer].set()

    def _take(self, index: int):
        self._ready[index].wait()
        result = self._results.pop(index)
        self._lookahead.release()
        if isinstance(result, BaseException):
            raise result
        return result

    def _handed_out(self, k: torch.Tensor, v: torch.Tensor, rotated: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """A made layer as `layer` hands it out: keys rotated here (in the model's dtype) unless they are already."""
        if self.rope is not None and not rotated:
            k = rotary.rotate(k.to(self.dtype), *self.rope)
        return k, v

    def _rows(self, i: int) -> slice:
        return slice(self._starts[i], self._starts[i + 1])

    def _copy_in_memory(self, k: torch.Tensor, v: torch.Tensor, layer: int, rotated: bool) -> None:
        """The in-memory chunks' K, V [T, Hkv, hd] into their rows of the layer k, v, keys rotated by rope's rows
        where the layer's are. A torch copy: never in a pool thread (see LayerLoader._work)."""
        for i, ref in enumerate(self.chunks):
            if ref.in_memory is None:
                continue
            rows, mk = self._rows(i), ref.in_memory.k[layer]
            check_rows(ref, mk.shape, rows.stop - rows.start, k.shape[1:])
            if rotated:
                rotary.rotate(mk.to(k.device, k.dtype), self.rope[0][rows], self.rope[1][rows], out=k[rows])
            else:
                k[rows] = mk
            v[rows] = ref.in_memory.v[layer]


class LayerWork:
    """One read layer's decoding: an item per stored chunk, each done by whichever worker claims it first,
    into the layer's buffers k, v [C, Hkv, hd]."""

    def __init__(self, stored: list[int], k: torch.Tensor, v: torch.Tensor, put: Callable[[int], None],
                 rotates: bool = False):
        self.k, self.v, self.put = k, v, put
        self.rotates = rotates  # `put` writes keys rotated (and in-memory chunks are rotated as they are copied in)
        self._items = stored  # chunk indices still to claim
        self._left = len(stored)  # items not finished
        self._lock = threading.Lock()
        self.done = threading.Event()
        self.error: BaseException | None = None
        if not stored:
            self.done.set()

    def work(self) -> bool:
        """Claim and decode items until none is left; whether this worker decoded any."""
        did = False
        while True:
            with self._lock:
                if not self._items:
                    return did
                i = self._items.pop(0)
            did = True
            try:
                self.put(i)
            except BaseException as exc:  # handed to the consumer, which decides
                self.error = self.error or exc
            finally:
                with self._lock:
                    self._left -= 1
                    if self._left == 0:
                        self.done.set()

    @property
    def unclaimed(self) -> int:
        with self._lock:
            return len(self._items)


def check_kept(ref: ChunkRef, positions: np.ndarray | None) -> None:
    """A stored layer must hold the rows the prompt was laid out for: all of them, or the same kept tokens."""
    if positions is None and ref.kept is None:
        return
    if positions is None or ref.kept is None or not np.array_equal(positions, ref.kept):
        raise CorruptChunk(ref.chunk_id, "its stored layers do not keep the same tokens")


def check_rows(ref: ChunkRef, kv_shape, rows: int, shape) -> None:
    """A stored layer must hold one row per prompt row of its chunk, of the layer's (Hkv, hd)."""
    if kv_shape[0] != rows or tuple(kv_shape[1:]) != tuple(shape):
        raise CorruptChunk(ref.chunk_id, f"holds KV of shape {tuple(kv_shape)}, not one row per token")
