"""The generative engine: continuous batching over a paged KV cache, for decoder-only transformers.

    engine = LLMEngine(model_dir, EngineConfig(device="cpu"))
    engine.add_request("r1", prompt_token_ids, SamplingParams(max_tokens=32, temperature=0))
    while engine.has_unfinished():
        for out in engine.step(): ...          # RequestOutput per request that advanced

Modules: config (EngineConfig), sequence (SamplingParams, Sequence), block_manager and scheduler
(pure policy), model / architectures / model_runner (torch), sampler, tokenizer, engine, tiny.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sluice.engines.generative.config import EngineConfig
    from sluice.engines.generative.engine import EngineStats, LLMEngine, RequestOutput, StepTiming
    from sluice.engines.generative.sequence import FinishReason, SamplingParams

__all__ = ["EngineConfig", "EngineStats", "FinishReason", "LLMEngine", "RequestOutput", "SamplingParams", "StepTiming"]

_MODULE_OF = {"EngineConfig": "config", "FinishReason": "sequence", "SamplingParams": "sequence"}
"""Where each name lives (else `engine`). They are imported on first use, so that a torch-free
module of the package (`tokenizer`, `sequence`) does not bring torch with it: a worker that
serves no generative model imports `tokenizer` and never the engine."""


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_MODULE_OF.get(name, 'engine')}"), name)
