"""What a completions or chat request asks for, checked and turned into `GeneratePayload`s.

OpenAI's request fields as msgspec structs, and their checks: every number bounded (clients and
fuzzers send absurd ones) and a 400 naming the field for what cannot be served. What the model
reports (`ModelInfo.max_model_len`, `vocab_size`, `max_prompt_chars`) is checked here, before
anything is sent to a worker: token ids outside the vocabulary, a `max_tokens` the context cannot
hold, a prompt far too long to be worth tokenizing. The worker checks the rest (the tokenized
prompt's length) with the same messages. `null` for an optional field means "not given".

Every field of OpenAI's and vLLM's requests that sluice knows is served, refused with a 400 naming
it (`_refuse_unsupported`: ignoring it would change the answer without the client knowing), or
accepted where it changes nothing of the answer (`user`, `prediction`, `prompt_cache_key`, ...).
"""

from __future__ import annotations

from typing import Any

import msgspec

from sluice import wire
from sluice.api.common import likely_text_tokens, texts_or_token_ids, token_ids
from sluice.api.tool_calls import ChosenFunction, FunctionDef, NamedToolChoice, ToolDef, ToolPlan, tool_terms
from sluice.errors import InvalidInput
from sluice.gateway.admission import estimate_text_tokens

__all__ = ["ChatMessageIn", "ChatRequest", "CompletionRequest", "cache_salt_of", "chat_echo", "check_metadata",
           "estimate_tokens",
           "messages_of", "to_payloads"]

MAX_TOKENS_LIMIT = 1 << 20
MAX_STOP = 64
"""Stop strings one request may give. OpenAI documents up to 4, but vLLM takes any number and its
clients send more: lm-evaluation-harness's `local-completions` sends a task's `until` list and the
EOS text (HumanEval's five stops and the EOS: six)."""
TOKEN_ID_LIMIT = 1 << 31
"""Token ids are below this whatever the model (its own vocabulary is checked when it is known)."""
DEFAULT_CHAT_MAX_TOKENS = 1024
"""max_tokens of a chat request that sends none: capped at what the context leaves."""
MAX_CHOICES_PER_REQUEST = 128
"""The most prompts x `n` one request may ask for (a batch of prompts is one generation each)."""
MAX_LOGIT_BIAS = 1024
"""Token ids one request may bias (OpenAI documents no limit; the sampler's work grows with it)."""


MAX_METADATA_KEYS = 16
"""OpenAI's bounds on a request's `metadata`: pairs, and each key's and value's characters."""
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512

MAX_FORMAT_CHARS = 64 * 1024
"""The longest structured-output specification (a JSON schema, a regex, a grammar) one request may send."""
MAX_GUIDED_CHOICES = 256

MAX_CACHE_SALT_CHARS = 1024
"""The longest `cache_salt` (vLLM suggests 43 characters: 256 random bits in base64)."""


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
"""OpenAI's values of `reasoning_effort` (Responses: `reasoning.effort`)."""


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # accepted: no `obfuscation` padding is added (it changes no content)
    continuous_usage_stats: bool | None = None  # vLLM's: with include_usage, the counts so far in every chunk


