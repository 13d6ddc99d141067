"""Staging: a layer's stored chunks gathered, as stored, into one host buffer that is reused layer after layer.

One layer of a question is a few dozen stored values (one per chunk), each 0.1-8 MB. The staging area keeps
`slots` host buffers for the life of an engine (pinned where a GPU reads them; allocating pinned memory takes
milliseconds a megabyte, so a buffer only ever grows), and fills one with a layer's chunks over a small pool of
threads: the values are read as views of LMDB's map inside one read transaction (no copy into Python bytes), and
each thread checks a chunk's checksum, decompresses it where it was stored compressed and copies it into its rows.
zstd, numpy's copies and the page faults they take release the GIL; xxhash's checksum does not.

The slot's layout, so that one host-to-device copy sends the whole layer and one kernel launch loads it:

    K [C, Hkv, hd] | V [C, Hkv, hd]          in the stored dtype (float16, bfloat16, int8), C = the layer's rows
    int8 only:  K scales [n_chunks, Hkv, hd] float32 (per channel) or [C, Hkv] (per token) | V scales [C, Hkv]

Rows of chunks that are not staged (in memory already) are left as they were: the loader writes them afterwards.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from kvrag.store.codec import (
    FLAG_K_PER_CHANNEL,
    FLAG_RAW,
    FLAG_SHUFFLED,
    HEADER_SIZE,
    CorruptValue,
    ValueHeader,
    checked_body,
    copy_checked,
    read_header,
    stored_kv,
)

STORED_TORCH = {"fp16": torch.float16, "bf16": torch.bfloat16, "int8": torch.int8}


@dataclass
class StagedLayer:
    """Views of a slot holding one layer's stored chunks (layout in the module doc)."""

    flat: torch.Tensor  # uint8 [nbytes]: everything below, in one piece
    k: torch.Tensor  # [C, Hkv, hd] stored dtype
    v: torch.Tensor  # [C, Hkv, hd]
    k_scale: torch.Tensor | None = None  # int8: [n_chunks, Hkv, hd] or [C, Hkv] float32
    v_scale: torch.Tensor | None = None  # int8: [C, Hkv] float32
    staged_bytes: int = 0  # stored bytes this layer read (before decompression)
    host: dict[str, np.ndarray] | None = None  # the same sections as numpy arrays (16-bit values as uint16 bits)


