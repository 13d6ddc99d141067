"""CUDA graphs for the batched decode step (issue 47): capture the step once per batch bucket, then replay it.

A small model's decode step is a few hundred small kernels launched from Python (30 layers of norms, projections,
rotary, the paged attention kernel, the MLP); on a GPU the host's launches, not the kernels, set its time. As in
vLLM and SGLang, the step is captured once per batch bucket (1, 2, 4, ... up to the engine's largest batch) over
static input buffers and replayed: one launch a step.

- Static inputs (`StaticInputs`): token ids, positions, new-token slots, the block tables padded to the widest a
  sequence can have (M_max) and the lengths, at fixed addresses; a step copies its inputs into them (one
  host-to-device copy) and replays. Every shape the captured step sees is the bucket's, and the decode kernel's
  split plan is fixed for M_max (`triton_attention.decode_splits`), with check=False: nothing in the captured
  region reads a value back to the host or branches on one.
- A batch of n runs in the smallest bucket >= n. Its pad rows (n..bucket-1) feed token 0 at position 0 into a
  scratch block the runner holds for itself (no table lists it) and see 1 key: they never write or read a real
  sequence's K/V. Logits come back as rows [:n].
- What is not captured runs eagerly (engine/batch_decode.py decides): a batch with taps (a decode-time budget's
  scores), a model off the Triton path (torch's per-sequence attention gathers by value), a batch larger than the
  largest bucket. Constrained decoding masks the logits after the step, so it replays like any other batch.
- The capture itself is injectable (`Capture`): on CUDA `CudaGraphCapture` records a torch.cuda.CUDAGraph; on a CPU
  `eager_capture` "replays" by calling the same static-buffer step again, which is what the tests run under Triton's
  interpreter.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from kvrag.engine.kv_pool import SequenceKV
from kvrag.kvcache.allocator import BlockTable
from kvrag.model.step import Rows, run_layers
from kvrag.model.transformer import Transformer

Step = Callable[[], torch.Tensor]  # the captured step: reads the static inputs, returns logits [bucket, V]
Capture = Callable[[Step], Step]  # captures a step (its inputs already set to pad rows), returns what replays it


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """The batch sizes captured: powers of two below max_batch, then max_batch itself."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be at least 1, got {max_batch}")
    return (*(1 << i for i in range((max_batch - 1).bit_length())), max_batch)


def eager_capture(step: Step) -> Step:
    """The CPU's capture: run the step once (as CUDA's warm-up does) and replay it by calling it again over the
    same static buffers."""
    step()
    return step


