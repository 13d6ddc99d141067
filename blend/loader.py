"""The layer loader: reads, checks, decodes and places chunk KV one layer ahead of the compute.

On the CPU it is a thread (LMDB reads and zstd release the GIL) that decodes values straight from the
map into one buffer per layer, left in the stored dtype: on a CPU the loader competes with the compute
for the same cores, so it does as little as it can. On CUDA the buffer is pinned and copied on a side
stream. A value that fails its checksum is never handed out: the consumer gets `CorruptChunk` naming
the chunk, and recomputes it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvrag import KvragError
from kvrag.blend.prefill import LayerKV
from kvrag.store.codec import CorruptValue
from kvrag.store.kv import KVTable, MissingChunk


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

    At most `lookahead` layers wait decoded in memory. `delay_s` slows each layer's read (tests).
    """

    def __init__(self, table: KVTable | None, chunks: Sequence[ChunkRef], layers: Sequence[int],
                 dtype: torch.dtype, device: torch.device, lookahead: int = 4, delay_s: float = 0.0):
        self.table, self.chunks, self.layers = table, list(chunks), list(layers)
        self.dtype, self.device, self.delay_s = dtype, device, delay_s
        self._ready = {layer: threading.Event() for layer in self.layers}
        self._results: dict[int, tuple[torch.Tensor, torch.Tensor] | BaseException] = {}
        self._slots = threading.Semaphore(lookahead)
        self._stop = False
        self.spans: list[tuple[str, int, float, float]] = []  # ("load", layer, start, end)
        self.bytes_read = 0
        self._stream = torch.cuda.Stream() if device.type == "cuda" else None
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
        if self._stream is not None:
            torch.cuda.current_stream().wait_stream(self._stream)
        return result

    def close(self) -> None:
        self._stop = True
        for _ in self.layers:
            self._slots.release()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        failure: BaseException | None = None
        for layer in self.layers:
            self._slots.acquire()
            if self._stop:
                return
            if failure is None:
                try:
                    self._results[layer] = self._load(layer)
                except BaseException as exc:  # handed to the consumer, which decides
                    failure = exc
            if failure is not None:
                self._results[layer] = failure
            self._ready[layer].set()

    def _load(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) of every chunk token for `layer`, each [C, Hkv, hd] in the stored dtype.

        Each value is decoded straight from LMDB's map into one preallocated pair of tensors; the cast to
        the compute dtype is left to the consumer's copy into its own buffers, so the loader takes as
        little CPU as it can from the compute it runs beside.
        """
        start = time.perf_counter()
        if self.delay_s:
            time.sleep(self.delay_s)
        n_rows = sum(len(ref.token_ids) for ref in self.chunks)
        k_out = v_out = None
        row = 0
        for ref in self.chunks:
            if ref.in_memory is not None:
                k, v = ref.in_memory.k[layer], ref.in_memory.v[layer]  # [T, Hkv, hd] each
            else:
                decoded = self._read(ref, layer)
                k, v = torch.from_numpy(decoded.k), torch.from_numpy(decoded.v)  # [T, Hkv, hd] each
            if k_out is None:
                k_out = torch.empty((n_rows, *k.shape[1:]), dtype=k.dtype)  # [C, Hkv, hd]
                v_out = torch.empty_like(k_out)
            if row + k.shape[0] > n_rows or k.shape[1:] != k_out.shape[1:]:
                raise CorruptChunk(ref.chunk_id, f"holds KV of shape {tuple(k.shape)}, not one row per token")
            k_out[row:row + k.shape[0]] = k
            v_out[row:row + v.shape[0]] = v
            row += k.shape[0]
        if row != n_rows:
            raise CorruptChunk(self.chunks[-1].chunk_id, f"the chunks' KV has {row} rows for {n_rows} tokens")
        if self._stream is not None:
            with torch.cuda.stream(self._stream):
                k_out = k_out.pin_memory().to(self.device, non_blocking=True)
                v_out = v_out.pin_memory().to(self.device, non_blocking=True)
        self.spans.append(("load", layer, start, time.perf_counter()))
        return k_out, v_out

    def _read(self, ref: ChunkRef, layer: int):
        """One chunk's decoded layer from the store; CorruptChunk when it is missing or damaged."""
        try:
            decoded, n_bytes = self.table.read_layer(ref.chunk_id, layer, expect_token_ids=ref.token_ids)
        except MissingChunk:
            raise CorruptChunk(ref.chunk_id, "missing from the store") from None
        except CorruptValue as exc:
            raise CorruptChunk(ref.chunk_id, str(exc)) from None
        if decoded.positions is not None:
            raise CorruptChunk(ref.chunk_id, "holds a reduced (Keyformer) subset, which blending cannot use yet")
        self.bytes_read += n_bytes
        return decoded