@dataclass(frozen=True)
class LayerPlan:
    """What one layer's slot holds: C rows of (Hkv, hd), chunk i's rows starts[i]..starts[i+1]-1, in `codec`."""

    codec: str
    rows: int
    heads: int
    head_dim: int
    starts: tuple[int, ...]
    k_per_channel: bool = False

    def sections(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """(name, dtype, shape) of the slot's sections, in order."""
        c, h, d = self.rows, self.heads, self.head_dim
        kv_dtype = STORED_TORCH[self.codec]
        out = [("k", kv_dtype, (c, h, d)), ("v", kv_dtype, (c, h, d))]
        if self.codec == "int8":
            out += [("k_scale", torch.float32, (len(self.starts) - 1, h, d) if self.k_per_channel else (c, h)),
                    ("v_scale", torch.float32, (c, h))]
        return out


class StageFailed(Exception):
    """Chunk `index`'s stored value failed a check (the loader names the chunk and recomputes it)."""

    def __init__(self, index: int, reason: str):
        super().__init__(reason)
        self.index, self.reason = index, reason


def spare_cores(device_type: str) -> int:
    """Staging threads for an engine on this device: with a GPU computing, every core but the one that launches its
    work (the lent GPU machines have 16); on the CPU, torch's forward has the cores, and two threads keep a layer's
    read ahead of it."""
    if device_type != "cuda":
        return 2
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 2
    return max(2, cores - 1)


class StagingArea:
    """`slots` host buffers (pinned when `pinned`) and `threads` workers that fill them; one per engine.

    A slot is taken with `acquire` (waiting until whoever used it last called `release`) and filled with `stage`.
    """

    def __init__(self, pinned: bool = False, slots: int = 2, threads: int = 2):
        self.pinned = pinned
        self._buffers = [torch.empty(0, dtype=torch.uint8) for _ in range(slots)]
        self._free = [threading.Event() for _ in range(slots)]
        for event in self._free:
            event.set()
        self._after: list[Callable[[], None] | None] = [None] * slots  # waits for a device copy out of the slot
        self._device: list[torch.Tensor | None] = [None] * slots  # each slot's copy on the device (upload)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvrag-stage")
        self.grown = 0  # buffer allocations, for the bench (a warm area allocates nothing)

    @property
    def slots(self) -> int:
        return len(self._buffers)

    def acquire(self, index: int) -> int:
        """The slot for the index-th layer of a load, once free (its last copy to the device done)."""
        slot = index % self.slots
        self._free[slot].wait()
        self._free[slot].clear()
        after, self._after[slot] = self._after[slot], None
        if after is not None:
            after()
        return slot

    def release(self, slot: int, after: Callable[[], None] | None = None) -> None:
        """The slot may be filled again; `after` (a device copy's wait) runs first when it is."""
        self._after[slot] = after
        self._free[slot].set()

    def stage(self, slot: int, plan: LayerPlan, values: Sequence[memoryview | bytes | None],
              check: Callable[[int, ValueHeader, memoryview | bytes], None]) -> StagedLayer:
        """Fill the slot with `values` (per chunk: None where not staged, else its stored value), over the pool.
        `check(i, header, body)` vets chunk i's checked, decompressed body (raises StageFailed); the first failure
        is raised here, after every worker has stopped."""
        staged = self._views(slot, plan)
        for i, value in enumerate(values):  # rows written later (a memory tier's chunks): zeros, not old bytes
            if value is None:
                for name, array in staged.host.items():
                    rows = slice(plan.starts[i], plan.starts[i + 1])
                    array[i if name == "k_scale" and plan.k_per_channel else rows] = 0
        jobs = [self._pool.submit(_stage_chunk, staged, plan, i, value, check)
                for i, value in enumerate(values) if value is not None]
        failure = None
        for job in jobs:
            try:
                staged.staged_bytes += job.result()
            except BaseException as exc:  # every job finishes before the slot is handed back
                failure = failure or exc
        if failure is not None:
            raise failure
        return staged

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def upload(self, slot: int, staged: StagedLayer, plan: LayerPlan, device: torch.device) -> StagedLayer:
        """The slot's layer on `device` in one copy, into that slot's buffer there (kept, grown like the host's):
        views of it with the host slot's layout. On CUDA the copy is asynchronous on the current stream: the caller
        releases the slot with a wait for it."""
        n = staged.flat.numel()
        if self._device[slot] is None or self._device[slot].numel() < n or self._device[slot].device.type != device.type:
            self._device[slot] = torch.empty(self._buffers[slot].numel(), dtype=torch.uint8, device=device)
            self.grown += 1
        self._device[slot][:n].copy_(staged.flat, non_blocking=True)
        views = _views_of(self._device[slot], plan, host=False)
        return StagedLayer(self._device[slot][:n], **views)

    def _views(self, slot: int, plan: LayerPlan) -> StagedLayer:
        need = sum(_aligned(torch.Size(shape).numel() * dtype.itemsize) for _, dtype, shape in plan.sections())
        if self._buffers[slot].numel() < need:  # grown by a quarter more, so a slightly longer prompt fits
            self._buffers[slot] = torch.empty(need + need // 4, dtype=torch.uint8, pin_memory=self.pinned)
            self.grown += 1
        views = _views_of(self._buffers[slot], plan, host=False)
        host = _views_of(self._buffers[slot], plan, host=True)
        return StagedLayer(self._buffers[slot][:need], host=host, **views)


def _views_of(buffer: torch.Tensor, plan: LayerPlan, host: bool) -> dict:
    """The plan's sections laid out in `buffer` (uint8): torch views, or (`host`) numpy arrays of their bits."""
    out, offset = {}, 0
    for name, dtype, shape in plan.sections():
        size = torch.Size(shape).numel() * dtype.itemsize
        piece = buffer[offset:offset + size]
        out[name] = piece.numpy().view(_NUMPY_BITS[dtype]).reshape(shape) if host else piece.view(dtype).view(shape)
        offset += _aligned(size)
    return out


_NUMPY_BITS = {torch.float16: np.uint16, torch.bfloat16: np.uint16, torch.int8: np.int8, torch.float32: np.float32}


def _aligned(n: int) -> int:
    return (n + 255) // 256 * 256  # each section starts 256-byte aligned, as a device tensor would


def _stage_chunk(staged: StagedLayer, plan: LayerPlan, i: int, raw: memoryview | bytes,
                 check: Callable[[int, ValueHeader, memoryview | bytes], None]) -> int:
    """Chunk i's stored value checked and copied into its rows of the slot; the stored bytes read. An uncompressed
    value is copied and checked in one pass over it (codec.copy_checked), a compressed one decompressed first."""
    try:
        head = read_header(raw)
        problem = _layout_problem(head, plan, i)
        if problem:  # said after the checksum and the kept tokens, as for any value
            head, body = checked_body(raw, expect_codec=plan.codec)
            check(i, head, body)
            raise CorruptValue(problem)
        if head.flags & FLAG_RAW:
            copy_checked(raw, _destinations(staged, plan, i), expect_codec=plan.codec)
            check(i, head, memoryview(raw)[HEADER_SIZE:])
        else:
            head, body = checked_body(raw, expect_codec=plan.codec)
            check(i, head, body)
            _copy_rows(staged, plan, i, head, body)
    except CorruptValue as exc:
        raise StageFailed(i, str(exc)) from None
    return len(raw)


def _layout_problem(head: ValueHeader, plan: LayerPlan, i: int) -> str | None:
    """Why a value cannot fill chunk i's rows of the slot: another shape, or int8 key scales laid out otherwise."""
    if head.shape[1:] != (plan.heads, plan.head_dim) or head.shape[0] != plan.starts[i + 1] - plan.starts[i]:
        return f"holds KV of shape {head.shape}, not one row per token"
    if plan.codec == "int8" and bool(head.flags & FLAG_K_PER_CHANNEL) != plan.k_per_channel:
        return "its int8 key scales are laid out unlike the other chunks' (recomputed)"
    return None


def _destinations(staged: StagedLayer, plan: LayerPlan, i: int) -> list[np.ndarray]:
    """Chunk i's parts of the slot as bytes, in the order an uncompressed value holds them: K, V, (int8) K scales, V
    scales."""
    rows = slice(plan.starts[i], plan.starts[i + 1])
    parts = [staged.host["k"][rows], staged.host["v"][rows]]
    if plan.codec == "int8":
        parts += [staged.host["k_scale"][i] if plan.k_per_channel else staged.host["k_scale"][rows],
                  staged.host["v_scale"][rows]]
    return [part.reshape(-1).view(np.uint8) for part in parts]


def _copy_rows(staged: StagedLayer, plan: LayerPlan, i: int, head: ValueHeader, body) -> None:
    """Chunk i's decompressed body into its rows of the slot (int8: and its scales)."""
    rows = slice(plan.starts[i], plan.starts[i + 1])
    if plan.codec == "int8":  # views of the body: values and scales in natural order
        kv = stored_kv(head, body)
        staged.host["k"][rows], staged.host["v"][rows] = kv.k, kv.v
        staged.host["k_scale"][i if kv.k_per_channel else rows] = kv.k_scale
        staged.host["v_scale"][rows] = kv.v_scale
        return
    n = int(np.prod(head.shape))
    k_rows = staged.host["k"][rows].reshape(-1)  # contiguous rows of the slot, as bits
    v_rows = staged.host["v"][rows].reshape(-1)
    if head.flags & FLAG_SHUFFLED:  # byte planes: [low bytes of K|V; high bytes of K|V]
        planes = np.frombuffer(body, dtype=np.uint8, count=4 * n).reshape(2, 2 * n)
        for bits, part in ((k_rows, slice(0, n)), (v_rows, slice(n, 2 * n))):
            np.left_shift(planes[1, part], 8, out=bits, dtype=np.uint16)
            np.bitwise_or(bits, planes[0, part], out=bits)
    else:  # natural order, K then V
        kv = np.frombuffer(body, dtype=np.uint16, count=2 * n)
        k_rows[:], v_rows[:] = kv[:n], kv[n:]
