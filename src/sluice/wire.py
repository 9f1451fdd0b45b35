"""Typed messages between gateways and workers, encoded with msgspec, framed by `sluice.transport`.

Each gateway holds one connection to each worker (`transport.Channel` to `transport.Listener`).
Everything that crosses the process boundary is one of the `Message` structs below; nothing else
does.

    gateway                                   worker
      Hello ───────────────────────────────────▶  (learns the gateway's identity)
      Submit(request_id, payload, timeout_s) ──▶  queued, or answered Result(REJECTED)
      Cancel(request_ids) ─────────────────────▶  dropped if not started
      TenantWeights(weights) ──────────────────▶  the fair scheduler's shares (on connect, on reload)
      ◀─────────────────────── Started(ids)        the batch holding them went to the device
      ◀─────────────────────── TokenChunk(...)     streamed output of a generation
      ◀─────────────────────── Result(...)         one per request, always
      ◀─────────────────────── WorkerState(...)    queue state, on a timer and on Hello

Deadlines travel as the remaining budget (`timeout_s`) so hosts need not share a clock.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import ml_dtypes
import msgspec
import numpy as np

DATATYPES: dict[str, np.dtype[Any]] = {
    "BOOL": np.dtype(np.bool_), "UINT8": np.dtype(np.uint8), "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32), "UINT64": np.dtype(np.uint64), "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16), "INT32": np.dtype(np.int32), "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16), "FP32": np.dtype(np.float32), "FP64": np.dtype(np.float64),
    "BF16": np.dtype(ml_dtypes.bfloat16),
}
"""KServe's numeric datatypes and their numpy dtypes (tensors travel little-endian); BYTES, the
other datatype, has none: its elements are byte strings (`encode_bytes_elements`). BF16 is
bfloat16, which numpy lacks: `ml_dtypes`' (what tritonclient's `triton_to_np_dtype` gives), each
element the upper 16 bits of an IEEE float32 (sign, 8 exponent bits, 7 fraction bits)."""
FLOAT_DATATYPES = frozenset({"FP16", "FP32", "FP64", "BF16"})
"""The floating-point datatypes (JSON numbers of any kind; the others take integers, BOOL booleans)."""


class TensorPayload(msgspec.Struct, frozen=True, tag="tensor"):
    """A dense tensor whose first dimension indexes the items (rows) of a request."""

    dtype: str  # numpy dtype name, e.g. "float32"
    shape: tuple[int, ...]
    data: bytes


class NamedTensor(msgspec.Struct, frozen=True, array_like=True):
    """One named input or output of a model that takes several (`TensorsPayload`)."""

    name: str
    datatype: str  # KServe datatype name, e.g. "FP32", "INT64", "BYTES"
    shape: tuple[int, ...]  # the items (rows) first
    data: bytes
    """Numbers: the elements' little-endian bytes, row-major; BYTES: each element as a 4-byte
    little-endian length and its bytes (the KServe binary encoding)."""


class TensorsPayload(msgspec.Struct, frozen=True, tag="tensors"):
    """Named tensors that share their first dimension, the items of a request: what the `onnx`
    and `python` runners take and give (`ModelInfo.named_io`)."""

    tensors: list[NamedTensor]


def encode_bytes_elements(values: list[bytes]) -> bytes:
    """BYTES elements as KServe's binary encoding: each a 4-byte little-endian length, then itself."""
    return b"".join(len(value).to_bytes(4, "little") + value for value in values)


def decode_bytes_elements(raw: bytes) -> list[bytes]:
    """The elements of `encode_bytes_elements`' encoding; ValueError if it is cut short."""
    values = []
    offset = 0
    while offset < len(raw):
        if offset + 4 > len(raw):
            raise ValueError("truncated BYTES element length")
        length = int.from_bytes(raw[offset:offset + 4], "little")
        offset += 4
        if offset + length > len(raw):
            raise ValueError("truncated BYTES element")
        values.append(raw[offset:offset + length])
        offset += length
    return values


class TextPayload(msgspec.Struct, frozen=True, tag="text"):
    """One item per string."""

    texts: list[str]


class TokensPayload(msgspec.Struct, frozen=True, tag="tokens"):
    """One item per list of token ids in the model's own vocabulary (OpenAI's token-array
    embeddings `input`), for a model whose `ModelInfo.accepts_token_ids`."""

    token_ids: list[list[int]]


