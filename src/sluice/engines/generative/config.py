"""The generative engine's own narrow configuration (STYLE.md rule 7).

The KV cache is sized either by a block count (`num_kv_blocks`, exact; tests use it to force
preemption) or by a memory budget (`kv_cache_bytes`), from which the engine derives the count
once it knows the model's shape: see `num_blocks_for`.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["EngineConfig"]

_DTYPES = ("float32", "float16", "bfloat16", "float64")
_SCHEDULINGS = ("continuous", "static")
_STATIC_RESERVES = ("max_model_len", "max_tokens")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    block_size: int = 16
    """Tokens per KV cache block; also the prefix-cache granularity."""
    num_kv_blocks: int | None = None
    """Exact number of KV blocks; when None, derived from `kv_cache_bytes`."""
    kv_cache_bytes: int = 256 * 1024 * 1024
    gpu_memory_utilization: float | None = None
    """CUDA: the share of the device's memory the model may use in all (weights, activations at
    `max_num_batched_tokens`, KV cache), as vLLM's option of that name; the KV cache takes what is
    left, instead of `kv_cache_bytes`. Measured at load by a forward pass of a full token budget;
    the CUDA graphs (`cuda_graphs`), captured after the cache, take their memory from what is left
    beyond this share (if it is too little they are not used, with a warning)."""
    max_num_seqs: int = 64
    """At most this many sequences are running (hold KV blocks) at once."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step: decodes count 1 each, prefill chunks their length."""
    long_prefill_token_threshold: int = 512
    """A single sequence's prefill chunk never exceeds this in one step."""
    device: str = "cpu"
    dtype: str = "float32"
    max_model_len: int | None = None
    """Cap on prompt + output tokens (default: the model's context length)."""
    scheduling: str = "continuous"
    """"continuous", or "static": request-level batching, a benchmark baseline (see static_scheduler)."""
    static_reserve: str = "max_model_len"
    """Static only: KV each sequence reserves, "max_model_len" or "max_tokens" (prompt + max_tokens)."""
    cuda_graphs: bool = True
    """CUDA: pure decode steps replay CUDA graphs captured at load (`graphs`: one launch instead of
    one per kernel; a 1 B model's decode step at 32 sequences 2.95 ms instead of 8.5 on an H200);
    ignored on the CPU. False: every step launches its kernels from Python."""

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "long_prefill_token_threshold",
                     "kv_cache_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.gpu_memory_utilization is not None:
            if not 0 < self.gpu_memory_utilization <= 1:
                raise ValueError("gpu_memory_utilization must be in (0, 1]")
            if not self.device.startswith("cuda"):
                raise ValueError("gpu_memory_utilization sizes a CUDA device's KV cache; on the CPU set kv_cache_mb")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        if self.scheduling not in _SCHEDULINGS:
            raise ValueError(f"scheduling must be one of {', '.join(_SCHEDULINGS)}; got {self.scheduling!r}")
        if self.static_reserve not in _STATIC_RESERVES:
            raise ValueError(f"static_reserve must be one of {', '.join(_STATIC_RESERVES)}; "
                             f"got {self.static_reserve!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}; got {self.dtype!r}")

    def num_blocks_for(self, bytes_per_block: int) -> int:
        """The number of KV blocks: explicit, or as many as fit the memory budget."""
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        num_blocks = self.kv_cache_bytes // bytes_per_block
        if num_blocks < 1:
            raise ValueError(f"kv_cache_bytes={self.kv_cache_bytes} is below one block ({bytes_per_block} bytes)")
        return num_blocks