class JsonSchemaFormat(msgspec.Struct):
    name: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(msgspec.Struct):
    """OpenAI's `response_format`: `text`, `json_object`, or `json_schema` with its schema."""

    type: str
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(msgspec.Struct):
    """vLLM's `structured_outputs`: one of these."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _Sampling(msgspec.Struct, kw_only=True):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    min_p: float | None = None
    top_k: int | None = None
    min_tokens: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    truncate_prompt_tokens: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    service_tier: str | None = None
    priority: str | None = None
    logprobs: Any = None
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    cache_salt: str | None = None  # vLLM's: prefix-cache hits only between requests with the same salt
    return_token_ids: bool | None = None  # vLLM's: the prompt's and the output's token ids with the answer
    request_id: str | None = None  # vLLM's: names the response (`api.common.response_id`)
    # vLLM's fields that sluice does not serve: refused unless they ask for what happens anyway
    # (`_refuse_unsupported`), never silently ignored
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    prompt_logprobs: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    logits_processors: list[Any] | None = None
    return_tokens_as_token_ids: bool | None = None
    spaces_between_special_tokens: bool | None = None
    guided_whitespace_pattern: str | None = None
    add_special_tokens: bool | None = None


class CompletionRequest(_Sampling, kw_only=True):
    prompt: str | list[Any]
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None


class ChatContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class ToolCallFunctionIn(msgspec.Struct):
    name: str
    arguments: str


class ToolCallIn(msgspec.Struct):
    id: str
    function: ToolCallFunctionIn
    type: str = "function"


class ChatMessageIn(msgspec.Struct):
    role: str
    content: str | list[ChatContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    function_call: ToolCallFunctionIn | None = None  # legacy: `api.legacy_functions`
    reasoning: str | None = None  # an assistant's earlier reasoning, for a template that renders it (vLLM's)
    reasoning_content: str | None = None  # the same, under its older name


class ChatRequest(_Sampling, kw_only=True):
    messages: list[ChatMessageIn]
    max_completion_tokens: int | None = None
    tools: list[ToolDef] | None = None
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    top_logprobs: int | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    store: bool | None = None  # accepted: nothing is kept here (vLLM keeps nothing either)
    metadata: dict[str, str] | None = None  # checked as OpenAI does, then not used
    echo: bool | None = None  # vLLM's: the answer starts with the last message's content, which it continues
    reasoning_effort: str | None = None  # for a chat template that reads it; else refused, as OpenAI does
    functions: list[FunctionDef] | None = None  # legacy function calling, served as `tools` (`api.legacy_functions`)
    function_call: str | ChosenFunction | None = None
    modalities: list[str] | None = None  # ["text"] only
    audio: dict[str, Any] | None = None  # refused: no audio output
    web_search_options: dict[str, Any] | None = None  # refused: no web search
    verbosity: str | None = None  # "medium" only
    prediction: dict[str, Any] | None = None  # accepted: a hint for speed, the answer is the same without it
    prompt_cache_key: str | None = None  # accepted: prefix caching needs no key here
    prompt_cache_retention: str | None = None  # accepted: likewise
    safety_identifier: str | None = None  # accepted, as `user`: it changes no answer
    chat_template: str | None = None  # vLLM's: a template of the request's own; refused
    documents: list[Any] | None = None  # vLLM's: for a RAG template; refused


def check_metadata(metadata: dict[str, str] | None) -> None:
    """OpenAI's bounds on `metadata` (chat and Responses requests)."""
    metadata = metadata or {}
    if len(metadata) > MAX_METADATA_KEYS or any(len(k) > MAX_METADATA_KEY_CHARS or len(v) > MAX_METADATA_VALUE_CHARS
                                                for k, v in metadata.items()):
        raise InvalidInput(f"'metadata' takes up to {MAX_METADATA_KEYS} pairs, keys of up to "
                           f"{MAX_METADATA_KEY_CHARS} characters and values of up to {MAX_METADATA_VALUE_CHARS}",
                           param="metadata")