class ChatToolCall(msgspec.Struct, frozen=True):
    """A tool call an earlier assistant turn made, as the chat template renders it."""

    id: str
    name: str
    arguments: str  # JSON text


class ChatMessage(msgspec.Struct, frozen=True):
    role: str
    content: str
    tool_calls: list[ChatToolCall] = []
    tool_call_id: str | None = None
    """A `tool` message: the call it answers."""
    name: str | None = None
    """The participant's name (multi-user chats, a function's result), for a template that renders it."""
    reasoning: str | None = None
    """An assistant's earlier reasoning (`reasoning` or `reasoning_content`), for a template that
    interleaves it with the turns."""

    @property
    def num_chars(self) -> int:
        """Its text's characters (content, name, reasoning), as prompt-length checks count them."""
        return len(self.content) + len(self.name or "") + len(self.reasoning or "")


class ToolSpec(msgspec.Struct, frozen=True):
    """A function the model is told it may call (rendered by the chat template)."""

    name: str
    description: str = ""
    parameters: str = ""  # its JSON schema as text; "": none given


SEED_RANGE = (-(1 << 63), (1 << 63) - 1)
"""The seeds a generation takes: a signed 64-bit integer, as OpenAI's API and vLLM accept."""

MAX_LOGPROBS = 20
"""The most alternatives a generation may ask the log-probabilities of, per token (OpenAI's chat limit)."""

MAX_CHOICES = 16
"""The most completions (`n`) of one prompt a generation may ask for: each is a sequence of its own."""


class TopLogprob(msgspec.Struct, frozen=True, array_like=True):
    token: str
    """The token as text, decoded alone (a token that is part of a character decodes to U+FFFD)."""
    token_id: int
    logprob: float
    token_bytes: bytes | None = None
    """The token's own bytes where its text is not them (part of a character: OpenAI's `bytes`
    joined across tokens give the text); None: its text's UTF-8."""


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    """An output token's log-probability under the model, and its most likely alternatives'."""

    token: str
    token_id: int
    logprob: float
    top: list[TopLogprob] = []
    token_bytes: bytes | None = None
    """As `TopLogprob.token_bytes`."""


class EchoedPrompt(msgspec.Struct, frozen=True):
    """A completion's prompt, echoed before its text (`echo`): as the model read it."""

    text: str
    """The prompt's tokens decoded (the API prefers the client's own text when it sent text)."""
    first_token: str
    logprobs: list[TokenLogprob] | None = None
    """Every prompt token's but the first's, if log-probabilities were asked for."""
    first_token_bytes: bytes | None = None
    """As `TopLogprob.token_bytes`, for `first_token`."""


class OutputFormat(msgspec.Struct, frozen=True):
    """Structured output: what the generated text must be (`engines.generative.structured`)."""

    kind: str
    """"json_object", "json_schema" (`spec`: the schema as JSON text), "regex" (`spec`: the
    expression), "choice" (`spec`: a JSON list of strings) or "grammar" (`spec`: Lark or GBNF)."""
    spec: str = ""
    param: str = "response_format"
    """The request field it came from, named in errors."""

    @property
    def is_json(self) -> bool:
        """A JSON answer, which a reasoning model may think before (`sluice.reasoning`); the other
        kinds hold the whole output, as the client wrote them."""
        return self.kind in ("json_schema", "json_object")


