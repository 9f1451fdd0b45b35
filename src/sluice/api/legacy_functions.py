"""Legacy function calling: `functions` and `function_call`, which OpenAI's chat API still takes
and older code (and the SDK's old helpers) still sends. Served as the tools they became:

    functions: [{name, description, parameters}]   ─▶ tools: [{"type": "function", "function": ...}]
    function_call: "none" | "auto" | {"name": f}    ─▶ tool_choice: the same (absent: "auto")
    one call at most                                ─▶ parallel_tool_calls: false
    assistant {function_call: {name, arguments}}    ─▶ assistant {tool_calls: [one call]}
    {role: "function", name, content}               ─▶ {role: "tool", tool_call_id: that call's}

and answered in the legacy shape: `message.function_call` `{name, arguments}` (no id) and
`finish_reason: "function_call"`; streamed, `delta.function_call` pieces (`api.completion_shapes`).
"""

from __future__ import annotations

import msgspec

from sluice.api.completion_params import ChatMessageIn, ChatRequest, ToolCallIn
from sluice.api.tool_calls import NamedToolChoice, ToolDef
from sluice.errors import InvalidInput

__all__ = ["as_tools", "is_legacy", "renamed"]

NAMES = {"tools": "functions", "tool_choice": "function_call", "parallel_tool_calls": "function_call"}
"""The fields that errors about the tools name, as a legacy request calls them."""


def is_legacy(request: ChatRequest) -> bool:
    """The request calls functions the legacy way (and is answered the legacy way)."""
    return request.functions is not None or request.function_call is not None or any(
        m.role == "function" or m.function_call is not None for m in request.messages)


def as_tools(request: ChatRequest) -> ChatRequest:
    """The request with its legacy function calling as tools (see the module's docstring)."""
    if not is_legacy(request):
        return request
    if request.tools is not None or request.tool_choice is not None:
        raise InvalidInput("send 'tools' or the legacy 'functions', not both", param="functions")
    choice = request.function_call
    if choice is not None and not request.functions and choice != "none":
        raise InvalidInput("'function_call' needs 'functions'", param="function_call")
    if isinstance(choice, str) and choice not in ("none", "auto"):
        raise InvalidInput("'function_call' must be 'none', 'auto' or {\"name\": ...}", param="function_call")
    tool_choice = NamedToolChoice("function", choice) if choice is not None and not isinstance(choice, str) \
        else choice
    tools = [ToolDef("function", function) for function in request.functions] if request.functions else None
    return msgspec.structs.replace(request, messages=_messages(request.messages), functions=None,
                                   function_call=None, tools=tools, tool_choice=tool_choice,
                                   parallel_tool_calls=False)


def _messages(messages: list[ChatMessageIn]) -> list[ChatMessageIn]:
    """Earlier legacy calls as tool calls, each with an id, and each function's answer as the
    answer to its name's latest call."""
    out: list[ChatMessageIn] = []
    call_ids: dict[str, str] = {}
    for message in messages:
        if message.function_call is not None:
            if message.role != "assistant" or message.tool_calls:
                raise InvalidInput("only an assistant message without 'tool_calls' carries a 'function_call'",
                                   param="messages")
            call_id = call_ids[message.function_call.name] = f"call_legacy_{len(out)}"
            message = msgspec.structs.replace(message, function_call=None,
                                              tool_calls=[ToolCallIn(call_id, message.function_call)])
        elif message.role == "function":
            if message.name is None or message.name not in call_ids:
                raise InvalidInput("a 'function' message needs the 'name' of a function called before it",
                                   param="messages")
            message = ChatMessageIn("tool", message.content, tool_call_id=call_ids[message.name])
        out.append(message)
    return out


def renamed(exc: InvalidInput) -> InvalidInput:
    """An error about the tools, naming the legacy request's fields."""
    if exc.param not in NAMES:
        return exc
    message = exc.message
    for name, legacy in NAMES.items():
        message = message.replace(f"'{name}'", f"'{legacy}'").replace(f"{name} '", f"{legacy} '")
    for words, legacy in (("tool names must", "names in 'functions' must"), ("no tool given", "no function given"),
                          ("'required' or a named function", "a named function")):
        message = message.replace(words, legacy)
    return InvalidInput(message, param=NAMES[exc.param])