def to_payloads(request: CompletionRequest | ChatRequest, info: wire.ModelInfo) -> list[wire.GeneratePayload]:
    """One payload per prompt (a chat has one; a completion may send a batch of them)."""
    _refuse_unsupported(request)
    max_tokens, max_tokens_param, is_max_tokens_default = _max_tokens(request)
    min_tokens = _bounded_int(request.min_tokens or 0, "min_tokens", 0, MAX_TOKENS_LIMIT)
    if min_tokens > max_tokens and not is_max_tokens_default:
        raise InvalidInput(f"'min_tokens' ({min_tokens}) must not exceed '{max_tokens_param}' ({max_tokens})",
                           param="min_tokens")
    if request.stream_options is not None and not request.stream:
        raise InvalidInput("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    token_id_limit = info.vocab_size or TOKEN_ID_LIMIT
    n = _choices(request)
    keep = _truncation(request, info)
    sampling = dict(
        max_tokens=max_tokens,
        min_tokens=min(min_tokens, max_tokens),
        temperature=_bounded(request.temperature, "temperature", 0.0, 2.0, 1.0),
        top_p=_bounded(request.top_p, "top_p", 1e-9, 1.0, 1.0),
        min_p=_bounded(request.min_p, "min_p", 0.0, 1.0, 0.0),
        top_k=_bounded_int(0 if request.top_k in (None, -1) else request.top_k, "top_k", 0, 1 << 20),
        repetition_penalty=_bounded(request.repetition_penalty, "repetition_penalty", 1e-3, 10.0, 1.0),
        presence_penalty=_bounded(request.presence_penalty, "presence_penalty", -2.0, 2.0, 0.0),
        frequency_penalty=_bounded(request.frequency_penalty, "frequency_penalty", -2.0, 2.0, 0.0),
        logit_bias=_logit_bias(request.logit_bias, token_id_limit),
        logprobs=_logprobs(request),
        echo=_echo(request, info),
        truncate_prompt_tokens=keep,
        n=n,
        seed=None if request.seed is None else _bounded_int(request.seed, "seed", *wire.SEED_RANGE),
        stop=_stops(request.stop),
        stop_token_ids=token_ids(request.stop_token_ids or [], "stop_token_ids", token_id_limit),
        ignore_eos=bool(request.ignore_eos),
        skip_special_tokens=request.skip_special_tokens is not False,
        include_stop_str_in_output=bool(request.include_stop_str_in_output),
        stream=bool(request.stream),
        is_max_tokens_default=is_max_tokens_default,
        output_format=output_format_of(request),
        cache_salt=cache_salt_of(request.cache_salt),
        return_token_ids=_return_token_ids(request, info),
    )
    if isinstance(request, ChatRequest):
        messages = messages_of(request.messages)
        tools, sampling["output_format"], plan = chat_tools(request, info)
        if plan is not None and plan.reads_special_tokens:  # the calls' markers are special tokens
            sampling["skip_special_tokens"] = False
        if info.max_model_len and len(messages) > info.max_model_len:  # before any template renders them
            raise InvalidInput(f"'messages' holds {len(messages)} messages; each takes at least one of this model's "
                               f"{info.max_model_len} tokens of context", param="messages")
        _check_prompt_chars(sum(m.num_chars for m in messages) + sum(len(t.parameters) for t in tools),
                            "messages", info)
        _check_context(None, max_tokens, max_tokens_param, is_max_tokens_default, "messages", info)
        if request.echo and plan is not None:
            raise InvalidInput("'echo' cannot be combined with tool calls", param="echo")
        effort = _reasoning_effort(request, info)
        return [wire.GeneratePayload(messages=messages, tools=tools, tools_auto=plan is not None and bool(plan.parser),
                                     template=template_options(request.add_generation_prompt,
                                                               request.continue_final_message,
                                                               request.chat_template_kwargs, messages),
                                     reasoning_effort=effort, **sampling)]  # type: ignore[arg-type]
    prompts = texts_or_token_ids(request.prompt, "prompt", token_id_limit, MAX_CHOICES_PER_REQUEST,
                                 "prompts")
    if len(prompts) * n > MAX_CHOICES_PER_REQUEST:
        raise InvalidInput(f"{len(prompts)} prompts x n = {n} choices is more than the "
                           f"{MAX_CHOICES_PER_REQUEST} one request may ask for", param="prompt")
    payloads = []
    for prompt in prompts:
        if isinstance(prompt, str):
            _check_prompt_chars(len(prompt), "prompt", info)
            _check_context(None, max_tokens, max_tokens_param, is_max_tokens_default, "prompt", info)
            payloads.append(wire.GeneratePayload(prompt=prompt, **sampling))  # type: ignore[arg-type]
        else:
            if keep:
                prompt = prompt[-keep:]
            _check_context(len(prompt), max_tokens, max_tokens_param, is_max_tokens_default, "prompt", info)
            payloads.append(wire.GeneratePayload(prompt_token_ids=prompt, **sampling))  # type: ignore[arg-type]
    return payloads


def cache_salt_of(salt: str | None) -> str:
    """vLLM's `cache_salt`, checked as vLLM does (a non-empty string), and bounded; "" when not given."""
    if salt is None:
        return ""
    if not salt or len(salt) > MAX_CACHE_SALT_CHARS:
        raise InvalidInput(f"'cache_salt' must be a non-empty string of up to {MAX_CACHE_SALT_CHARS} characters",
                           param="cache_salt")
    return salt


def _max_tokens(request: CompletionRequest | ChatRequest) -> tuple[int, str, bool]:
    """max_tokens, the field that gave it, and whether it is the default (the client sent none).
    0 only with `echo`: the prompt is scored, nothing generated."""
    value: int | None
    if isinstance(request, ChatRequest) and request.max_completion_tokens is not None:
        value, param = request.max_completion_tokens, "max_completion_tokens"
    else:
        value, param = request.max_tokens, "max_tokens"
    if value is None:
        return (16 if isinstance(request, CompletionRequest) else DEFAULT_CHAT_MAX_TOKENS), param, True
    is_echo = isinstance(request, CompletionRequest) and bool(request.echo)
    return _bounded_int(value, param, 0 if is_echo else 1, MAX_TOKENS_LIMIT), param, False


def _check_prompt_chars(num_chars: int, param: str, info: wire.ModelInfo) -> None:
    """Refuse a prompt far too long for the context before anyone tokenizes it."""
    if info.max_prompt_chars and num_chars > info.max_prompt_chars:
        raise InvalidInput(f"the prompt has {num_chars} characters, far more than this model's maximum context "
                           f"length of {info.max_model_len} tokens can hold", param=param)


def _check_context(num_prompt_tokens: int | None, max_tokens: int, max_tokens_param: str,
                   is_max_tokens_default: bool, prompt_param: str, info: wire.ModelInfo) -> None:
    """Refuse what cannot fit the model's context, as far as it is known here (a text prompt's
    token count is only known on the worker, which checks it too)."""
    max_model_len = info.max_model_len
    if not max_model_len:
        return
    if num_prompt_tokens is not None and num_prompt_tokens >= max_model_len:
        raise InvalidInput(f"the prompt has {num_prompt_tokens} tokens; this model's maximum context length "
                           f"is {max_model_len} tokens", param=prompt_param)
    if is_max_tokens_default:
        return  # capped at what the context leaves
    if num_prompt_tokens is None:
        if max_tokens >= max_model_len:
            raise InvalidInput(f"This model's maximum context length is {max_model_len} tokens. However, you "
                               f"requested {max_tokens} tokens in the completion, which leaves no room for the "
                               f"{prompt_param}. Please reduce {max_tokens_param}.", param=max_tokens_param)
    elif num_prompt_tokens + max_tokens > max_model_len:
        raise InvalidInput(f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                           f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the {prompt_param}, "
                           f"{max_tokens} in the completion). Please reduce the length of the {prompt_param} or "
                           f"{max_tokens_param}.", param=max_tokens_param)


def _refuse_unsupported(request: CompletionRequest | ChatRequest) -> None:
    """A 400 naming the first field asking for what sluice does not do: a field it ignored would
    change the answer without the client knowing."""
    is_chat = isinstance(request, ChatRequest)
    refused: list[tuple[bool, str, str]] = [
        (bool(request.use_beam_search), "use_beam_search", "beam search is not supported"),
        (request.length_penalty not in (None, 1.0), "length_penalty",
         "'length_penalty' applies to beam search, which is not supported"),
        (request.prompt_logprobs is not None, "prompt_logprobs",
         "'prompt_logprobs' is not supported: /v1/completions with 'echo' and 'logprobs' scores the prompt"),
        (request.allowed_token_ids is not None, "allowed_token_ids",
         "'allowed_token_ids' is not supported: use 'logit_bias' or a structured output"),
        (bool(request.bad_words), "bad_words", "'bad_words' is not supported: use 'logit_bias'"),
        (bool(request.logits_processors), "logits_processors", "custom logits processors are not supported"),
        (bool(request.return_tokens_as_token_ids), "return_tokens_as_token_ids",
         "'return_tokens_as_token_ids' is not supported: tokens are reported as text (and, in chat, bytes)"),
        (request.spaces_between_special_tokens is False, "spaces_between_special_tokens",
         "only 'spaces_between_special_tokens' true is supported"),
        (request.guided_whitespace_pattern is not None, "guided_whitespace_pattern",
         "'guided_whitespace_pattern' is not supported"),
        (request.add_special_tokens not in (None, not is_chat), "add_special_tokens",
         f"only 'add_special_tokens' {str(not is_chat).lower()} is supported on this endpoint"),
    ]
    if isinstance(request, ChatRequest):
        check_metadata(request.metadata)
        modalities = request.modalities
        refused += [
            (modalities is not None and modalities != ["text"], "modalities",
             "only the 'text' modality is supported: this model answers text only"),
            (request.audio is not None, "audio", "audio output is not supported: this model answers text only"),
            (request.web_search_options is not None, "web_search_options", "web search is not supported"),
            (request.verbosity not in (None, "medium"), "verbosity", "only verbosity 'medium' is supported"),
            (request.chat_template is not None, "chat_template",
             "a request's own 'chat_template' is not supported: the model's chat template renders the messages"),
            (request.documents is not None, "documents", "'documents' is not supported"),
        ]
    if isinstance(request, CompletionRequest):
        refused += [(request.best_of not in (None, 1), "best_of", "only best_of = 1 is supported"),
                    (bool(request.suffix), "suffix", "suffix is not supported")]
    for is_refused, param, message in refused:
        if is_refused:
            raise InvalidInput(message, param=param)


def chat_echo(request: ChatRequest) -> str:
    """vLLM's `echo` on a chat: the last message's content, which the answer starts with where it
    continues that message (the last message is the assistant's, or `add_generation_prompt` is
    false); else nothing."""
    if not request.echo or not request.messages:
        return ""
    last = request.messages[-1]
    if last.role != "assistant" and request.add_generation_prompt is not False:
        return ""
    return messages_of([last])[0].content


def _reasoning_effort(request: ChatRequest, info: wire.ModelInfo) -> str | None:
    """`reasoning_effort` as a chat-template variable, for a model whose template reads it (gpt-oss's
    does); for any other it is refused, as OpenAI refuses it for a model that does not reason."""
    effort = request.reasoning_effort
    if effort is None:
        return None
    if effort not in REASONING_EFFORTS:
        raise InvalidInput(f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}, got {effort[:40]!r}",
                           param="reasoning_effort")
    if not info.takes_reasoning_effort:
        raise InvalidInput(f"'reasoning_effort' is not supported with model {info.name!r}: its chat template "
                           f"takes no reasoning effort", param="reasoning_effort")
    return effort


