"""The generative model as a worker hosts it: the engine, its settings from `model.toml`, and the
translation from a wire `GeneratePayload` to prompt token ids and sampling parameters.

`model.toml` `[params]` (all optional):

    block_size = 16                 # tokens per KV block (and prefix-cache granularity)
    kv_cache_mb = 256               # KV cache memory; the number of blocks follows from it
    gpu_memory_utilization = 0.9    # CUDA, instead: the device share for weights + activations + KV (vLLM's)
    max_num_seqs = 64               # sequences running at once
    max_num_batched_tokens = 2048   # tokens one step may compute (decodes + prefill chunks)
    long_prefill_token_threshold = 512
    dtype = "float32"               # or bfloat16 (CUDA, or a CPU with bf16 instructions) / float16 (CUDA)
    max_model_len = 1024            # cap on prompt + output tokens (default: the model's context)
    num_threads = 2                 # torch intra-op threads on CPU (default: torch's choice)
    scheduling = "continuous"       # "static": request-level batching, a benchmark baseline only
    tool_call_parser = "hermes"     # tool_choice "auto": how it writes calls (TOOL_CALL_PARSERS: hermes, mistral, ...)
    reasoning_parser = "qwen3"      # how it writes its thoughts, answered apart (REASONING_PARSERS: deepseek_r1, qwen3)
    static_reserve = "max_model_len"  # static: KV reserved per sequence ("max_model_len" | "max_tokens")
    cuda_graphs = true              # CUDA: decode steps replay graphs captured at load (false: eager)

`prepare` refuses what cannot be served with an `InvalidInput` naming the field, as vLLM does: a
prompt or stop token id outside the vocabulary, a prompt that leaves no room in the context, a
`max_tokens` the context cannot hold (a default max_tokens is capped instead). A prompt longer than
`MAX_CHARS_PER_TOKEN` characters per token of context is refused before it is tokenized (no
tokenizer averages more), so a huge prompt costs no tokenization. `prepare` is thread-safe: the
worker prepares long prompts off its event loop.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import msgspec
import torch
from llguidance import LLMatcher

from sluice import wire
from sluice.engines.base import num_threads_of
from sluice.engines.generative.config import EngineConfig
from sluice.engines.generative.engine import LLMEngine, context_length_message
from sluice.engines.generative.sequence import SamplingParams
from sluice.engines.generative.tokenizer import prompt_chars
from sluice.errors import ConfigError, InvalidInput
from sluice.reasoning import PARSERS, request_parser
from sluice.repository import ModelVersion

__all__ = ["MAX_CHARS_PER_TOKEN", "GenerativeRunner", "PreparedGeneration"]

TOOL_CALL_PARSERS = ("", "hermes", "llama3_json", "mistral", "pythonic", "deepseek_v3", "deepseek_v31", "kimi_k2",
                     "granite", "internlm", "phi4_mini_json", "qwen3_coder", "glm45")
"""How a model writes the tool calls it decides on in its text (`api.tool_calls`); "": none known."""

REASONING_PARSERS = ("", *PARSERS)
"""How a model writes its thoughts before its answer (`sluice.reasoning`); "": it writes none apart."""

MAX_CHARS_PER_TOKEN = 32
"""A prompt longer than this many characters per token of context cannot fit it: refused untokenized."""

_ENGINE_PARAMS = ("block_size", "max_num_seqs", "max_num_batched_tokens", "long_prefill_token_threshold", "dtype",
                  "max_model_len", "scheduling", "static_reserve", "gpu_memory_utilization", "cuda_graphs")


@dataclass(frozen=True, slots=True)
class PreparedGeneration:
    prompt_token_ids: list[int]
    params: SamplingParams
    is_prompt_only: bool = False
    """`max_tokens` 0 with `echo`: the prompt is scored and the one token generated is not reported."""
    matcher: LLMatcher | None = None
    """The structured output's compiled grammar, in its start state (each choice takes a copy)."""


