"""Chat tool calling: `tools` with `tool_choice`, answered as OpenAI's `tool_calls`.

    tools + tool_choice ─▶ ToolPlan + a JSON schema (structured output) ─▶ the model writes JSON
    that fits it ─▶ ToolPlan.calls(text) ─▶ message.tool_calls, finish_reason "tool_calls"

- a named function (`{"type": "function", "function": {"name": "f"}}`): the text is `f`'s
  arguments, held to its `parameters` schema;
- `"required"`: the text is a JSON array of `{"name", "arguments"}`, each one of the tools with
  its own parameters (one call only with `parallel_tool_calls: false`);
- `"none"`: the tools are shown to the model (its chat template renders them) and it answers text;
- `"auto"` (OpenAI's default when tools are given): the model decides, and its text is read for
  the calls it wrote in its own family's format, named by its `model.toml`'s `tool_call_parser`
  (`CALL_FORMATS`): the calls found are answered as `tool_calls` (the first only with
  `parallel_tool_calls: false`), the rest as content. For a
  model without one, "auto" is a 400 naming `tool_choice` (vLLM answers the same without its
  parser). The formats (special tokens such as `<|python_tag|>` and `[TOOL_CALLS]` are usually
  left out of the text, so each is read with or without its marker):
    hermes       `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks anywhere in
                 the text (Qwen2.5/Qwen3, Hermes)
    llama3_json  the whole answer is `{"name": ..., "parameters": {...}}` objects separated by
                 `;`, optionally after `<|python_tag|>` (Llama 3.1-3.3's JSON tool calling)
    mistral      `[TOOL_CALLS]` then a JSON array of `{"name", "arguments"}` (or, in newer
                 tokenizers, `name[ARGS]{...}` per call); without the marker, an answer that
                 is such an array
    pythonic     the whole answer is a Python list of calls with literal keyword arguments,
                 `[get_weather(city="Oslo"), get_time()]` (Llama 3.2 and 4's format), read with
                 `ast` (parsed, never run)
    deepseek_v3, deepseek_v31
                 DeepSeek's special tokens: a tool-calls section, and in it per call
                 `function`, separator, name and a ```json fence (V3, R1), or name, separator and
                 the arguments (V3.1 and later); either is read under both names
    kimi_k2      `<|tool_calls_section_begin|>`, per call `<|tool_call_begin|>functions.name:0`
                 `<|tool_call_argument_begin|>{...}<|tool_call_end|>`, `<|tool_calls_section_end|>`
    granite      `<|tool_call|>` then a JSON array of `{"name", "arguments"}` (Granite 3.x)
    internlm     `<|action_start|><|plugin|>{"name", "parameters"}<|action_end|>` (InternLM 2/2.5)
    phi4_mini_json
                 `functools[...]`, a JSON array of calls (Phi-4-mini)
    qwen3_coder  `<tool_call><function=name><parameter=key>value</parameter>...</function></tool_call>`
                 (Qwen3-Coder), and
    glm45        `<tool_call>name<arg_key>key</arg_key><arg_value>value</arg_value>...</tool_call>`
                 (GLM-4.5/4.6): arguments written as text, each typed by the tool's parameters
                 schema (a string stays one; a number, boolean, object or array is read as JSON
                 or a Python literal; what fits neither stays the text)
The four whose markers are special tokens (DeepSeek's, Kimi's, Granite's, InternLM's) are read
from text that keeps them: a request that may call tools in one of them is generated with
`skip_special_tokens` off, as vLLM's parsers ask for it.

Previous turns' `tool_calls` and `tool` messages go to the chat template as Hugging Face templates
take them. Because the calls asked for are a structured output, an `openai-upstream` model serves
them too: it is sent the tools with `tool_choice: "none"` and the calls' schema as its
`response_format`; for "auto" it is asked with "auto", and its calls come back written as Hermes
blocks, the format it reports (`engines.openai_upstream`).
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from sluice import wire
from sluice.errors import InvalidInput

__all__ = ["CALL_FORMATS", "NamedToolChoice", "ToolDef", "ToolPlan", "tool_call", "tool_terms"]

MAX_TOOLS = 128
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


class FunctionDef(msgspec.Struct):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(msgspec.Struct):
    type: str
    function: FunctionDef


class ChosenFunction(msgspec.Struct):
    name: str


class NamedToolChoice(msgspec.Struct):
    type: str
    function: ChosenFunction


Calls = list[dict[str, Any]]
Tools = Mapping[str, Any]
"""The request's tools: each name, with its parameters' JSON schema (for formats that write
arguments as text to be typed by it)."""


def _call(item: Any, names: Tools) -> dict[str, Any] | None:
    """One written call, `{"name", "arguments"}` (or Llama's "parameters"; arguments as an object
    or as a string holding one), naming one of the request's tools; None for anything else."""
    if not isinstance(item, dict) or item.get("name") not in names:
        return None
    arguments = item.get("arguments", item.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):  # RecursionError: nested deeper than json decodes
            return None
    return tool_call(item["name"], json.dumps(arguments)) if isinstance(arguments, dict) else None