def chat_tools(request: ChatRequest, info: wire.ModelInfo) -> tuple[list[wire.ToolSpec], wire.OutputFormat | None,
                                                                    ToolPlan | None]:
    """A chat's tools for its template, its structured output (the tool calls' schema, if it asks
    for calls), and how its answer becomes `tool_calls` (`api.tool_calls`)."""
    plan = tool_terms(request.tools, request.tool_choice, request.parallel_tool_calls, output_format_of(request),
                      info.tool_call_parser)
    if plan[2] is not None and request.logprobs:
        raise InvalidInput("log-probabilities are not reported for tool calls", param="logprobs")
    return plan


def output_format_of(request: CompletionRequest | ChatRequest) -> wire.OutputFormat | None:
    """The structured output asked for: OpenAI's `response_format` (`json_object`, `json_schema`),
    or vLLM's `structured_outputs` or `guided_json` / `guided_regex` / `guided_choice` /
    `guided_grammar`; at most one of them. Whether the schema, expression or grammar can be
    compiled is checked on the worker, against the model's tokenizer."""
    given: list[wire.OutputFormat] = []
    response_format = request.response_format
    if response_format is not None and response_format.type != "text":
        given.append(_response_format(response_format))
    if request.structured_outputs is not None:
        given.append(_structured_outputs(request.structured_outputs))
    guided = (("guided_json", "json_schema", request.guided_json), ("guided_regex", "regex", request.guided_regex),
              ("guided_choice", "choice", request.guided_choice), ("guided_grammar", "grammar", request.guided_grammar))
    given += [_format(kind, value, param) for param, kind, value in guided if value is not None]
    if len(given) > 1:
        raise InvalidInput(f"ask for one structured output at most (got {', '.join(f.param for f in given)})",
                           param=given[1].param)
    return given[0] if given else None