class GenerativeRunner:
    def __init__(self, version: ModelVersion, device: str) -> None:
        params: dict[str, Any] = dict(version.params)
        settings = {name: params[name] for name in _ENGINE_PARAMS if name in params}
        if "kv_cache_mb" in params:
            if "gpu_memory_utilization" in params:
                raise ConfigError(f"{version.name} v{version.version}: [params]: kv_cache_mb and "
                                  f"gpu_memory_utilization both size the KV cache: set one")
            settings["kv_cache_bytes"] = int(float(params["kv_cache_mb"]) * 1024 * 1024)
        try:
            config = EngineConfig(device=device, **settings)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{version.name} v{version.version}: [params]: {exc}") from exc
        parser = params.get("tool_call_parser", "")
        if parser not in TOOL_CALL_PARSERS:
            raise ConfigError(f"{version.name} v{version.version}: [params]: tool_call_parser must be one of "
                              f"{', '.join(repr(p) for p in TOOL_CALL_PARSERS if p)}, got {parser!r}")
        reasoning_parser = params.get("reasoning_parser", "")
        if reasoning_parser not in REASONING_PARSERS:
            raise ConfigError(f"{version.name} v{version.version}: [params]: reasoning_parser must be one of "
                              f"{', '.join(repr(p) for p in REASONING_PARSERS if p)}, got {reasoning_parser!r}")
        _apply_num_threads(version, device)
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
            max_model_len=self.engine.max_model_len, vocab_size=self.engine.vocab_size,
            max_prompt_chars=MAX_CHARS_PER_TOKEN * self.engine.max_model_len,
            cache_revision=version.cache_revision, tool_call_parser=parser, reasoning_parser=reasoning_parser,
            takes_reasoning_effort="reasoning_effort" in self.tokenizer.template_variables(),
        )

    def prepare(self, payload: wire.GeneratePayload) -> PreparedGeneration:
        """Prompt token ids and sampling parameters; `InvalidInput` (400) for what cannot be served.
        Thread-safe."""
        param = "messages" if payload.messages is not None else "prompt"
        max_model_len = self.engine.max_model_len
        self._refuse_past_context(prompt_chars(payload), param)
        ids = self._prompt_ids(payload)
        if payload.truncate_prompt_tokens:
            ids = ids[-payload.truncate_prompt_tokens:]
        vocab_size = self.engine.vocab_size
        if payload.prompt_token_ids is not None and any(not 0 <= t < vocab_size for t in ids):
            raise InvalidInput(f"prompt token ids must be in [0, {vocab_size})", param="prompt")
        if any(not 0 <= t < vocab_size for t in payload.stop_token_ids):
            raise InvalidInput(f"stop_token_ids must be in [0, {vocab_size})", param="stop_token_ids")
        if any(not 0 <= t < vocab_size for t in payload.logit_bias):
            raise InvalidInput(f"logit_bias token ids must be in [0, {vocab_size})", param="logit_bias")
        max_tokens, min_tokens = payload.max_tokens, payload.min_tokens
        is_prompt_only = payload.echo and max_tokens == 0
        if is_prompt_only:
            max_tokens = 1  # the prompt's last position samples anyway; its token is not reported
        if len(ids) >= max_model_len:
            raise InvalidInput(f"the prompt has {len(ids)} tokens; this model's maximum context length is "
                               f"{max_model_len} tokens", param=param)
        if len(ids) + max_tokens > max_model_len:
            if not payload.is_max_tokens_default:
                raise InvalidInput(context_length_message(max_model_len, len(ids), max_tokens), param="max_tokens")
            max_tokens = max_model_len - len(ids)
            min_tokens = min(min_tokens, max_tokens)
        try:
            params = SamplingParams(
                max_tokens=max_tokens, min_tokens=min_tokens,
                temperature=payload.temperature, top_p=payload.top_p, top_k=payload.top_k, min_p=payload.min_p,
                seed=payload.seed,
                stop=tuple(payload.stop), stop_token_ids=tuple(payload.stop_token_ids), ignore_eos=payload.ignore_eos,
                repetition_penalty=payload.repetition_penalty, presence_penalty=payload.presence_penalty,
                frequency_penalty=payload.frequency_penalty, logit_bias=tuple(sorted(payload.logit_bias.items())),
                logprobs=payload.logprobs, prompt_logprobs=payload.logprobs if payload.echo else None,
                skip_special_tokens=payload.skip_special_tokens,
                include_stop_str_in_output=payload.include_stop_str_in_output,
            )
        except ValueError as exc:
            raise InvalidInput(str(exc)) from exc
        return PreparedGeneration(ids, params, is_prompt_only, self._matcher(payload))

    def _matcher(self, payload: wire.GeneratePayload) -> LLMatcher | None:
        """The structured output's grammar compiled for this model (a large one can take a while:
        a request that asks for one is prepared off the event loop)."""
        output_format = payload.output_format
        if output_format is None:
            return None
        if payload.min_tokens:
            raise InvalidInput("min_tokens cannot be combined with a structured output", param="min_tokens")
        if payload.echo and payload.max_tokens == 0:
            raise InvalidInput("a structured output needs tokens to generate (max_tokens > 0)", param="max_tokens")
        assert self.engine.grammars is not None  # a generative runner has a tokenizer
        try:
            return self.engine.grammars.matcher(output_format, request_parser(self.info.reasoning_parser, payload))
        except ValueError as exc:
            raise InvalidInput(str(exc), param=output_format.param) from exc

    def tokenize(self, payload: wire.TokenizePayload) -> wire.TokenizeResult:
        """The tokenizer alone (`/tokenize`, `/detokenize`, `/tokenizer_info`); `InvalidInput` for
        token ids outside the vocabulary or text far longer than the context. Thread-safe."""
        tokenizer = self.tokenizer
        info = wire.TokenizerInfo(tokenizer.eos_token or None, tokenizer.bos_token or None,
                                  tokenizer.chat_template, self.engine.max_model_len)
        if payload.token_ids is not None:
            if any(not 0 <= t < self.engine.vocab_size for t in payload.token_ids):
                raise InvalidInput(f"token ids must be in [0, {self.engine.vocab_size})", param="tokens")
            return wire.TokenizeResult(payload.token_ids, tokenizer.decode(payload.token_ids), info)
        self._refuse_past_context(prompt_chars(payload), "messages" if payload.messages is not None else "prompt")
        if payload.messages is not None:
            text = self._chat_text(payload.messages, None, payload.template)
        else:
            text = payload.prompt or ""
        return wire.TokenizeResult(tokenizer.encode(text, add_special_tokens=payload.add_special_tokens), text, info)

    def _refuse_past_context(self, num_chars: int, param: str) -> None:
        """`InvalidInput` for text far longer than the context can hold, before it is tokenized."""
        max_model_len = self.engine.max_model_len
        if num_chars > MAX_CHARS_PER_TOKEN * max_model_len:
            raise InvalidInput(f"the prompt has {num_chars} characters, far more than this model's context of "
                               f"{max_model_len} tokens can hold", param=param)

    def _chat_text(self, messages: list[wire.ChatMessage], tools: list[wire.ToolSpec] | None = None,
                   options: wire.ChatTemplateOptions | None = None) -> str:
        """The messages (and tools) as the model's chat template writes them, in the shapes Hugging
        Face templates take: tools as `{"type": "function", "function": {...}}`, an assistant's
        earlier calls as `tool_calls` with their arguments parsed, a tool's answer with its id, a
        message's `name` and an assistant's earlier reasoning where given (as vLLM passes them)."""
        options = options or wire.ChatTemplateOptions()
        try:
            return self.tokenizer.apply_chat_template([_template_message(m) for m in messages],
                                                      options.add_generation_prompt,
                                                      [_template_tool(t) for t in tools] if tools else None,
                                                      options.continue_final_message, **options.kwargs)
        except Exception as exc:  # a template error is the messages' shape, not ours
            raise InvalidInput(f"the chat template could not render these messages: {exc}", param="messages") from exc

    def _prompt_ids(self, payload: wire.GeneratePayload) -> list[int]:
        if payload.prompt_token_ids is not None:
            return list(payload.prompt_token_ids)
        if payload.messages is not None:
            template = payload.template
            if payload.reasoning_effort is not None:  # the template reads it (`ModelInfo.takes_reasoning_effort`)
                template = template or wire.ChatTemplateOptions()
                template = msgspec.structs.replace(template, kwargs={**template.kwargs,
                                                                     "reasoning_effort": payload.reasoning_effort})
            return self.tokenizer.encode(self._chat_text(payload.messages, payload.tools, template),
                                         add_special_tokens=False)
        return self.tokenizer.encode(payload.prompt or "")

    def warmup(self) -> None:
        """One short greedy generation, so the first request does not pay for lazy initialisation."""
        self.engine.add_request("warmup", self.tokenizer.encode("hello") or [0],
                                SamplingParams(max_tokens=2, temperature=0.0))
        while self.engine.has_unfinished():
            self.engine.step()

    def close(self) -> None:
        pass


def _apply_num_threads(version: ModelVersion, device: str) -> None:
    """torch's intra-op threads on CPU; process-wide, so the worker's other CPU models share it."""
    num_threads = num_threads_of(version)
    if num_threads is not None and device.startswith("cpu"):
        torch.set_num_threads(num_threads)


def _template_message(message: wire.ChatMessage) -> dict[str, Any]:
    rendered: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        rendered["tool_calls"] = [{"id": c.id, "type": "function",
                                   "function": {"name": c.name, "arguments": _parsed(c.arguments)}}
                                  for c in message.tool_calls]
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    if message.reasoning is not None:  # under both names, as vLLM gives it: templates read one or the other
        rendered["reasoning"] = rendered["reasoning_content"] = message.reasoning
    if message.name is not None:
        rendered["name"] = message.name
    return rendered


def _template_tool(tool: wire.ToolSpec) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.name, "description": tool.description}
    if tool.parameters:
        function["parameters"] = json.loads(tool.parameters)
    return {"type": "function", "function": function}


def _parsed(arguments: str) -> Any:
    """A call's arguments as the templates expect them (a mapping), or the text if it is not JSON."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments

