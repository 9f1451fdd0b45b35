"""The generative model as a worker hosts it: the engine, its settings from `model.toml`, and the
translation from a wire `GeneratePayload` to prompt token ids and sampling parameters.

`model.toml` `[params]` (all optional):

    block_size = 16                 # tokens per KV block (and prefix-cache granularity)
    kv_cache_mb = 256               # KV cache memory; the number of blocks follows from it
    max_num_seqs = 64               # sequences running at once
    max_num_batched_tokens = 2048   # tokens one step may compute (decodes + prefill chunks)
    long_prefill_token_threshold = 512
    dtype = "float32"               # or bfloat16 / float16 (on CUDA)
    max_model_len = 1024            # cap on prompt + output tokens (default: the model's context)
    num_threads = 2                 # torch intra-op threads on CPU (default: torch's choice)
    scheduling = "continuous"       # "static": request-level batching, a benchmark baseline only
    static_reserve = "max_model_len"  # static: KV reserved per sequence ("max_model_len" | "max_tokens")
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from sluice import wire
from sluice.engines.generative.config import EngineConfig
from sluice.engines.generative.engine import LLMEngine
from sluice.engines.generative.sequence import SamplingParams
from sluice.errors import ConfigError, InvalidInput
from sluice.repository import ModelVersion

__all__ = ["GenerativeRunner", "PreparedGeneration"]

_ENGINE_PARAMS = ("block_size", "max_num_seqs", "max_num_batched_tokens", "long_prefill_token_threshold", "dtype",
                  "max_model_len", "scheduling", "static_reserve")


@dataclass(frozen=True, slots=True)
class PreparedGeneration:
    prompt_token_ids: list[int]
    params: SamplingParams


class GenerativeRunner:
    def __init__(self, version: ModelVersion, device: str) -> None:
        params: dict[str, Any] = dict(version.params)
        settings = {name: params[name] for name in _ENGINE_PARAMS if name in params}
        if "kv_cache_mb" in params:
            settings["kv_cache_bytes"] = int(float(params["kv_cache_mb"]) * 1024 * 1024)
        try:
            config = EngineConfig(device=device, **settings)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{version.name} v{version.version}: [params]: {exc}") from exc
        _apply_num_threads(version, params.get("num_threads"), device)
        try:
            self.engine = LLMEngine(version.weights_dir, config)
        except ValueError as exc:
            raise ConfigError(f"{version.name} v{version.version}: [params]: {exc}") from exc
        if self.engine.tokenizer is None:
            raise ConfigError(f"{version.name} v{version.version}: a generative model needs a tokenizer.json")
        self.tokenizer = self.engine.tokenizer
        text = (wire.TensorSpec("text_input", "BYTES", (-1,)),)
        self.info = wire.ModelInfo(
            name=version.name, version=version.version, kind="generative", platform=version.platform,
            inputs=text, outputs=(wire.TensorSpec("text_output", "BYTES", (-1,)),),
            max_batch_size=config.max_num_seqs, slo_s=version.slo_s, accepts_text=False, accepts_tensor=False,
        )

    def prepare(self, payload: wire.GeneratePayload) -> PreparedGeneration:
        """Prompt token ids and sampling parameters; `InvalidInput` (400) for what cannot be served."""
        if payload.prompt_token_ids is not None:
            ids = list(payload.prompt_token_ids)
        elif payload.messages is not None:
            messages = [{"role": m.role, "content": m.content} for m in payload.messages]
            try:
                text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            except Exception as exc:  # a template error is the messages' shape, not ours
                raise InvalidInput(f"the chat template could not render these messages: {exc}",
                                   param="messages") from exc
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        else:
            ids = self.tokenizer.encode(payload.prompt or "")
        try:
            params = SamplingParams(
                max_tokens=payload.max_tokens, min_tokens=payload.min_tokens, temperature=payload.temperature,
                top_p=payload.top_p, top_k=payload.top_k, seed=payload.seed, stop=tuple(payload.stop),
                stop_token_ids=tuple(payload.stop_token_ids), ignore_eos=payload.ignore_eos,
                repetition_penalty=payload.repetition_penalty,
            )
        except ValueError as exc:
            raise InvalidInput(str(exc)) from exc
        return PreparedGeneration(ids, params)

    def warmup(self) -> None:
        """One short greedy generation, so the first request does not pay for lazy initialisation."""
        self.engine.add_request("warmup", self.tokenizer.encode("hello") or [0],
                                SamplingParams(max_tokens=2, temperature=0.0))
        while self.engine.has_unfinished():
            self.engine.step()

    def close(self) -> None:
        pass


def _apply_num_threads(version: ModelVersion, num_threads: object, device: str) -> None:
    """torch's intra-op threads on CPU; process-wide, so the worker's other CPU models share it."""
    if num_threads is None or not device.startswith("cpu"):
        return
    if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
        raise ConfigError(f"{version.name}: num_threads must be a positive integer, got {num_threads!r}")
    torch.set_num_threads(num_threads)