def _response_format(response_format: ResponseFormat) -> wire.OutputFormat:
    if response_format.type == "json_object":
        return wire.OutputFormat("json_object")
    if response_format.type != "json_schema":
        raise InvalidInput(f"'response_format' type must be 'text', 'json_object' or 'json_schema', got "
                           f"{response_format.type[:40]!r}", param="response_format")
    if response_format.json_schema is None or response_format.json_schema.schema is None:
        raise InvalidInput("'response_format' of type 'json_schema' needs 'json_schema': {'name', 'schema'}",
                           param="response_format")
    return _format("json_schema", response_format.json_schema.schema, "response_format")


def _structured_outputs(options: StructuredOutputs) -> wire.OutputFormat:
    given = [(kind, value) for kind, value in (("json_schema", options.json), ("regex", options.regex),
                                               ("choice", options.choice), ("grammar", options.grammar))
             if value is not None]
    if options.json_object:
        given.append(("json_object", ""))
    if len(given) != 1:
        raise InvalidInput("'structured_outputs' takes exactly one of json, regex, choice, grammar, json_object",
                           param="structured_outputs")
    kind, value = given[0]
    return wire.OutputFormat("json_object", param="structured_outputs") if kind == "json_object" \
        else _format(kind, value, "structured_outputs")