class GeneratePayload(msgspec.Struct, frozen=True, tag="generate"):
    """A generation request: a prompt (text or token ids) or chat messages the worker renders with
    the model's chat template, and how to sample. Streamed back as `TokenChunk`s, then a `Result`
    whose payload is a `GenerationResult`."""

    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    min_p: float = 0.0
    top_k: int = 0  # 0: off
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int = 0
    """Keep only the prompt's last this many tokens (vLLM's field); 0: all of them."""
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = {}
    logprobs: int | None = None
    """None: no log-probabilities; k: each output token's, with its k most likely alternatives."""
    n: int = 1
    """Completions to generate for the prompt, each its own sequence (choice i is seeded seed + i)."""
    echo: bool = False
    """Send the prompt back before the completion (with its tokens' log-probabilities, if asked);
    with `max_tokens` 0 nothing is generated: the prompt is only scored."""
    stream: bool = False
    is_max_tokens_default: bool = False
    """The client sent no max_tokens: cap it at what the context leaves rather than refusing."""
    output_format: OutputFormat | None = None
    """Constrain the text to a JSON schema, a regular expression, a choice or a grammar."""
    tools: list[ToolSpec] = []
    """Chat: the functions the chat template shows the model (tool calls themselves are asked
    for with `output_format`)."""
    tools_auto: bool = False
    """Chat, `tool_choice: "auto"`: the model decides whether to call `tools`, writing calls in its
    own format in the text (an `openai-upstream` model: the upstream is asked with "auto")."""
    template: ChatTemplateOptions | None = None
    """Chat: how the chat template renders the messages, where the request says (vLLM's fields)."""
    reasoning_effort: str | None = None
    """Chat: OpenAI's `reasoning_effort`, for a model that takes it (`ModelInfo.takes_reasoning_effort`):
    a variable of its chat template, or a field of the upstream's request."""
    return_token_ids: bool = False
    """vLLM's `return_token_ids`: the answer carries the prompt's token ids (a stream's first
    chunk) and each choice's output token ids (each chunk: its own)."""
    cache_salt: str = ""
    """vLLM's `cache_salt`: added to the tenant's salt of the prefix cache, so requests with
    different salts never share cached blocks ("": the tenant's alone)."""


class GeneratedChoice(msgspec.Struct, frozen=True):
    """Another choice of a request for n > 1 completions."""

    text: str  # "" when it was streamed
    finish_reason: str
    logprobs: list[TokenLogprob] | None = None
    token_ids: list[int] | None = None
    """Its output token ids, if asked (`return_token_ids`; unstreamed: a stream's chunks carry them)."""


class GenerationResult(msgspec.Struct, frozen=True, tag="generation"):
    text: str  # the whole completion ("" when it was streamed: the chunks carried it)
    finish_reason: str  # "stop" or "length"
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    logprobs: list[TokenLogprob] | None = None
    """One per output token, if the request asked (unstreamed; a stream's chunks carry them)."""
    prompt: EchoedPrompt | None = None
    """The echoed prompt, if asked (unstreamed; a stream's first chunk carries it)."""
    choices: list[GeneratedChoice] = []
    """Choices 1 .. n-1 when n > 1 (the fields above are choice 0's; `num_output_tokens` counts all)."""
    token_ids: list[int] | None = None
    """Choice 0's output token ids, if asked (`return_token_ids`; unstreamed)."""
    prompt_token_ids: list[int] | None = None
    """The prompt's token ids as the model read them, if asked (`return_token_ids`; unstreamed)."""
    num_reasoning_tokens: int = 0
    """Of `num_output_tokens`, those a reasoning model thought with (`sluice.reasoning`), all choices'."""
    num_cache_write_tokens: int | None = None
    """Prompt tokens written to the prefix cache (usage's `cache_write_tokens`), all choices';
    None where it is not known (an upstream server that did not say)."""