def _json_values(text: str, separators: str = "") -> list[Any] | None:
    """The JSON values `text` holds one after another (separated by blanks or `separators`); None
    if it holds anything else."""
    values, at = _leading_values(text, 0, separators)
    return values if at == len(text) else None


def _array_items(text: str) -> list[Any]:
    """The values of the JSON array that `text` is, or of as much of it as was written whole when
    it was cut short (nothing if it is not an array)."""
    at = len(text) - len(text.lstrip())
    return _leading_values(text, at + 1, ",")[0] if text.startswith("[", at) else []


def _leading_values(text: str, at: int, separators: str) -> tuple[list[Any], int]:
    """The JSON values from `at` on, one after another (separated by blanks or `separators`), up
    to what is not one; and where that is (`len(text)`: all of it was)."""
    decoder = json.JSONDecoder()
    values: list[Any] = []
    while True:
        while at < len(text) and (text[at].isspace() or text[at] in separators):
            at += 1
        if at == len(text):
            return values, at
        try:
            value, at = decoder.raw_decode(text, at)
        except (ValueError, RecursionError):
            return values, at
        values.append(value)


def _held_prefix(text: str, marker: str) -> int:
    """How many of `text`'s last characters could be the start of `marker` (held back in a stream)."""
    return next((k for k in range(min(len(marker) - 1, len(text)), 0, -1) if marker.startswith(text[-k:])), 0)


def _around(before: str, after: str) -> str:
    """The content of an answer with calls, from its text before the first call and after it: the
    whitespace next to the calls dropped (the blank line before them, the newline after them), the
    text's own kept. A stream can send the content before the calls as it comes (holding back
    only whitespace) and be the unstreamed answer's exactly."""
    return (before + after).rstrip() if before.strip() else after.strip()


class CallFormat:
    """How one model family writes tool calls in its text."""

    reads_special_tokens = False
    """Its markers are special tokens that the text must keep (`skip_special_tokens` off) to be read."""

    def split(self, text: str, names: Tools) -> tuple[str, Calls]:
        """A whole answer: the text outside the calls, and the calls (naming the request's tools)."""
        raise NotImplementedError

    def begin(self, text: str, at_start: bool) -> tuple[int, bool]:
        """A stream: how much of `text` (what has not been sent yet) is surely content, and whether
        the calls begin right after it. `at_start`: no content has been sent before `text`."""
        raise NotImplementedError