def _format(kind: str, value: object, param: str) -> wire.OutputFormat:
    """One structured output, its specification as text (bounded; a JSON schema must be an object)."""
    if kind == "json_schema" and isinstance(value, str):
        try:
            value = msgspec.json.decode(value)
        except msgspec.DecodeError:
            raise InvalidInput(f"'{param}' must be a JSON schema (an object)", param=param) from None
    if kind == "json_schema" and not isinstance(value, dict):
        raise InvalidInput(f"'{param}' must be a JSON schema (an object)", param=param)
    is_choices = isinstance(value, list) and 0 < len(value) <= MAX_GUIDED_CHOICES and all(
        isinstance(c, str) and c for c in value)
    if kind == "choice" and not is_choices:
        raise InvalidInput(f"'{param}' choices must be 1 to {MAX_GUIDED_CHOICES} non-empty strings", param=param)
    if kind in ("regex", "grammar") and not (isinstance(value, str) and value):
        raise InvalidInput(f"'{param}' must be a non-empty string", param=param)
    spec = value if isinstance(value, str) else msgspec.json.encode(value).decode()
    if len(spec) > MAX_FORMAT_CHARS:
        raise InvalidInput(f"'{param}' is longer than the {MAX_FORMAT_CHARS} characters a request may send",
                           param=param)
    return wire.OutputFormat(kind, spec, param)


