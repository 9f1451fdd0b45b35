"""Turns a `SchedulerOutput` into tensors, runs the model, and returns logits.

    chunks (per sequence)            flattened batch (T tokens)          attention groups
    A: decode 1 token @ pos 37  -->  ids/positions/slot_mapping [T]  --> 1-token chunks: padded
    B: decode 1 token @ pos 80                                          groups [B, 1, L] of similar
    C: prefill 120 tokens @ 0                                           lengths (one on CUDA)
                                                                      --> each longer chunk: its own
                                                                          causal group [1, n, L]

A decode group reads (gathers) and attends over B x L slots, L its longest context; with
contexts of 40 and 380 tokens in one step, most of that is padding. On the CPU, where that
work costs in proportion, decodes are split into groups of similar length (`DECODE_PADDING`);
on CUDA they stay one group, since there a step's cost is its kernel launches.

On CUDA a pure decode step (every chunk one token) skips all this: it fills the input rows of a
CUDA graph captured at load for its bucket of batch size and context, and replays it (`graphs`).

Logits are computed for the rows that sample (the last token of each chunk that reaches its
sequence's end), then for the prompt positions of sequences that asked for prompt
log-probabilities (`StepInput.prompt_spans`, in that order after the sampling rows).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from sluice.engines.generative.graphs import DecodeGraph, DecodeGraphs
from sluice.engines.generative.model import (
    AttentionGroup,
    ForwardInput,
    KVCache,
    ModelSpec,
    load_model,
    table_slots,
)
from sluice.engines.generative.scheduler import ScheduledChunk, SchedulerOutput

__all__ = ["ModelRunner", "PromptSpan", "StepInput"]

log = logging.getLogger("sluice.engines.generative")

ATTENTION_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
"""Attention kernels a CUDA step may use: not cuDNN's. Its fused attention builds an execution plan
for each new shape on the host (~3.7 ms a call on an H200, torch 2.11), and a decode step's key
length grows every step: 16 such calls were 90% of a 1 B model's 48 ms decode step at 32 sequences
while the GPU was busy 4.4 ms of it (`benchmarks/generative/step_profile.py`)."""

DECODE_PADDING = 0.25
"""CPU: a decode group's padded slots (B x its longest context) stay within this share above the
slots its sequences need."""

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


@dataclass(frozen=True, slots=True)
class PromptSpan:
    """`count` logits rows for a sequence's prompt positions `first_position`, `first_position` + 1, ...:
    row i holds the model's prediction of prompt token `first_position + i + 1`."""

    request_id: str
    first_position: int
    count: int


@dataclass(frozen=True, slots=True)
class StepInput:
    forward: ForwardInput | None
    """The step's tensors; None when it replays `graph`."""
    num_sample_rows: int
    """The first logits rows: one per chunk that samples, in chunk order."""
    prompt_spans: tuple[PromptSpan, ...] = ()
    """The rows after them, span by span."""
    graph: DecodeGraph | None = None
    """A pure decode step: the captured graph whose inputs hold it (`graphs`)."""


def kv_blocks_for(total: int, free: int, utilization: float, activations: int, bytes_per_block: int) -> int:
    """KV blocks that fit in `utilization` of a device's `total` bytes, when `total - free` are in
    use already (this model's weights, other processes) and a step's activations need `activations`."""
    budget = int(utilization * total) - (total - free) - activations
    if budget < bytes_per_block:
        gib = 1 << 30
        raise ValueError(f"no room for a KV cache: {(total - free) / gib:.1f} GiB of the device's "
                         f"{total / gib:.1f} GiB are in use and a step's activations need {activations / gib:.2f} GiB "
                         f"more, against gpu_memory_utilization = {utilization} ({utilization * total / gib:.1f} GiB); "
                         f"raise it, or lower max_num_batched_tokens")
    return budget // bytes_per_block