class _Blocks(CallFormat):
    """Calls in blocks that open with a marker and close with another (or at the end of the text:
    `close` ""), anywhere in the text; a block holds one call object (`arrays`: or a JSON array
    of them). A block that is not calls of the request's tools stays text."""

    def __init__(self, open_marker: str, close: str = "", *, arrays: bool = False,
                 reads_special_tokens: bool = False) -> None:
        self.OPEN, self.CLOSE, self.arrays = open_marker, close, arrays
        self.reads_special_tokens = reads_special_tokens

    def split(self, text: str, names: Tools) -> tuple[str, Calls]:
        content, calls, rest = [], [], text
        before = 0  # the parts of content before the first call
        while (start := rest.find(self.OPEN)) >= 0:
            content.append(rest[:start])
            end = rest.find(self.CLOSE, start + len(self.OPEN)) if self.CLOSE else -1
            block_end = len(rest) if end < 0 else end + len(self.CLOSE)
            found = self._calls(rest[start + len(self.OPEN):end if end >= 0 else len(rest)], names)
            if found is None:  # a block that is not a call of one of the tools stays text
                content.append(rest[start:block_end])
            else:
                before = before or len(content)
                calls += found
            rest = rest[block_end:]
        content.append(rest)
        if not calls:
            return "".join(content), calls
        return _around("".join(content[:before]), "".join(content[before:])), calls

    def _calls(self, block: str, names: Tools) -> Calls | None:
        values = _json_values(block)
        if values is None or len(values) != 1:
            return None
        items = values[0] if self.arrays and isinstance(values[0], list) and values[0] else [values[0]]
        calls = [_call(item, names) for item in items]
        return None if None in calls else [call for call in calls if call is not None]

    def begin(self, text: str, at_start: bool) -> tuple[int, bool]:
        start = text.find(self.OPEN)
        return (start, True) if start >= 0 else (len(text) - _held_prefix(text, self.OPEN), False)


class _Sectioned(CallFormat):
    """Calls in a section of special tokens: `section_open`, then per call `call_open` head `sep`
    arguments `call_close`, then `section_close`; content may come before (and after) it. What
    head and arguments mean is the family's (`_call_of`)."""

    reads_special_tokens = True
    SECTION_OPEN = SECTION_CLOSE = CALL_OPEN = CALL_CLOSE = SEP = ""

    def split(self, text: str, names: Tools) -> tuple[str, Calls]:
        start = self._start(text)
        if start < 0:
            return text, []
        end = text.find(self.SECTION_CLOSE, start)
        section = text[start:end if end >= 0 else len(text)]
        calls = []
        for block in section.split(self.CALL_OPEN)[1:]:
            head, sep, arguments = block.split(self.CALL_CLOSE)[0].partition(self.SEP)
            call = self._call_of(head, arguments, names) if sep else None
            if call is None:  # not calls of the tools: all of it is text
                return text, []
            calls.append(call)
        after = text[end + len(self.SECTION_CLOSE):] if end >= 0 else ""
        return (_around(text[:start], after), calls) if calls else (text, [])

    def _call_of(self, head: str, arguments: str, names: Tools) -> dict[str, Any] | None:
        raise NotImplementedError

    def _start(self, text: str) -> int:
        """Where the calls start: the section's marker, or the first call's when the section's is missing."""
        starts = [at for at in (text.find(self.SECTION_OPEN), text.find(self.CALL_OPEN)) if at >= 0]
        return min(starts, default=-1)

    def begin(self, text: str, at_start: bool) -> tuple[int, bool]:
        start = self._start(text)
        if start >= 0:
            return start, True
        return len(text) - max(_held_prefix(text, self.SECTION_OPEN), _held_prefix(text, self.CALL_OPEN)), False


def _arguments(text: str) -> Any:
    """Arguments written as JSON, perhaps in a Markdown code fence; None if they are not one value."""
    text = text.strip()
    if text.startswith("```"):
        text = text.removeprefix("```").removeprefix("json").removesuffix("```")
    values = _json_values(text)
    return values[0] if values is not None and len(values) == 1 else None


def _deepseek_marker(words: str) -> str:
    """DeepSeek's special tokens: words joined by U+2581 between U+FF5C bars, `<\uff5ctool\u2581sep\uff5c>`."""
    return "<\uff5c" + words.replace(" ", "\u2581") + "\uff5c>"


class _DeepSeek(_Sectioned):
    """DeepSeek V3 and R1: `function`, the separator, the name, then the arguments in a ```json
    fence; V3.1 and later: the name, the separator, the arguments. Both are read either way."""

    SECTION_OPEN, SECTION_CLOSE = _deepseek_marker("tool calls begin"), _deepseek_marker("tool calls end")
    CALL_OPEN, CALL_CLOSE = _deepseek_marker("tool call begin"), _deepseek_marker("tool call end")
    SEP = _deepseek_marker("tool sep")

    def _call_of(self, head: str, arguments: str, names: Tools) -> dict[str, Any] | None:
        name, newline, rest = arguments.partition("\n")
        if head.strip() == "function" and newline and name.strip() in names:  # V3's type, then the name
            return _call({"name": name.strip(), "arguments": _arguments(rest)}, names)
        return _call({"name": head.strip(), "arguments": _arguments(arguments)}, names)