def _logprobs(request: CompletionRequest | ChatRequest) -> int | None:
    """How many alternatives to report per token (None: no log-probabilities). Completions take
    `logprobs: k`; chat takes `logprobs: true` and `top_logprobs: k`, as OpenAI's API does."""
    value = request.logprobs
    if isinstance(request, ChatRequest):
        if value is not None and not isinstance(value, bool):
            raise InvalidInput("'logprobs' must be a boolean (the number of alternatives is 'top_logprobs')",
                               param="logprobs")
        if request.top_logprobs is not None:
            if not value:
                raise InvalidInput("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
            _bounded_int(request.top_logprobs, "top_logprobs", 0, wire.MAX_LOGPROBS)
        count = (request.top_logprobs or 0) if value else None
    elif value is None:
        count = None
    elif isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInput(f"'logprobs' must be an integer in [0, {wire.MAX_LOGPROBS}]", param="logprobs")
    else:
        count = _bounded_int(value, "logprobs", 0, wire.MAX_LOGPROBS)
    return count


def _choices(request: CompletionRequest | ChatRequest) -> int:
    """How many completions to generate for the prompt (`n`)."""
    return 1 if request.n is None else _bounded_int(request.n, "n", 1, wire.MAX_CHOICES)


def _truncation(request: CompletionRequest | ChatRequest, info: wire.ModelInfo) -> int:
    """vLLM's `truncate_prompt_tokens`: keep only the prompt's last k tokens (-1: the model's
    context); 0 when not asked."""
    k = request.truncate_prompt_tokens
    if k is None:
        return 0
    if k == -1 and info.max_model_len:
        return info.max_model_len
    if isinstance(request, CompletionRequest) and request.echo:
        raise InvalidInput("'truncate_prompt_tokens' cannot be combined with 'echo' (the prompt would not be the one "
                           "sent)", param="truncate_prompt_tokens")
    return _bounded_int(k, "truncate_prompt_tokens", 1, MAX_TOKENS_LIMIT)


def _return_token_ids(request: CompletionRequest | ChatRequest, info: wire.ModelInfo) -> bool:
    """vLLM's `return_token_ids`: the prompt's and the output's token ids with the answer."""
    if not request.return_token_ids:
        return False
    if info.kind == "openai-upstream":
        raise InvalidInput(f"model {info.name!r} is served by an upstream server; sluice does not relay its "
                           f"token ids", param="return_token_ids")
    return True


def _echo(request: CompletionRequest | ChatRequest, info: wire.ModelInfo) -> bool:
    if not isinstance(request, CompletionRequest) or not request.echo:
        return False
    if info.kind == "openai-upstream":
        raise InvalidInput(f"model {info.name!r} is served by an upstream server; sluice does not relay an echoed "
                           f"prompt", param="echo")
    return True


def _logit_bias(bias: dict[str, float] | None, token_id_limit: int) -> dict[int, float]:
    """`{"token id": bias}` with ids in the vocabulary and biases in [-100, 100], as OpenAI's API takes it."""
    if not bias:
        return {}
    if len(bias) > MAX_LOGIT_BIAS:
        raise InvalidInput(f"'logit_bias' may bias at most {MAX_LOGIT_BIAS} tokens", param="logit_bias")
    out = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit() and int(key) < token_id_limit):
            raise InvalidInput(f"'logit_bias' keys must be token ids in [0, {token_id_limit}), got {key!r}",
                               param="logit_bias")
        out[int(key)] = _bounded(value, "logit_bias", -100.0, 100.0, 0.0)
    return out


TEMPLATE_NAMES = ("messages", "tools", "add_generation_prompt", "continue_final_message", "bos_token", "eos_token")
"""Variables sluice itself gives the chat template: `chat_template_kwargs` may not set them."""
MAX_TEMPLATE_KWARGS_BYTES = 64 * 1024


def template_options(add: bool | None, cont: bool | None, kwargs: dict[str, Any] | None,
                     messages: list[wire.ChatMessage]) -> wire.ChatTemplateOptions | None:
    """vLLM's chat-template fields of a chat or tokenize request (`add_generation_prompt`,
    `continue_final_message`, `chat_template_kwargs`), checked; None when none is set."""
    if add is None and cont is None and not kwargs:
        return None
    if cont and add:
        raise InvalidInput("'continue_final_message' continues the last message; it cannot be combined with "
                           "'add_generation_prompt', which starts a new one", param="continue_final_message")
    if cont and messages[-1].role != "assistant":
        raise InvalidInput("'continue_final_message' needs the last message to be the assistant's", param="messages")
    kwargs = kwargs or {}
    if reserved := sorted(set(kwargs) & set(TEMPLATE_NAMES)):
        raise InvalidInput(f"'chat_template_kwargs' may not set {', '.join(reserved)}: sluice sets them",
                           param="chat_template_kwargs")
    if len(msgspec.json.encode(kwargs)) > MAX_TEMPLATE_KWARGS_BYTES:
        raise InvalidInput(f"'chat_template_kwargs' is longer than {MAX_TEMPLATE_KWARGS_BYTES // 1024} KiB",
                           param="chat_template_kwargs")
    return wire.ChatTemplateOptions(add if add is not None else not cont, bool(cont), kwargs)


