"""A benchmark baseline, not a feature: request-level ("static") batching on the same engine.

This is how servers batched before iteration-level scheduling (HF `generate()` behind a queue,
FasterTransformer-era servers): a batch is formed only when the previous one has completely
finished, and every sequence reserves contiguous KV memory for its maximum length up front, so the
memory budget, not the sequence cap, bounds the batch:

    continuous   ▕AAAA▏BBBBBBBBB▏CC▏        sequences join and leave every step;
                 ▕DDDDDDD▏EEEE▏FFFFFF▏      blocks are taken as tokens are produced
    static       ▕AAAA······▏CC········▏    a batch waits for its longest member; each member
                 ▕BBBBBBBBBB▏DDDDDDD···▏    holds `reserve` tokens of KV from admission to the end

Selected with `[params] scheduling = "static"` in a model.toml (see `benchmarks/models/`).
`static_reserve` says what "maximum length" is: `"max_model_len"` (the model's context, or the
configured `max_model_len`: what a server that does not trust `max_tokens` must reserve) or
`"max_tokens"` (prompt + max_tokens: the most a request can grow to).

Kept generous to the baseline: a member that finishes leaves the compute batch at once (a padded
`generate()` batch would keep computing it) and streams its tokens as they come; only its KV
reservation and the batch barrier remain. Everything else (chunked prefill, token budget,
sampling) is the continuous engine's. With the whole reservation held from admission, running
sequences never need new blocks, so nothing is ever preempted.
"""

from __future__ import annotations

from sluice.engines.generative.block_manager import BlockManager
from sluice.engines.generative.scheduler import ScheduledChunk, Scheduler, SchedulerConfig
from sluice.engines.generative.sequence import Sequence, SequenceStatus

__all__ = ["StaticScheduler"]


class StaticScheduler(Scheduler):
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, max_model_len: int,
                 reserve_max_model_len: bool) -> None:
        super().__init__(config, block_manager)
        self._max_model_len = max_model_len
        self._reserve_max_model_len = reserve_max_model_len

    def reserve_tokens(self, seq: Sequence) -> int:
        """KV tokens a sequence holds from admission until it finishes."""
        if self._reserve_max_model_len:
            return self._max_model_len
        return min(self._max_model_len, seq.num_prompt_tokens + seq.params.max_tokens)

    def _admit_waiting(self, budget: int, chunks: dict[str, ScheduledChunk],
                       charged: set[str]) -> tuple[int, int, int]:
        if self.running:  # the batch is still running: nobody joins it
            return budget, 0, 0
        num_admitted = 0
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if self.blocks.allocate(seq.request_id, self.reserve_tokens(seq)) is None:
                break
            self.blocks.record_query(seq.num_tokens, 0)
            self.waiting.pop(0)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            num_admitted += 1
            num_new = self._chunk_size(seq, budget)
            if num_new > 0:  # members past the token budget prefill in the next steps
                chunks[seq.request_id] = self._chunk(seq, num_new)
                budget -= num_new
        return budget, num_admitted, 0
