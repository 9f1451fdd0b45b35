"""The generative engine: continuous batching over a paged KV cache, for decoder-only transformers.

    engine = LLMEngine(model_dir, EngineConfig(device="cpu"))
    engine.add_request("r1", prompt_token_ids, SamplingParams(max_tokens=32, temperature=0))
    while engine.has_unfinished():
        for out in engine.step(): ...          # RequestOutput per request that advanced

Modules: config (EngineConfig), sequence (SamplingParams, Sequence), block_manager and scheduler
(pure policy), model / architectures / model_runner (torch), sampler, tokenizer, engine, tiny.
"""

from sluice.engines.generative.config import EngineConfig
from sluice.engines.generative.engine import EngineStats, LLMEngine, RequestOutput, StepTiming
from sluice.engines.generative.sequence import FinishReason, SamplingParams

__all__ = ["EngineConfig", "EngineStats", "FinishReason", "LLMEngine", "RequestOutput", "SamplingParams", "StepTiming"]