class _KimiK2(_Sectioned):
    """Kimi K2: `functions.name:index<|tool_call_argument_begin|>{...}` per call."""

    SECTION_OPEN, SECTION_CLOSE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
    CALL_OPEN, CALL_CLOSE, SEP = "<|tool_call_begin|>", "<|tool_call_end|>", "<|tool_call_argument_begin|>"

    def _call_of(self, head: str, arguments: str, names: Tools) -> dict[str, Any] | None:
        name = head.strip().removeprefix("functions.").rpartition(":")
        return _call({"name": name[0] or name[2], "arguments": _arguments(arguments)}, names)


class _Llama3Json(CallFormat):
    TAG = "<|python_tag|>"

    def split(self, text: str, names: Tools) -> tuple[str, Calls]:
        body = text.strip().removeprefix(self.TAG)
        values = _json_values(body, ";") if body.lstrip().startswith("{") else None
        calls = [_call(value, names) for value in values or []]
        if not calls or None in calls:  # not the whole answer as calls of the tools: it is text
            return text, []
        return "", [call for call in calls if call is not None]

    def begin(self, text: str, at_start: bool) -> tuple[int, bool]:
        head = text.lstrip()
        if not at_start or (head and not self.TAG.startswith(head[:len(self.TAG)]) and head[0] != "{"):
            return len(text), False  # calls come first or not at all
        return 0, head.startswith(("{", self.TAG))


class _Mistral(CallFormat):
    MARK, ARGS = "[TOOL_CALLS]", "[ARGS]"

    def split(self, text: str, names: Tools) -> tuple[str, Calls]:
        start = text.find(self.MARK)
        if start < 0:  # the marker is a special token, usually left out of the text: a bare array
            calls = self._calls(text, names, arrays_only=True)
            return ("", calls) if calls else (text, [])
        calls = self._calls(text[start:].replace(self.MARK, " "), names)
        return (_around(text[:start], ""), calls) if calls else (text, [])

    def _calls(self, body: str, names: Tools, arrays_only: bool = False) -> Calls:
        values = _json_values(body)
        if values is not None and len(values) == 1 and isinstance(values[0], list):  # [{"name", "arguments"}...]
            calls = [_call(value, names) for value in values[0]]
        elif arrays_only:
            return []
        else:  # name[ARGS]{...} name[ARGS]{...}
            calls, at, body = [], 0, body.strip()
            while at < len(body):
                brace = body.find("{", at)
                if brace < 0:
                    return []
                try:
                    arguments, end = json.JSONDecoder().raw_decode(body, brace)
                except (ValueError, RecursionError):
                    return []
                calls.append(_call({"name": body[at:brace].replace(self.ARGS, "").strip(), "arguments": arguments},
                                   names))
                at = len(body) - len(body[end:].lstrip())
        return [] if not calls or None in calls else [call for call in calls if call is not None]

    def begin(self, text: str, at_start: bool) -> tuple[int, bool]:
        start = text.find(self.MARK)
        if start >= 0:
            return start, True
        head = text.lstrip()
        if at_start and not head:
            return 0, False
        if at_start and head.startswith("["):  # an array of calls without the marker, perhaps
            return 0, not self.MARK.startswith(head[:len(self.MARK)])
        return len(text) - _held_prefix(text, self.MARK), False


class _Pythonic(CallFormat):
    def split(self, text: str, names: Tools) -> tuple[str, Calls]:
        head = text.strip()
        if not head.startswith("["):
            return text, []
        try:
            tree = ast.parse(head, mode="eval").body
            if not isinstance(tree, ast.List) or not tree.elts:
                return text, []
            calls = [self._node_call(node, names) for node in tree.elts]
        except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
            return text, []
        return ("", [c for c in calls if c is not None]) if None not in calls else (text, [])

    @staticmethod
    def _node_call(node: ast.expr, names: Tools) -> dict[str, Any] | None:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        if any(keyword.arg is None for keyword in node.keywords):  # **kwargs
            return None
        arguments = {keyword.arg: ast.literal_eval(keyword.value) for keyword in node.keywords}
        return _call({"name": node.func.id, "arguments": arguments}, names)

    def begin(self, text: str, at_start: bool) -> tuple[int, bool]:
        head = text.lstrip()
        if not at_start or (head and head[0] != "["):
            return len(text), False  # calls come first or not at all
        return 0, bool(head)


