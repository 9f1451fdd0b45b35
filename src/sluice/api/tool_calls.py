"""Chat tool calling: `tools` with `tool_choice`, answered as OpenAI's `tool_calls`.

    tools + tool_choice ─▶ ToolPlan + a JSON schema (structured output) ─▶ the model writes JSON
    that fits it ─▶ ToolPlan.calls(text) ─▶ message.tool_calls, finish_reason "tool_calls"

- a named function (`{"type": "function", "function": {"name": "f"}}`): the text is `f`'s
  arguments, held to its `parameters` schema;
- `"required"`: the text is a JSON array of `{"name", "arguments"}`, each one of the tools with
  its own parameters (one call only with `parallel_tool_calls: false`);
- `"none"`: the tools are shown to the model (its chat template renders them) and it answers text;
- `"auto"` (OpenAI's default when tools are given): the model decides, and its text is read for
  the calls it wrote in its own family's format: a model whose `model.toml` names its
  `tool_call_parser` ("hermes": `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  blocks, as Qwen2.5 and Hermes models write them) answers the blocks as `tool_calls` and the rest
  as content. For a model without one, "auto" is a 400 naming `tool_choice` (vLLM answers the
  same without its parser).

Previous turns' `tool_calls` and `tool` messages go to the chat template as Hugging Face templates
take them. Because the calls asked for are a structured output, an `openai-upstream` model serves
them too: it is sent the tools with `tool_choice: "none"` and the calls' schema as its
`response_format` (`engines.openai_upstream`).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

import msgspec

from sluice import wire
from sluice.errors import InvalidInput

__all__ = ["NamedToolChoice", "ToolDef", "ToolPlan", "tool_call", "tool_terms"]

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


HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """How a request's answer becomes tool calls: `named` (the text is that function's arguments),
    `parser` (`auto`: calls written in the text in that format, among `names`), or neither
    (`required`: the text is an array of calls)."""

    named: str | None
    parser: str = ""
    names: frozenset[str] = frozenset()

    def split(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """`auto`: the text outside the calls, and the calls (Hermes-style blocks naming one of the
        tools, with JSON inside; any other block stays text)."""
        content, calls, rest = [], [], text
        while (start := rest.find(HERMES_OPEN)) >= 0:
            content.append(rest[:start])
            end = rest.find(HERMES_CLOSE, start)
            block_end = len(rest) if end < 0 else end + len(HERMES_CLOSE)
            call = self._hermes_call(rest[start + len(HERMES_OPEN):end if end >= 0 else len(rest)])
            if call is None:
                content.append(rest[start:block_end])
            else:
                calls.append(call)
            rest = rest[block_end:]
        content.append(rest)
        return "".join(content).strip() if calls else "".join(content), calls

    def _hermes_call(self, body: str) -> dict[str, Any] | None:
        try:
            item = json.loads(body)
            name, arguments = item["name"], item.get("arguments", {})
        except (ValueError, TypeError, KeyError, AttributeError):
            return None
        if name not in self.names or not isinstance(arguments, dict):
            return None
        return tool_call(name, json.dumps(arguments))

    def calls(self, text: str) -> list[dict[str, Any]] | None:
        """The answer's `tool_calls`, or None if the text is not whole (cut by `max_tokens`)."""
        if self.named is not None:
            return [tool_call(self.named, text)]
        try:
            return [tool_call(item["name"], json.dumps(item["arguments"])) for item in json.loads(text)]
        except (ValueError, TypeError, KeyError):  # cut short (max_tokens, a stop string): not calls
            return None


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
            return specs, output_format, ToolPlan(None, parser, frozenset(schemas))
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
