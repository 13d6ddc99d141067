"""The layer loader: reads, checks, decodes and places chunk KV one layer ahead of the compute.

A thread reads each layer's values from LMDB ahead of the compute (the part that waits on the disk).
Where they are decoded (checksum, zstd, byte planes) depends on who else wants the cores:
  CUDA  the thread decodes too, pins the buffer and copies it on a side stream: the CPU is otherwise idle.
  CPU   the compute keeps every core busy, and a thread decoding beside it stalls the compute's
        OpenMP regions whenever it takes a core (measured on 2 cores, 6.3k-token prompt: 48 ms a blended
        layer with decoding in the thread, 35 ms without). So the thread only reads, and the consumer
        decodes a layer when it asks for it, its chunks spread over a small pool (zstd and numpy release
        the GIL) while the compute is paused: about 3 ms a layer on the critical path instead of 13.
The decoded buffer is left in the stored dtype and the consumer's copy casts, except for a bf16 model on the
CPU over fp16 values: a native pass (kernels/fp16_to_bf16.cpp) writes them as bf16 straight from the payload. A value that fails its
checksum is never handed out: the consumer gets `CorruptChunk` naming the chunk, and recomputes it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from kvrag import KvragError
from kvrag.blend.prefill import LayerKV
from kvrag.kernels import fp16_to_bf16
from kvrag.store.codec import DECODED_DTYPES, FLAG_SHUFFLED, CorruptValue
from kvrag.store.kv import KVTable, MissingChunk, RawLayer


class CorruptChunk(KvragError):
    def __init__(self, chunk_id: str, reason: str):
        super().__init__(f"chunk {chunk_id[:12]}: {reason}")
        self.chunk_id = chunk_id


@dataclass(frozen=True)
class ChunkRef:
    """One chunk of the prompt: its id and token ids, and its KV when it is already in memory."""

    chunk_id: str
    token_ids: Sequence[int]
    in_memory: LayerKV | None = None


class LayerLoader:
    """Loads layers `layers` of `chunks` (concatenated in prompt order) ahead of the consumer.

    At most `lookahead` layers wait read (or decoded) in memory. `delay_s` slows each layer's read (tests).
    `decode_in_thread` None: decode in the thread on CUDA, at hand-over on the CPU (see the module doc).
    """

    def __init__(self, table: KVTable | None, chunks: Sequence[ChunkRef], layers: Sequence[int],
                 dtype: torch.dtype, device: torch.device, lookahead: int = 4, delay_s: float = 0.0,
                 decode_in_thread: bool | None = None):
        self.table, self.chunks, self.layers = table, list(chunks), list(layers)
        self.dtype, self.device, self.delay_s = dtype, device, delay_s
        self.decode_in_thread = device.type == "cuda" if decode_in_thread is None else decode_in_thread
        self._starts = [0]  # chunk i's rows are _starts[i] .. _starts[i + 1] - 1 of every layer
        for ref in self.chunks:
            self._starts.append(self._starts[-1] + len(ref.token_ids))
        self._ready = {layer: threading.Event() for layer in self.layers}
        self._results: dict[int, list | tuple[torch.Tensor, torch.Tensor] | BaseException] = {}
        self._slots = threading.Semaphore(lookahead)
        self._stop = False
        self.spans: list[tuple[str, int, float, float]] = []  # ("load" | "decode", layer, start, end)
        self.bytes_read = 0
        self._stream = torch.cuda.Stream() if device.type == "cuda" else None
        self._pool_threads = 1 if self.decode_in_thread else max(1, torch.get_num_threads())
        self._pool = None if self.decode_in_thread else ThreadPoolExecutor(self._pool_threads,
                                                                           thread_name_prefix="kvrag-decode")
        self._thread = threading.Thread(target=self._run, name="kvrag-loader", daemon=True)

    def start(self) -> LayerLoader:
        self._thread.start()
        return self

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k pre-rotary, v) of every chunk token for layer `index`, each [C, Hkv, hd], in the stored
        dtype (the consumer casts as it copies)."""
        self._ready[index].wait()
        result = self._results.pop(index)
        self._slots.release()
        if isinstance(result, BaseException):
            raise result
        if isinstance(result, list):  # read, not decoded yet
            start = time.perf_counter()
            result = self._place(result)
            self.spans.append(("decode", index, start, time.perf_counter()))
        if self._stream is not None:
            torch.cuda.current_stream().wait_stream(self._stream)
        return result

    def close(self) -> None:
        self._stop = True
        for _ in self.layers:
            self._slots.release()
        self._thread.join(timeout=5)
        if self._pool is not None:
            self._pool.shutdown(wait=False)

    def _run(self) -> None:
        failure: BaseException | None = None
        for layer in self.layers:
            self._slots.acquire()
            if self._stop:
                return
            if failure is None:
                try:
                    start = time.perf_counter()
                    fetched = self._fetch(layer)
                    self.spans.append(("load", layer, start, time.perf_counter()))
                    if self.decode_in_thread:
                        start = time.perf_counter()
                        fetched = self._place(fetched)
                        self.spans.append(("decode", layer, start, time.perf_counter()))
                    self._results[layer] = fetched
                except BaseException as exc:  # handed to the consumer, which decides
                    failure = exc
            if failure is not None:
                self._results[layer] = failure
            self._ready[layer].set()

    def _fetch(self, layer: int) -> list:
        """Per chunk: its (k, v) tensors when in memory, else its stored value read and checked against the
        chunk's record, not decoded (CorruptChunk when missing or damaged)."""
        if self.delay_s:
            time.sleep(self.delay_s)
        return [(ref.in_memory.k[layer], ref.in_memory.v[layer]) if ref.in_memory is not None else self._read(ref, layer)
                for ref in self.chunks]

    def _place(self, fetched: list) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) of every chunk token, each [C, Hkv, hd]: every stored chunk decoded (over the pool, where
        there is one) straight into one preallocated pair of arrays, in-memory chunks copied in. The dtype is
        the stored one where every chunk has it (float32 where they differ: exact for fp16, bf16 and int8);
        the cast to the compute dtype is left to the consumer's copy into its own buffers."""
        if self.dtype == torch.bfloat16 and self.device.type == "cpu" and fp16_to_bf16.available() and all(
                item.codec == "fp16" for item in fetched if isinstance(item, RawLayer)):
            return self._place_bf16(fetched)
        starts = self._starts
        dtypes = {_array_dtype(item) for item in fetched}
        dtype = dtypes.pop() if len(dtypes) == 1 else np.dtype(np.float32)
        shape = _layer_shape(fetched)
        k_out = np.empty((starts[-1], *shape), dtype=dtype)  # [C, Hkv, hd]
        v_out = np.empty_like(k_out)

        def put(i: int) -> None:
            # numpy, not torch: a torch copy in a pool thread would start its own OpenMP team on busy cores
            k, v = self._decode(self.chunks[i], fetched[i])  # [T, Hkv, hd] each
            self._check_rows(i, k.shape, starts, shape)
            k_out[starts[i]:starts[i + 1]] = k
            v_out[starts[i]:starts[i + 1]] = v

        k_all, v_all = torch.from_numpy(k_out), torch.from_numpy(v_out)  # in-memory chunks: a torch copy (bf16)
        self._fill(put, fetched, k_all, v_all)
        if self._stream is not None:
            with torch.cuda.stream(self._stream):
                k_all = k_all.pin_memory().to(self.device, non_blocking=True)
                v_all = v_all.pin_memory().to(self.device, non_blocking=True)
        return k_all, v_all

    def _place_bf16(self, fetched: list) -> tuple[torch.Tensor, torch.Tensor]:
        """`_place` for a bf16 model over fp16 stored values: each chunk's payload goes straight to bf16 rows of the
        layer's buffers in one native pass (the numpy decode and torch cast took ≈5 ms a layer of 6.3k tokens)."""
        starts = self._starts
        shape = _layer_shape(fetched)
        k_out = torch.empty((starts[-1], *shape), dtype=torch.bfloat16)  # [C, Hkv, hd]
        v_out = torch.empty_like(k_out)

        def put(i: int) -> None:
            ref = self.chunks[i]
            try:
                head, body = fetched[i].body()
            except CorruptValue as exc:
                raise CorruptChunk(ref.chunk_id, str(exc)) from None
            if head.has_positions:
                raise CorruptChunk(ref.chunk_id, "holds a reduced (Keyformer) subset, which blending cannot use yet")
            self._check_rows(i, head.shape, starts, shape)
            fp16_to_bf16.convert(body, bool(head.flags & FLAG_SHUFFLED), k_out[starts[i]:starts[i + 1]],
                                 v_out[starts[i]:starts[i + 1]])

        self._fill(put, fetched, k_out, v_out)
        return k_out, v_out

    def _fill(self, put, fetched: list, k_all: torch.Tensor, v_all: torch.Tensor) -> None:
        """put(i) for every stored chunk i (it writes chunk i's rows), then every in-memory chunk copied into its
        rows of k_all / v_all [C, Hkv, hd]."""
        self._run_puts(put, [i for i, item in enumerate(fetched) if isinstance(item, RawLayer)])
        starts, shape = self._starts, k_all.shape[1:]
        for i, item in enumerate(fetched):
            if not isinstance(item, RawLayer):
                self._check_rows(i, item[0].shape, starts, shape)
                k_all[starts[i]:starts[i + 1]] = item[0]
                v_all[starts[i]:starts[i + 1]] = item[1]

    def _run_puts(self, put, stored: list[int]) -> None:
        """put(i) for every stored chunk i, over the pool where there is one, in one run of consecutive chunks per
        thread (a task per chunk cost more in wake-ups than it shared: 2.7 vs 1.7 ms a layer of ten chunks on two
        threads); raises the first failure."""
        def run(part: list[int]) -> None:
            for i in part:
                put(i)

        n = len(stored)
        threads = 1 if self._pool is None else min(n, self._pool_threads)
        if threads <= 1:
            run(stored)
            return
        parts = [stored[n * t // threads:n * (t + 1) // threads] for t in range(threads)]
        for future in [self._pool.submit(run, part) for part in parts]:
            future.result()

    def _check_rows(self, i: int, kv_shape, starts: list[int], shape) -> None:
        if kv_shape[0] != starts[i + 1] - starts[i] or tuple(kv_shape[1:]) != tuple(shape):
            raise CorruptChunk(self.chunks[i].chunk_id, f"holds KV of shape {tuple(kv_shape)}, not one row per token")

    def _decode(self, ref: ChunkRef, raw: RawLayer) -> tuple[np.ndarray, np.ndarray]:
        """One chunk's stored (k, v) decoded, as arrays [T, Hkv, hd]."""
        try:
            decoded = raw.decode(copy=False)  # views, when uncompressed: `put` copies them into the layer buffer
        except CorruptValue as exc:
            raise CorruptChunk(ref.chunk_id, str(exc)) from None
        if decoded.positions is not None:
            raise CorruptChunk(ref.chunk_id, "holds a reduced (Keyformer) subset, which blending cannot use yet")
        return decoded.k, decoded.v

    def _read(self, ref: ChunkRef, layer: int) -> RawLayer:
        """One chunk's stored layer, read and checked against its record; CorruptChunk when missing or damaged."""
        try:
            raw = self.table.get_layer_raw(ref.chunk_id, layer, expect_token_ids=ref.token_ids)
        except MissingChunk:
            raise CorruptChunk(ref.chunk_id, "missing from the store") from None
        except CorruptValue as exc:
            raise CorruptChunk(ref.chunk_id, str(exc)) from None
        self.bytes_read += len(raw.value)
        return raw


def _layer_shape(fetched: list) -> tuple[int, int]:
    """(Hkv, hd) of a layer's chunks: the first chunk's, which `_check_rows` holds every other chunk to."""
    return next(tuple(item.shape[1:]) if isinstance(item, RawLayer) else tuple(item[0].shape[1:]) for item in fetched)


def _array_dtype(item) -> np.dtype:
    """The numpy dtype that holds a chunk's KV exactly: what its codec decodes to, or its in-memory dtype."""
    if isinstance(item, RawLayer):
        return DECODED_DTYPES[item.codec]
    return np.dtype(np.float16 if item[0].dtype == torch.float16 else np.float32)