class CudaGraphCapture:
    """Warm the step up on a side stream (Triton compiles its kernels and cuBLAS sets up its workspace there: neither
    may happen inside a capture), then record it into a torch.cuda.CUDAGraph. Every bucket's graph shares one memory
    pool: their temporaries take the memory once (a step's output stays live, so no later graph reuses it)."""

    def __init__(self, device: torch.device, warmup: int = 2):
        self.device, self.warmup = device, warmup
        self.pool = torch.cuda.graph_pool_handle()

    def __call__(self, step: Step) -> Step:
        main, side = torch.cuda.current_stream(self.device), torch.cuda.Stream(self.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                step()
        main.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the loader's threads may use CUDA while the engine's thread captures
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = step()  # [bucket, V], at an address the graph writes on every replay

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay


class StaticInputs:
    """The decode step's inputs at fixed addresses, in one int32 device buffer (a step's inputs go over in one copy)
    and its host twin (pinned on a GPU):

        ints    [3, Bmax]     token ids, positions, new-token slots (the step widens them to int64)
        lens    [Bmax]        keys each row sees: its sequence's tokens, the new one included
        tables  [Bmax, M]     block ids, padded with the scratch block (entries past a sequence's blocks are never
                              read; the scratch block keeps them harmless)
    """

    def __init__(self, max_batch: int, max_blocks: int, scratch: int, block_size: int, device: torch.device):
        self.max_batch, self.max_blocks, self.scratch, self.block_size = max_batch, max_blocks, scratch, block_size
        size = 4 * max_batch + max_batch * max_blocks
        self.device_buf = torch.zeros(size, dtype=torch.int32, device=device)
        self.host_buf = torch.zeros(size, dtype=torch.int32, pin_memory=device.type == "cuda")
        self.ints, self.lens, self.tables = self._views(self.device_buf)
        self._host = self._views(self.host_buf.numpy())
        self._copied = torch.cuda.Event() if device.type == "cuda" else None  # the last copy out of host_buf

    def _views(self, buf):
        bmax = self.max_batch
        return (buf[:3 * bmax].reshape(3, bmax), buf[3 * bmax:4 * bmax],
                buf[4 * bmax:].reshape(bmax, self.max_blocks))

    def fill(self, bucket: int, tokens: Sequence[int], tables: Sequence[BlockTable],
             offsets: Sequence[int] | None = None) -> None:
        """Rows [:n] from the sequences (as BatchDecoder.step takes them), rows n..bucket-1 pad rows, then one copy
        of the rows the bucket's graph reads."""
        if self._copied is not None:  # the host buffer is rewritten only once its last copy has left it
            self._copied.synchronize()
        ints, lens, tabs = self._host
        n, bs = len(tables), self.block_size
        tabs[:bucket] = self.scratch
        for b, t in enumerate(tables):
            tabs[b, :len(t.blocks)] = t.blocks
            last = t.n_tokens - 1
            ints[2, b] = t.blocks[last // bs] * bs + last % bs  # the new token's slot (SequenceKV.grow made it)
        counts = np.fromiter((t.n_tokens for t in tables), dtype=np.int32, count=n)  # [n]
        ints[0, :n] = np.asarray(tokens, dtype=np.int32)
        ints[1, :n] = counts - 1 + (0 if offsets is None else np.asarray(offsets, dtype=np.int32))
        lens[:n] = counts
        ints[:2, n:bucket] = 0  # pad rows: token 0 at position 0 ...
        ints[2, n:bucket] = self.scratch * bs  # ... written to the scratch block's first row ...
        lens[n:bucket] = 1  # ... and seeing it alone
        self._copy(bucket)

    def pad(self, bucket: int) -> None:
        """Every row of the bucket a pad row: what a capture (and its warm-up) runs over."""
        self.fill(bucket, [], [])

    def _copy(self, bucket: int) -> None:
        head = 4 * self.max_batch  # ints and lens whole, then the bucket's table rows
        stop = head + bucket * self.max_blocks
        self.device_buf[:stop].copy_(self.host_buf[:stop], non_blocking=self._copied is not None)
        if self._copied is not None:
            self._copied.record()


class StaticPoolKV:
    """The paged pool as the layer step's KV target (model/step.py) over static inputs: PoolKV's Triton path with
    the new rows' slots, the padded tables and the lengths given as device tensors, and a fixed split plan."""

    def __init__(self, model: Transformer, kv: SequenceKV, new_slots: torch.Tensor, tables: torch.Tensor,
                 lens: torch.Tensor, splits: int):
        self.model, self.pool, self.splits = model, kv.pool.kv, splits  # pool [L, 2, N, bs, Hkv, hd]
        self.k_all, self.v_all = kv.layer_views()  # [L, slots, Hkv, hd] each
        self.new_slots, self.tables, self.lens = new_slots, tables, lens  # [B] int64, [B, M] int32, [B] int32

    def place(self, layer: int, rows: Rows, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k_all[layer].index_copy_(0, self.new_slots, self.model.rotate_keys(k, rows.pos, rows.rope, layer=layer))
        self.v_all[layer].index_copy_(0, self.new_slots, v)

    def attend(self, layer: int, q: torch.Tensor, rows: Rows) -> torch.Tensor:
        from kvrag.kernels import triton_attention  # imports Triton: only where it runs

        pool = self.pool
        out = triton_attention.decode_attention(q.to(pool.dtype), pool[layer, 0], pool[layer, 1], self.tables,
                                                self.lens, splits=self.splits, check=False)  # [B, Hq, hd]
        return out.view(q.shape[0], -1).to(q.dtype)  # [B, Hq * hd]


class DecodeGraphs:
    """The decode step captured per batch bucket over static inputs, replayed for every batch it serves.

    Holds one block of the pool (the pad rows' scratch) for as long as it lives. A bucket's graph is captured on its
    first batch (a few warm-up steps and one capture, all over pad rows), or up front by `capture_all`."""

    def __init__(self, model: Transformer, kv: SequenceKV, cos: torch.Tensor, sin: torch.Tensor, max_batch: int,
                 max_positions: int, capture: Capture | None = None, splits: int | None = None):
        self.model, self.kv, self.cos, self.sin = model, kv, cos, sin  # cos, sin [P, 1, hd]
        self.buckets = batch_buckets(max_batch)
        # M_max: the widest table a sequence can have (the model's context, or the whole pool)
        self.max_blocks = min(kv.blocks_needed(max_positions), kv.pool.num_blocks)
        self.scratch = kv.pool.allocator.allocate(1)[0]  # pad rows' K/V: a block no table lists
        device = kv.pool.kv.device
        self.inputs = StaticInputs(self.buckets[-1], self.max_blocks, self.scratch, kv.block_size, device)
        self.capture = capture or (CudaGraphCapture(device) if device.type == "cuda" else eager_capture)
        self.splits = splits  # the decode kernel's splits (None: its default plan for M_max, per bucket)
        self.replays: dict[int, Step] = {}
        self.stats = {"captured": 0, "replayed": 0, "eager": 0}  # eager: batches BatchDecoder ran without them

    def serves(self, tables: Sequence[BlockTable], taps: Sequence | None = None) -> bool:
        """Whether a batch replays: the Triton decode path, no taps, no larger than the largest bucket, and no
        table wider than M_max."""
        return (self.model.triton and 0 < len(tables) <= self.buckets[-1]
                and not any(t is not None for t in taps or ())
                and max(len(t.blocks) for t in tables) <= self.max_blocks)

    def capture_all(self) -> None:
        """Capture every bucket not captured yet, the largest first (its temporaries take the shared pool's memory,
        which the smaller ones then reuse): at start-up, so no decode step pays for a capture."""
        for bucket in reversed(self.buckets):
            if bucket not in self.replays:
                self._capture(bucket)

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    @torch.inference_mode()
    def step(self, tokens: Sequence[int], tables: Sequence[BlockTable],
             offsets: Sequence[int] | None = None) -> torch.Tensor:
        """BatchDecoder.step's contract for a batch it `serves`: next-token logits [n, V] float32."""
        n = len(tables)
        bucket = self.bucket(n)
        replay = self.replays.get(bucket) or self._capture(bucket)
        self.inputs.fill(bucket, tokens, tables, offsets)
        self.stats["replayed"] += 1
        return replay()[:n].clone()  # a copy: the next replay overwrites the graph's output

    def _capture(self, bucket: int) -> Step:
        self.inputs.pad(bucket)  # the warm-up and the capture write the scratch block alone
        self.replays[bucket] = self.capture(self._step_for(bucket))
        self.stats["captured"] += 1
        return self.replays[bucket]

    def _step_for(self, bucket: int) -> Step:
        """The step over the bucket's rows of the static inputs: every shape, and the split plan, fixed."""
        m, s = self.model, self.inputs
        ints, tables, lens = s.ints[:, :bucket], s.tables[:bucket], s.lens[:bucket]  # [3, B], [B, M], [B]
        splits = self.splits if self.splits is not None else self._default_splits(bucket)

        def step() -> torch.Tensor:
            tokens, positions, slots = ints.long()  # [B] each
            rows = Rows(m.embed(tokens), positions, (self.cos[positions], self.sin[positions]))  # h [B, D]
            kv = StaticPoolKV(m, self.kv, slots, tables, lens, splits)
            return run_layers(m, rows, kv, all_rows=True)  # [B, V]: each row is its sequence's last

        return step

    def _default_splits(self, bucket: int) -> int:
        from kvrag.kernels import triton_attention  # imports Triton: only where it runs

        capacity = self.max_blocks * self.kv.block_size
        return triton_attention.decode_splits(capacity, bucket * self.model.cfg.n_kv_heads, self.kv.pool.kv.device)