class _XmlArguments(_Blocks):
    """Calls in `<tool_call>` blocks whose arguments are written one by one as text, each typed by
    the tool's parameters schema (a string stays a string; a number, boolean, object or array is
    read as JSON, else as a Python literal; what fits neither stays the text)."""

    def __init__(self, call: re.Pattern[str], argument: re.Pattern[str]) -> None:
        super().__init__("<tool_call>", "</tool_call>")
        self.call, self.argument = call, argument

    def _calls(self, block: str, names: Tools) -> Calls | None:
        calls = []
        for match in self.call.finditer(block):
            name = match["name"].strip()
            if name not in names:
                return None
            properties = (names[name] or {}).get("properties") or {}
            arguments = {found["key"].strip(): _typed(found["value"], properties.get(found["key"].strip()))
                         for found in self.argument.finditer(match["body"])}
            calls.append(tool_call(name, json.dumps(arguments)))
        return calls or None


def _typed(text: str, schema: Any) -> Any:
    """An argument written as text, as its schema types it."""
    value = text.removeprefix("\n").removesuffix("\n")
    kinds = schema.get("type") if isinstance(schema, dict) else None
    kinds = set(kinds) if isinstance(kinds, list) else {kinds}
    if "string" in kinds or not kinds - {None}:
        return value
    try:
        return json.loads(value)
    except (ValueError, RecursionError):
        pass
    try:
        return ast.literal_eval(value.strip())
    except (ValueError, SyntaxError, TypeError, RecursionError, MemoryError):
        return value


CALL_FORMATS: dict[str, CallFormat] = {
    "hermes": _Blocks("<tool_call>", "</tool_call>"),
    "llama3_json": _Llama3Json(),
    "mistral": _Mistral(),
    "pythonic": _Pythonic(),
    "deepseek_v3": _DeepSeek(),
    "deepseek_v31": _DeepSeek(),
    "kimi_k2": _KimiK2(),
    "granite": _Blocks("<|tool_call|>", arrays=True, reads_special_tokens=True),
    "internlm": _Blocks("<|action_start|><|plugin|>", "<|action_end|>", reads_special_tokens=True),
    "phi4_mini_json": _Blocks("functools", arrays=True),
    "qwen3_coder": _XmlArguments(
        re.compile(r"<function=(?P<name>[^>\n]+)>(?P<body>.*?)(?:</function>|$)", re.DOTALL),
        re.compile(r"<parameter=(?P<key>[^>\n]+)>(?P<value>.*?)(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)),
    "glm45": _XmlArguments(
        re.compile(r"\A\s*(?P<name>[^<\n]+)(?P<body>.*)", re.DOTALL),
        re.compile(r"<arg_key>(?P<key>.*?)</arg_key>\s*<arg_value>(?P<value>.*?)</arg_value>", re.DOTALL)),
}
"""The values of a model's `tool_call_parser` (the engine's runner checks the name at load)."""


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """How a request's answer becomes tool calls: `named` (the text is that function's arguments),
    `parser` (`auto`: calls written in the text in that format, among `names`), or neither
    (`required`: the text is an array of calls)."""

    named: str | None
    parser: str = ""
    names: Tools = field(default_factory=dict)
    is_parallel: bool = True
    """`auto`: every call written is answered; False (`parallel_tool_calls: false`): the first only."""

    def split(self, text: str) -> tuple[str, Calls]:
        """`auto`: the text outside the calls, and the calls."""
        content, calls = CALL_FORMATS[self.parser].split(text, self.names)
        return content, calls if self.is_parallel else calls[:1]

    def begin(self, text: str, at_start: bool) -> tuple[int, bool]:
        """`auto`, streamed: see `CallFormat.begin`."""
        return CALL_FORMATS[self.parser].begin(text, at_start)

    @property
    def reads_special_tokens(self) -> bool:
        return bool(self.parser) and CALL_FORMATS[self.parser].reads_special_tokens

    def calls(self, text: str) -> Calls | None:
        """The answer's `tool_calls`: the named function's, its arguments as written (whole, or cut
        by `max_tokens`), or `required`'s array of calls; of an array cut short, the calls written
        whole before the cut (None if there are none)."""
        if self.named is not None:
            return [tool_call(self.named, text)]
        calls = [tool_call(item["name"], json.dumps(item["arguments"])) for item in _array_items(text)
                 if isinstance(item, dict) and isinstance(item.get("name"), str) and "arguments" in item]
        return calls or None


def tool_call(name: str, arguments: str) -> dict[str, Any]:
    """One entry of OpenAI's `tool_calls`, with a fresh id."""
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name,
                                                                                    "arguments": arguments}}