def messages_of(messages: list[ChatMessageIn]) -> list[wire.ChatMessage]:
    """Chat messages as the worker takes them: text parts joined, `developer` as `system`; every
    field a chat template may read passed on, as vLLM passes them (`name`, `tool_calls`,
    `tool_call_id`, an assistant's `reasoning` / `reasoning_content`)."""
    if not messages:
        raise InvalidInput("'messages' must not be empty", param="messages")
    out = []
    for message in messages:
        if message.role not in ("system", "user", "assistant", "developer", "tool"):
            raise InvalidInput(f"message role {message.role!r} is not supported", param="messages")
        content = message.content
        if isinstance(content, list):
            if any(part.type != "text" or part.text is None for part in content):
                raise InvalidInput("only text content parts are supported", param="messages")
            content = "".join(part.text or "" for part in content)
        if message.tool_calls and message.role != "assistant":
            raise InvalidInput("only assistant messages carry 'tool_calls'", param="messages")
        if message.role == "tool" and not message.tool_call_id:
            raise InvalidInput("a 'tool' message needs the 'tool_call_id' it answers", param="messages")
        calls = [wire.ChatToolCall(c.id, c.function.name, c.function.arguments) for c in message.tool_calls or []]
        reasoning = message.reasoning or message.reasoning_content  # vLLM's order
        out.append(wire.ChatMessage("system" if message.role == "developer" else message.role, content or "",
                                    calls, message.tool_call_id, message.name,
                                    reasoning if message.role == "assistant" else None))
    return out


def _stops(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP or any(not s for s in stops):
        raise InvalidInput(f"'stop' takes up to {MAX_STOP} non-empty strings", param="stop")
    return stops


def _bounded(value: float | None, name: str, low: float, high: float, default: float) -> float:
    if value is None:
        return default
    if not low <= value <= high:
        raise InvalidInput(f"'{name}' must be in [{low:g}, {high:g}], got {value}", param=name)
    return float(value)


def _bounded_int(value: int, name: str, low: int, high: int) -> int:
    if not low <= value <= high:
        raise InvalidInput(f"'{name}' must be in [{low}, {high}], got {value}", param=name)
    return value


MESSAGE_TEMPLATE_TOKENS = 8
"""Tokens a chat template may write around each message (its role's markers), beyond its text's."""
TEMPLATE_TOKENS = 32
"""Tokens a chat template may write once (a default system line, the generation prompt)."""


def estimate_tokens(payload: wire.GeneratePayload, max_model_len: int = 0, *, likely: bool = False) -> float:
    """Reserved against the tenant's tokens-per-minute limit: a bound on the prompt's tokens
    (`estimate_text_tokens`, with room for the chat template's) plus every token the request may
    generate, and no more than its sequences can hold (`max_model_len`, 0: not known); settled
    with the real counts when it ends. `likely`: the prompt's likely tokens instead of a bound
    (`likely_text_tokens`), which judge whether it is too large for the limit at all."""
    count = likely_text_tokens if likely else estimate_text_tokens
    if payload.prompt_token_ids is not None:
        prompt = float(len(payload.prompt_token_ids))
    elif payload.messages is not None:
        texts = [text for m in payload.messages
                 for text in (m.role, m.content, *(f"{c.name} {c.arguments}" for c in m.tool_calls),
                              *(extra for extra in (m.name, m.reasoning) if extra))]
        texts += [f"{t.name} {t.description} {t.parameters}" for t in payload.tools or ()]
        prompt = count(texts) + MESSAGE_TEMPLATE_TOKENS * len(payload.messages) + TEMPLATE_TOKENS
    else:
        prompt = count([payload.prompt or ""])
    if payload.truncate_prompt_tokens:
        prompt = min(prompt, float(payload.truncate_prompt_tokens))
    total = prompt + payload.n * payload.max_tokens
    return min(total, float(payload.n * max_model_len)) if max_model_len > 0 else total
