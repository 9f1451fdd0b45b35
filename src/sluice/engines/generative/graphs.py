"""CUDA graphs of pure decode steps: one launch instead of ~500 per step.

On a GPU a decode step of a small model is bound by the host: a 1 B Llama's step at 32 sequences
launched ~490 kernels from Python (7.6 ms on an H200) while the GPU was busy 3.5 ms of it
(`benchmarks/generative/step_profile.py`). A CUDA graph records a step's kernels once and
replays them with one call, so the step costs what the GPU does.

A graph has fixed shapes and fixed input addresses. So a step is padded to a *bucket*: its
sequences up to the next batch size in `BATCH_SIZES`, its longest context up to the next size in
`CONTEXTS`; one graph is captured per bucket at start, largest first, all sharing one memory pool.
Each graph owns one input tensor, a row per sequence:

    [token id, position, slot to write, block table padded to the bucket's context]

which a step fills on the host and copies over in one transfer. Inside the graph, the slots each
row reads and its causal mask (keys at positions <= its own) are derived from the row, as the
eager path derives them (`model.table_slots`, `ModelRunner._decode_group`). Padding rows (beyond the
step's sequences) decode token 0 at position 0 and write and read the cache's scratch block
(`KVCache.scratch_block`), which no sequence owns; their logits are never read. A real row's
block table beyond its own blocks keeps whatever it held (valid block ids): those slots are
masked out.

Which steps: every chunk one token that samples, no prompt log-probabilities, no sliding-window
layers (their second mask is not in the graph), and a bucket within `MAX_SLOTS` (B x context:
what the attention gathers) and the model's context. Anything else runs eagerly, as before.
On the CPU nothing is captured; `DecodeGraph.run` then calls the same forward eagerly, which is
how the tests check the padding on a machine without a GPU.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from sluice.engines.device_gate import DEVICE_GATE
from sluice.engines.generative.model import AttentionGroup, ForwardInput, table_slots
from sluice.engines.generative.scheduler import ScheduledChunk

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE as _PoolHandle

__all__ = ["BATCH_SIZES", "CONTEXTS", "MAX_SLOTS", "DecodeGraph", "DecodeGraphs"]

log = logging.getLogger("sluice.engines.generative")

BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256)
"""Batch sizes captured (up to the engine's `max_num_seqs`); a step is padded to the next one."""
CONTEXTS = (128, 256, 512, 1024, 2048, 4096)
"""Context lengths captured (up to the model's); a step's longest context is padded to the next one."""
MAX_SLOTS = 1 << 18
"""At most this many slots (batch x context) per graph: a step's attention gathers them all."""

_ID, _POSITION, _WRITE, _TABLE = 0, 1, 2, 3  # columns of a graph's input rows

Forward = Callable[[ForwardInput], torch.Tensor]
"""The model's forward pass over the runner's cache (`ModelRunner.execute`)."""


class DecodeGraph:
    """A decode step of `num_seqs` rows over contexts of up to `context` tokens."""

    def __init__(self, num_seqs: int, context: int, block_size: int, scratch_block: int, device: str) -> None:
        self.num_seqs, self.context, self.block_size = num_seqs, context, block_size
        width = _TABLE + context // block_size
        self._host = np.zeros((num_seqs, width), dtype=np.int64)
        self._padding_row = np.full(width, scratch_block, dtype=np.int64)
        self._padding_row[[_ID, _POSITION]] = 0
        self._padding_row[_WRITE] = scratch_block * block_size
        self._host[:] = self._padding_row
        self._inputs = torch.from_numpy(self._host).to(device)
        self._rows = torch.arange(num_seqs, device=device)
        self._keys = torch.arange(context, device=device)
        self._graph: torch.cuda.CUDAGraph | None = None
        self._logits: torch.Tensor | None = None
        self.num_runs = 0
        """Steps run through this graph."""

    def fits(self, num_seqs: int, context: int) -> bool:
        return num_seqs <= self.num_seqs and context <= self.context

    def fill(self, chunks: Sequence[ScheduledChunk]) -> None:
        """This step's rows (each chunk one token), then padding; copied to the device."""
        host, bs = self._host, self.block_size
        width = host.shape[1] - _TABLE
        for row, chunk in enumerate(chunks):
            pos = chunk.start
            table = chunk.block_table
            host[row, _ID] = chunk.token_ids[0]
            host[row, _POSITION] = pos
            host[row, _WRITE] = table[pos // bs] * bs + pos % bs
            n = min(len(table), width)
            host[row, _TABLE:_TABLE + n] = table[:n]
        host[len(chunks):] = self._padding_row
        self._inputs.copy_(torch.from_numpy(host))

    def forward(self, model: Forward) -> torch.Tensor:
        """The step on the filled inputs: logits of every row, padding included ([num_seqs, vocab])."""
        inputs = self._inputs
        positions = inputs[:, _POSITION]
        slots = table_slots(inputs[:, _TABLE:], self.block_size, self.context)
        mask = (self._keys[None, :] <= positions[:, None])[:, None, None, :]
        group = AttentionGroup(self._rows, slots, mask, self.num_seqs, 1, covers_all=True)
        step = ForwardInput(inputs[:, _ID], positions, inputs[:, _WRITE], (group,), self._rows)
        return model(step)

    def capture(self, model: Forward, pool: _PoolHandle) -> None:
        """Record `forward` (after warming it up on a side stream, as CUDA graphs require)."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.forward(model)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            self._logits = self.forward(model)
        self._graph = graph

    def run(self, model: Forward) -> torch.Tensor:
        """The filled step's logits: the captured graph replayed, or (not captured) run eagerly.
        A replay's logits are overwritten by the next replay."""
        self.num_runs += 1
        if self._graph is None:
            return self.forward(model)
        self._graph.replay()
        assert self._logits is not None
        return self._logits


class DecodeGraphs:
    """One `DecodeGraph` per bucket, from the smallest; `capture` records them on CUDA."""

    def __init__(self, max_seqs: int, max_len: int, block_size: int, scratch_block: int, device: str) -> None:
        batch_sizes = _up_to(BATCH_SIZES, max_seqs)
        contexts = _up_to([-(-c // block_size) * block_size for c in CONTEXTS], max_len)
        self.graphs = [DecodeGraph(b, c, block_size, scratch_block, device)
                       for c in contexts for b in batch_sizes if b * c <= MAX_SLOTS]
        self.graphs.sort(key=lambda g: (g.num_seqs * g.context, g.context))
        self._device = device

    def find(self, chunks: Sequence[ScheduledChunk]) -> DecodeGraph | None:
        """The smallest graph this step fits, if it is a pure decode step that one fits."""
        if not chunks or any(len(c.token_ids) != 1 or not c.needs_sample for c in chunks):
            return None
        context = max(c.start for c in chunks) + 1
        return next((g for g in self.graphs if g.fits(len(chunks), context)), None)

    def capture(self, model: Forward) -> None:
        """Record every graph, largest first: the smaller ones reuse its memory."""
        if not self.graphs:
            return
        with torch.cuda.device(self._device):  # the streams and the pool on the model's device (cuda:N)
            pool = torch.cuda.graph_pool_handle()
            before = torch.cuda.memory_reserved()
            started = time.perf_counter()
            for graph in sorted(self.graphs, key=lambda g: -g.num_seqs * g.context):
                with DEVICE_GATE.exclusive():  # nothing else on the device while it records
                    graph.capture(model, pool)
            reserved = torch.cuda.memory_reserved() - before
        log.info("captured %d CUDA graphs of decode steps (batches up to %d, contexts up to %d) in %.1f s: %.0f MiB",
                 len(self.graphs), max(g.num_seqs for g in self.graphs), max(g.context for g in self.graphs),
                 time.perf_counter() - started, reserved / 2**20)


def _up_to(sizes: Sequence[int], limit: int) -> list[int]:
    """`sizes` below `limit`, and the first that reaches it (so `limit` itself is covered)."""
    out = [s for s in sizes if s < limit]
    reaching = [s for s in sizes if s >= limit]
    return out + reaching[:1]