def tool_terms(tools: list[ToolDef] | None, tool_choice: str | NamedToolChoice | None, parallel: bool | None,
               output_format: wire.OutputFormat | None, parser: str = "") -> tuple[
        list[wire.ToolSpec], wire.OutputFormat | None, ToolPlan | None]:
    """The tools for the chat template, the structured output that makes the answer tool calls
    (else `output_format` as asked), and how to read them back; 400s for what cannot be served."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise InvalidInput("'tool_choice' needs 'tools'", param="tool_choice")
        return [], output_format, None
    specs = _specs(tools)
    schemas = {tool.function.name: tool.function.parameters or {"type": "object"} for tool in tools}
    if tool_choice == "none":
        return specs, output_format, None
    if tool_choice is None or tool_choice == "auto":
        if parser:
            return specs, output_format, ToolPlan(None, parser, schemas, is_parallel=parallel is not False)
        raise InvalidInput("tool_choice 'auto' needs to know how this model writes tool calls in its text (its "
                           "model.toml's tool_call_parser), and it names none: ask for 'required' or a named "
                           "function, or 'none'", param="tool_choice")
    if output_format is not None:
        raise InvalidInput(f"'{output_format.param}' cannot be combined with tool calls", param=output_format.param)
    if isinstance(tool_choice, NamedToolChoice):
        name = tool_choice.function.name
        if tool_choice.type != "function" or name not in schemas:
            raise InvalidInput(f"'tool_choice' names no tool given in 'tools': {name[:64]!r}", param="tool_choice")
        return specs, _json_format(schemas[name]), ToolPlan(name)
    if tool_choice != "required":
        raise InvalidInput("'tool_choice' must be 'none', 'auto', 'required' or a named function",
                           param="tool_choice")
    call = {"anyOf": [{"type": "object", "properties": {"name": {"const": name}, "arguments": schema},
                       "required": ["name", "arguments"], "additionalProperties": False}
                      for name, schema in schemas.items()]}
    calls = {"type": "array", "items": call, "minItems": 1, **({"maxItems": 1} if parallel is False else {})}
    return specs, _json_format(calls), ToolPlan(None)


def _specs(tools: list[ToolDef]) -> list[wire.ToolSpec]:
    if len(tools) > MAX_TOOLS:
        raise InvalidInput(f"'tools' holds {len(tools)} tools; one request may give {MAX_TOOLS}", param="tools")
    names = set()
    for tool in tools:
        name = tool.function.name
        if tool.type != "function":
            raise InvalidInput(f"tool type {tool.type[:32]!r} is not supported (only 'function')", param="tools")
        if not _NAME.fullmatch(name) or name in names:
            raise InvalidInput(f"tool names must be unique, 1-64 letters, digits, '_', '.' or '-': {name[:64]!r}",
                               param="tools")
        names.add(name)
    specs = [wire.ToolSpec(t.function.name, t.function.description or "",
                           "" if t.function.parameters is None else msgspec.json.encode(t.function.parameters).decode())
             for t in tools]
    if sum(len(s.parameters) + len(s.description) for s in specs) > 256 * 1024:
        raise InvalidInput("'tools' are longer than the 256 KiB one request may send", param="tools")
    return specs


def _json_format(schema: dict[str, Any]) -> wire.OutputFormat:
    return wire.OutputFormat("json_schema", msgspec.json.encode(schema).decode(), "tools")