class ModelRunner:
    def __init__(self, model_dir: Path, spec: ModelSpec, *, num_blocks: int | None, block_size: int, dtype: str,
                 device: str) -> None:
        """`num_blocks` None: the cache is made later, by `allocate_cache` (its size measured first)."""
        self.spec = spec
        self.block_size = block_size
        self.device = device
        self.dtype = DTYPES[dtype]
        self.model = load_model(model_dir, spec, self.dtype, device)
        self.cache = KVCache(spec, num_blocks or 1, block_size, self.dtype, device)
        self._nothing = torch.empty(0, dtype=torch.long, device=device)  # a fresh prompt's unused index, slots, mask
        self._graphs: DecodeGraphs | None = None

    def use_decode_graphs(self, max_seqs: int, max_len: int) -> bool:
        """Pure decode steps of up to `max_seqs` sequences and `max_len` tokens of context go
        through `graphs.DecodeGraph`s: captured now on CUDA, run eagerly (padded alike) on the CPU.
        False (and nothing changes) for a model with sliding-window layers, or with a mixture of
        experts (it picks its experts on the host: `architectures.mixture_of_experts`). Call after
        the cache's last `allocate_cache`."""
        if self.spec.windowed_layers or self.spec.num_experts:
            return False
        graphs = DecodeGraphs(max_seqs, max_len, self.block_size, self.cache.scratch_block, self.device)
        if self.device != "cpu":
            try:
                graphs.capture(self.execute)
            except RuntimeError:  # an op this torch cannot capture: slower, not wrong
                log.warning("could not capture CUDA graphs of decode steps; they run eagerly", exc_info=True)
                return False
        self._graphs = graphs
        return True

    def prepare(self, out: SchedulerOutput, prompt_lengths: Mapping[str, int] | None = None) -> StepInput:
        """The step's tensors. `prompt_lengths`: the prompt length of each sequence whose prompt
        positions' logits are wanted (prompt log-probabilities)."""
        graph = self._graphs.find(out.chunks) if self._graphs is not None and not prompt_lengths else None
        if graph is not None:
            graph.fill(out.chunks)
            return StepInput(None, len(out.chunks), graph=graph)
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_rows: list[int] = []
        prompt_rows: list[int] = []
        spans: list[PromptSpan] = []
        decodes: list[tuple[int, ScheduledChunk]] = []
        groups: list[AttentionGroup] = []
        bs = self.block_size
        for chunk in out.chunks:
            row = len(ids)
            n = len(chunk.token_ids)
            ids.extend(chunk.token_ids)
            table = chunk.block_table
            for pos in range(chunk.start, chunk.start + n):
                positions.append(pos)
                slots.append(table[pos // bs] * bs + pos % bs)
            if chunk.needs_sample:
                logits_rows.append(row + n - 1)
            prompt_length = (prompt_lengths or {}).get(chunk.request_id)
            if prompt_length is not None:  # positions up to the prompt's last but one predict prompt tokens
                end = min(chunk.start + n, prompt_length - 1)
                if end > chunk.start:
                    spans.append(PromptSpan(chunk.request_id, chunk.start, end - chunk.start))
                    prompt_rows.extend(range(row, row + end - chunk.start))
            if n == 1:
                decodes.append((row, chunk))
            else:
                groups.append(self._prefill_group(row, chunk))
        buckets = self._decode_buckets(decodes)
        covers_all = (len(buckets) == 1 and len(decodes) == len(out.chunks)  # rows 0..B-1, one token each, in order
                      and all(row == i for i, (row, _) in enumerate(buckets[0])))
        groups += [self._decode_group(bucket, covers_all) for bucket in buckets]
        forward = ForwardInput(self._tensor(ids), self._tensor(positions), self._tensor(slots), tuple(groups),
                               self._tensor(logits_rows + prompt_rows), self.spec.windowed_layers)
        return StepInput(forward, len(logits_rows), tuple(spans))

    def allocate_cache(self, num_blocks: int) -> None:
        self.cache = KVCache(self.spec, num_blocks, self.block_size, self.dtype, self.device)
        self._graphs = None  # captured over the cache it replaces

    def run(self, step: StepInput) -> torch.Tensor:
        """The step's logits (`StepInput.num_sample_rows` first)."""
        if step.graph is not None:
            return step.graph.run(self.execute)
        assert step.forward is not None
        return self.execute(step.forward)

    def blocks_for_memory(self, utilization: float, num_tokens: int, bytes_per_block: int) -> int:
        """CUDA: how many KV blocks fit `utilization` of the device, measured as vLLM does: the peak
        memory of one forward pass of `num_tokens` prompt tokens, on top of what is in use now."""
        num_tokens = max(1, min(num_tokens, self.spec.max_model_len - 1))
        probe_blocks = -(-num_tokens // self.block_size)
        self.allocate_cache(probe_blocks)  # just big enough for the probe; freed before the budget is read
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        chunk = ScheduledChunk("probe", (0,) * num_tokens, 0, tuple(range(probe_blocks)), True)
        self.run(self.prepare(SchedulerOutput((chunk,), (), 0)))
        torch.cuda.synchronize(self.device)
        activations = torch.cuda.max_memory_allocated(self.device) - before
        self.allocate_cache(1)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        return kv_blocks_for(total, free, utilization, activations, bytes_per_block)

    def execute(self, inp: ForwardInput) -> torch.Tensor:
        """The model's forward pass over this runner's cache."""
        if self.device == "cpu":
            return self.model.forward(inp, self.cache)
        with sdpa_kernel(ATTENTION_BACKENDS):
            return self.model.forward(inp, self.cache)

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _prefill_group(self, row: int, chunk: ScheduledChunk) -> AttentionGroup:
        n, length = len(chunk.token_ids), chunk.start + len(chunk.token_ids)
        if chunk.start == 0 and not self.spec.windowed_layers:  # attends to its own rows alone: no index, slots, mask
            return AttentionGroup(self._nothing, self._nothing, self._nothing, 1, n, fresh_rows=(row, row + n))
        num_blocks = -(-length // self.block_size)
        slots = table_slots(self._tensor(list(chunk.block_table[:num_blocks]))[None, :], self.block_size, length)
        query_pos = torch.arange(chunk.start, length, device=self.device)[:, None]
        key_pos = torch.arange(length, device=self.device)[None, :]
        mask = key_pos <= query_pos
        index = torch.arange(row, row + n, device=self.device)
        return AttentionGroup(index, slots, mask[None, None], 1, n, self._windowed(mask, key_pos, query_pos, 1),
                              fresh_rows=(row, row + n) if chunk.start == 0 else None)

    def _decode_buckets(self, decodes: list[tuple[int, ScheduledChunk]]) -> list[list[tuple[int, ScheduledChunk]]]:
        """Decodes in groups of similar context length (CPU), or all together (CUDA)."""
        if len(decodes) < 2 or self.device != "cpu":
            return [decodes] if decodes else []
        buckets: list[list[tuple[int, ScheduledChunk]]] = []
        needed = 0
        for row, chunk in sorted(decodes, key=lambda d: d[1].start):
            length = chunk.start + 1
            if buckets and length * (len(buckets[-1]) + 1) <= (1 + DECODE_PADDING) * (needed + length):
                buckets[-1].append((row, chunk))
                needed += length
            else:
                buckets.append([(row, chunk)])
                needed = length
        return buckets

    def _decode_group(self, decodes: list[tuple[int, ScheduledChunk]], covers_all: bool = False) -> AttentionGroup:
        lengths = [chunk.start + 1 for _, chunk in decodes]
        max_len = max(lengths)
        max_blocks = -(-max_len // self.block_size)
        tables = [list(c.block_table[:max_blocks]) + [0] * (max_blocks - len(c.block_table[:max_blocks]))
                  for _, c in decodes]
        slots = table_slots(self._tensor([b for t in tables for b in t]).view(len(decodes), max_blocks),
                            self.block_size, max_len)
        key_pos = torch.arange(max_len, device=self.device)[None, :]
        query_pos = self._tensor(lengths)[:, None] - 1
        mask = key_pos <= query_pos
        index = self._tensor([row for row, _ in decodes])
        return AttentionGroup(index, slots, mask[:, None, None, :], len(decodes), 1,
                              self._windowed(mask, key_pos, query_pos, 2), covers_all)

    def _windowed(self, mask: torch.Tensor, key_pos: torch.Tensor, query_pos: torch.Tensor,
                  query_dim: int) -> torch.Tensor | None:
        """`mask` limited to each query's last `sliding_window` positions, shaped as the group's
        mask ([B, 1, Q, L]: the query axis at `query_dim`), if the model has windowed layers."""
        window = self.spec.sliding_window
        if window is None or not self.spec.windowed_layers:
            return None
        windowed = mask & (key_pos > query_pos - window)
        return windowed[None, None] if query_dim == 1 else windowed[:, None, None, :]