class ChatTemplateOptions(msgspec.Struct, frozen=True):
    """vLLM's chat-template fields: `add_generation_prompt` (start the assistant's turn),
    `continue_final_message` (the prompt ends inside the last, assistant, message, which the model
    continues), `chat_template_kwargs` (more variables for the template, e.g. `enable_thinking`)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    kwargs: dict[str, Any] = {}


class TokenizePayload(msgspec.Struct, frozen=True, tag="tokenize"):
    """The model's tokenizer on text, on chat messages (rendered with its chat template), or back
    from token ids (`token_ids`): answered by the worker at once, on no device."""

    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    token_ids: list[int] | None = None
    add_special_tokens: bool = True
    template: ChatTemplateOptions | None = None
    """Messages: how the chat template renders them (None: its defaults)."""


class TokenizerInfo(msgspec.Struct, frozen=True):
    eos_token: str | None
    bos_token: str | None
    chat_template: str | None
    max_model_len: int


class TokenizeResult(msgspec.Struct, frozen=True, tag="tokenized"):
    token_ids: list[int]
    text: str
    """The token ids decoded (for `token_ids`), or the text that was tokenized."""
    tokenizer: TokenizerInfo


Payload = (TensorPayload | TensorsPayload | TextPayload | TokensPayload | GeneratePayload | GenerationResult
           | TokenizePayload | TokenizeResult)


def num_items(payload: Payload) -> int:
    """How many items (rows, texts; a generation is one) a request asks for."""
    if isinstance(payload, TextPayload):
        return len(payload.texts)
    if isinstance(payload, TokensPayload):
        return len(payload.token_ids)
    if isinstance(payload, TensorPayload):
        return payload.shape[0] if payload.shape else 1
    if isinstance(payload, TensorsPayload):
        return payload.tensors[0].shape[0] if payload.tensors and payload.tensors[0].shape else 1
    return 1


class Outcome(enum.StrEnum):
    OK = "ok"
    """Every item was computed."""
    REJECTED = "rejected"
    """Not admitted: the queued work ahead would make it miss its deadline."""
    EXPIRED = "expired"
    """Admitted, but its deadline passed (or could no longer be met) before it ran."""
    UNREACHABLE = "unreachable"
    """Not admitted: alone on an idle device it would still finish after its deadline, so sending
    it again as it is cannot succeed."""
    FAILED = "failed"
    """At least one item failed in the model; `errors` says which and why."""
    NOT_FOUND = "not_found"
    """The worker does not serve this model version."""
    DRAINING = "draining"
    """Not taken: the worker is draining (its report saying so had not reached the gateway yet);
    the gateway sends the request to another worker."""


class TraceContext(msgspec.Struct, frozen=True):
    """W3C Trace Context (https://www.w3.org/TR/trace-context/) as a call to another server
    carries it: a `traceparent` and the `tracestate` that travels with it ("" none). An
    intermediary must pass the caller's `tracestate` on with the `traceparent` it sends."""

    traceparent: str
    tracestate: str = ""

    def headers(self) -> dict[str, str]:
        """As HTTP headers (or gRPC metadata)."""
        if not self.tracestate:
            return {"traceparent": self.traceparent}
        return {"traceparent": self.traceparent, "tracestate": self.tracestate}


class Hello(msgspec.Struct, tag="hello"):
    gateway_id: str


class Submit(msgspec.Struct, tag="submit"):
    request_id: int
    model: str
    version: str
    payload: Payload
    timeout_s: float
    tenant: str = ""  # who pays for the device time; "" is the single local tenant
    priority: int = 1  # sluice.priority.Priority: 0 interactive, 1 standard, 2 batch
    background: bool = False  # a batch job's item: yields to online work (sluice.scheduler.backlog)
    trace: TraceContext | None = None
    """What a call to another server carries (an `openai-upstream`'s, an `http-single`'s): the
    gateway's request span with tracing on, else the caller's own; None: nothing to send."""


class Cancel(msgspec.Struct, tag="cancel"):
    request_ids: list[int]


class Drain(msgspec.Struct, tag="drain"):
    """Stop admitting; finish what is queued; then exit."""


class Started(msgspec.Struct, tag="started"):
    request_ids: list[int]


class TokenChunk(msgspec.Struct, tag="chunk"):
    """New output of a streamed generation: text since the last chunk and its token ids. The
    first chunk of a request also means it started (it is not re-dispatched after that)."""

    request_id: int
    text: str
    token_ids: list[int]
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    device_s: float = 0.0
    """The sequence's device time so far: what its tenant is charged if the stream is cut short."""
    logprobs: list[TokenLogprob] | None = None
    """One per token of `token_ids`, if the request asked for log-probabilities."""
    prompt: EchoedPrompt | None = None
    """The echoed prompt, on a stream's first chunk, if asked."""
    index: int = 0
    """Which choice the text is of, when n > 1."""
    prompt_token_ids: list[int] | None = None
    """The prompt's token ids as the model read them, on a stream's first chunk, if asked (`return_token_ids`)."""
    is_last: bool = False
    """The generation's last chunk (it ended by stop or length; its result follows): Triton's
    streams mark their last answer final with its text. Never set by a worker that cannot tell
    (an upstream server's stream)."""


class TenantWeights(msgspec.Struct, tag="weights"):
    """The tenants' weights for the worker's fair scheduler; sent on connect and on every reload."""

    weights: dict[str, float]


class ItemError(msgspec.Struct, frozen=True):
    index: int
    message: str
    is_transient: bool = False  # the device failed, not the input: 503, not 422
    upstream_status: int = 0
    """An upstream server refused the request with this 4xx status (0: none): the client sees it."""
    param: str | None = None  # the request field the upstream named, if any


class Result(msgspec.Struct, tag="result"):
    request_id: int
    outcome: Outcome
    payload: Payload | None = None
    errors: list[ItemError] = []
    num_tokens: int = 0
    queue_s: float = 0.0
    exec_s: float = 0.0
    device_s: float = 0.0  # this request's share of its batches' device time, split by cost
    batch_size: int = 0
    retry_after_s: float | None = None
    message: str = ""


class TensorSpec(msgspec.Struct, frozen=True):
    name: str
    datatype: str  # KServe datatype name, e.g. "FP32", "BYTES"
    shape: tuple[int, ...]  # -1 for a variable dimension; batch dimension first


class Routing(msgspec.Struct, frozen=True):
    """A model's declared traffic split (`model.toml` [routing]) for requests that name no version."""

    traffic: dict[str, float]
    """Version -> weight (e.g. percent)."""
    sticky: bool = True
    """A caller keeps its version (by its route key) rather than drawing one per request."""


class ModelInfo(msgspec.Struct, frozen=True):
    """What a gateway needs to know about a model version a worker serves."""

    name: str
    version: str
    kind: str
    platform: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    max_batch_size: int
    slo_s: float
    accepts_text: bool
    accepts_tensor: bool
    max_model_len: int = 0
    """Generative models: prompt + output tokens it can hold; embedding models: the tokens it keeps
    of an input (0: not known). For checks at the API, and a bound on what a request can use."""
    max_batch_cost: int = 0
    """One-shot models: the padded cost (items x longest item's tokens or elements) a batch may hold,
    as the worker's batcher forms them (`BatchingConfig.max_batch_cost`); 0: not known, batches are
    bounded by `max_batch_size` alone. How many batches a request needs (`admission.num_batches`)."""
    vocab_size: int = 0
    """Token ids must be below this (0: not known)."""
    accepts_token_ids: bool = False
    """A one-shot model that also takes inputs as token ids (`TokensPayload`), below `vocab_size`
    and at most `max_model_len` of them."""
    max_prompt_chars: int = 0
    """Generative models: a longer prompt cannot fit the context; refused before it is sent (0: no bound)."""
    cache_revision: str = ""
    """Non-empty: the model's results are deterministic and the gateway may cache them, keyed with
    this digest of its weights and settings (`ModelVersion.revision`); "": never cached."""
    routing: Routing | None = None
    """The model's declared split (the same for each of its versions); None: the newest version."""
    tool_call_parser: str = ""
    """Generative models: how the model writes tool calls in its text ("hermes"), for
    `tool_choice: "auto"`; "": not known, so "auto" is refused."""
    reasoning_parser: str = ""
    """Generative models: how the model writes its thoughts before its answer ("qwen3",
    "deepseek_r1"), answered apart from it (`sluice.reasoning`); "": all of its text is the answer."""
    named_io: bool = False
    """The model takes and gives named tensors (`TensorsPayload`), each input and output in
    `inputs` and `outputs`, rather than one input tensor (or texts) and one output."""
    takes_reasoning_effort: bool = False
    """Generative models: a chat's `reasoning_effort` means something to it (its chat template reads
    the variable, as gpt-oss's does; an upstream server is sent it and decides); else it is refused."""


class RefusedModel(msgspec.Struct, frozen=True):
    """A model version the worker would not load, and why (e.g. a checksum mismatch)."""

    name: str
    version: str
    reason: str


class QueueState(msgspec.Struct, frozen=True):
    model: str
    version: str
    num_queued: int
    work_ahead_s: float
    item_s: float  # predicted device time one more typical item adds, for the gateway's estimates
    newcomer_s: float = 0.0
    """What a newcomer's own batch adds to `WaitState.wait_s` before the newcomer is done (its
    own work, with room for its batch to fill up): the worker's admission counts it, so the
    gateway's must too, or it forwards requests that the worker then refuses."""
    is_provisional: bool = False
    """Its latency profile still rests on warm-up timings more than on real batches
    (`LatencyProfile.is_provisional`): its predictions may be far too slow, so the gateway leaves
    admission to the worker, which lets the first batches correct them."""


class WaitState(msgspec.Struct, frozen=True):
    """Predicted wall seconds before new work of `priority` could start under fair sharing: for
    `tenant`, behind its own queued work; for a tenant with nothing queued when `tenant` is None."""

    priority: int
    wait_s: float
    tenant: str | None = None


class UpstreamLoad(msgspec.Struct, frozen=True):
    """An upstream server's load as this worker sees it: calls running there (at most
    `max_running`), calls waiting here for a slot, and the predicted wait for a slot per class
    (index = priority). `item_s` is what one more call adds to the wait."""

    model: str
    version: str
    num_running: int
    num_waiting: int
    max_running: int
    waits_s: list[float]
    item_s: float


class WorkerState(msgspec.Struct, tag="state"):
    worker_id: str
    incarnation: str  # differs each time the worker process starts
    is_ready: bool
    is_draining: bool
    models: list[ModelInfo]
    refused: list[RefusedModel]
    queues: list[QueueState]
    work_ahead_s: float  # all queued work on the device plus the running batch's remainder
    drain_rate: float  # estimated work retired per second while work waits (0..1)
    waits: list[WaitState] = []  # per class and per (tenant, class) with work queued
    upstreams: list[UpstreamLoad] = []  # models served by an upstream server (not this device)
    seen_request_id: int = 0
    """The highest `Submit.request_id` the worker had received from the gateway this copy is sent
    to when it built the report: what that gateway sent later is not counted in it (0: unknown)."""
    dormant: list[tuple[str, str]] = []
    """(model, version) it loads on demand (`[loading] on_demand`) and has not loaded, or has
    unloaded after they were idle: a `SyncModel` loads them."""
    loading: list[tuple[str, str]] = []
    """(model, version) it is loading now: those it starts with (it listens before it loads
    them), and those a `SyncModel` loads. Not served yet; refused if the load fails."""


class BatchCount(msgspec.Struct, frozen=True):
    """Batches of one size a worker has run for a model version since it started, and their time."""

    model: str
    version: str
    batch_size: int
    count: int
    exec_s: float


class BatchStats(msgspec.Struct, tag="batch_stats"):
    """A worker's cumulative batch counts (`BatchCount`), sent to each gateway every half second
    while it has run any: the executions in Triton's statistics (`gateway.statistics`)."""

    worker_id: str
    incarnation: str
    counts: list[BatchCount]


class SyncModel(msgspec.Struct, tag="sync_model"):
    """Bring a model in line with the worker's repository as it is now (`unload`: take every version
    of it off): versions new to the folder are loaded, versions gone from it are unloaded once they
    have answered what they hold, loaded versions are kept. Answered by `ModelSynced`."""

    sync_id: int
    model: str
    unload: bool = False


class ModelSynced(msgspec.Struct, tag="model_synced"):
    """The outcome of a `SyncModel`, once its loads have finished: the versions the worker serves
    now, and those it could not load (with why). Versions taken off stop taking requests at once
    and are freed once idle."""

    sync_id: int
    model: str
    versions: list[str]
    refused: list[RefusedModel]


Message = (Hello | Submit | Cancel | Drain | Started | TokenChunk | TenantWeights | Result | WorkerState | BatchStats
           | SyncModel | ModelSynced)

Reply = Callable[[bytes, Message], None]
"""How worker code answers a gateway: (the gateway's identity, a message); queued, sent per loop turn."""


class Bundle(msgspec.Struct, tag="bundle"):
    """Several messages in one frame: senders coalesce what one event-loop turn produced, so a
    busy connection pays one socket send per turn rather than one per request."""

    messages: list[Message]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message | Bundle)


def encode(message: Message | Bundle) -> bytes:
    return _encoder.encode(message)


def encode_many(messages: list[Message]) -> bytes:
    return _encoder.encode(messages[0] if len(messages) == 1 else Bundle(messages))


def decode(data: bytes) -> list[Message]:
    """The messages in one frame (a Bundle is unpacked)."""
    decoded = _decoder.decode(data)
    return decoded.messages if isinstance(decoded, Bundle) else [decoded]
