"""OpenAI's Conversations API: `/v1/conversations` and its items.

    POST   /v1/conversations                          {items?, metadata?}  -> the conversation
    GET    /v1/conversations/{id}                                          -> the conversation
    POST   /v1/conversations/{id}                     {metadata}           -> the conversation
    DELETE /v1/conversations/{id}                                          -> {deleted: true}
    POST   /v1/conversations/{id}/items               {items}              -> a list of the items added
    GET    /v1/conversations/{id}/items               ?after&limit&order   -> a page of its items
    GET    /v1/conversations/{id}/items/{item_id}                          -> the item
    DELETE /v1/conversations/{id}/items/{item_id}                          -> the conversation

A conversation is kept in the job store (SQLite embedded, PostgreSQL shared by a cluster's
gateways) for the tenant that made it, until it is deleted; another tenant's is not found. Its
items are what a Responses request takes as `input` (messages, function calls and their
outputs), each given an id and a status, a message's text as parts (`input_text`, or
`output_text` for the assistant's), in the order they were added by any gateway.

A Responses request with `conversation` (its id, or `{"id": ...}`) answers after the
conversation's items, and then adds its own input and its output to them (`api.responses`).
"""

from __future__ import annotations

import contextlib
import time
import uuid
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from sluice.api.common import (
    decode_json,
    items_page,
    json_response,
    list_response,
    read_body,
    request_tenant,
)
from sluice.api.completion_params import check_metadata
from sluice.errors import InvalidInput, NotFound
from sluice.jobs.store import JobStore

MAX_ITEMS_PER_CALL = 20
"""Items one create or add call may carry (OpenAI's bound)."""
MAX_ITEMS_PAGE = 100
NOT_STORED = "conversations are not stored by this server (it has no job store): send the items in 'input' instead"
_INPUT_ROLES = ("user", "system", "developer")
_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


class ConversationCreate(msgspec.Struct, kw_only=True):
    items: list[Any] | None = None
    metadata: dict[str, str] | None = None


class ConversationUpdate(msgspec.Struct, kw_only=True):
    metadata: dict[str, str]


class ItemsCreate(msgspec.Struct, kw_only=True):
    items: list[Any]


def conversation_items(given: list[Any], param: str = "items") -> list[dict[str, Any]]:
    """Items as a conversation keeps them (see the module's docstring); a 400 naming `param` for
    one that is not a message, a function call, a function call's output or reasoning passed back."""
    return [_item(item, param) for item in given]


def refuse_duplicate_ids(earlier: list[Any], given: list[Any], param: str) -> None:
    """A 400 naming `param`, as OpenAI's, if an item of `given` repeats the id of another of them or
    of one `earlier` (a conversation's items, a previous response's chain): a client passing back
    items the server already holds would otherwise have them read, listed and deleted twice."""
    seen = {item.get("id") for item in earlier if isinstance(item, dict)}
    for item in given:
        item_id = item.get("id") if isinstance(item, dict) else None
        if isinstance(item_id, str):
            if item_id in seen:
                raise InvalidInput(f"Duplicate item found with id {item_id[:128]}. Remove duplicate items from your "
                                   "input and try again.", param=param)
            seen.add(item_id)


def new_item_id(kind: Any) -> str:
    """A fresh id for an item of this `type`, prefixed as OpenAI's are (`msg_`, `fc_`, ...)."""
    prefix = _ID_PREFIXES.get(kind, "msg") if isinstance(kind, str) else "msg"
    return f"{prefix}_{uuid.uuid4().hex}"


def _item(item: Any, param: str) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise InvalidInput("each item must be an object", param=param)
    kind = item.get("type", "message")
    if not isinstance(kind, str) or kind not in _ID_PREFIXES:
        raise InvalidInput(f"items of type {str(kind)[:40]!r} are not supported (message, function_call, "
                           "function_call_output and reasoning are)", param=param)
    item_id = item.get("id") or new_item_id(kind)
    if not isinstance(item_id, str) or len(item_id) > 128:
        raise InvalidInput("an item's 'id' must be a string of up to 128 characters", param=param)
    if kind == "message":
        role = item.get("role")
        if role not in (*_INPUT_ROLES, "assistant"):
            raise InvalidInput(f"a message's role must be user, system, developer or assistant, got "
                               f"{str(role)[:40]!r}", param=param)
        return {"type": "message", "id": item_id, "status": "completed", "role": role,
                "content": _parts(item.get("content"), _part_type(role), param)}
    if kind == "reasoning":  # an earlier response's, passed back: kept, and skipped as input (`api.responses`)
        return {**item, "id": item_id}
    for key in ("call_id", "name", "arguments") if kind == "function_call" else ("call_id",):
        if not isinstance(item.get(key), str):
            raise InvalidInput(f"a {kind} item needs its '{key}' (a string)", param=param)
    if kind == "function_call_output" and not isinstance(item.get("output"), str | list):
        raise InvalidInput("a function_call_output item needs its 'output' (a string or text parts)", param=param)
    return {**item, "type": kind, "id": item_id, "status": item.get("status") or "completed"}


def listed_item(item: Any) -> Any:
    """A response's input item as `GET .../input_items` lists it, as OpenAI lists it: with its
    `type` and `status`, and a message's text as parts (input_text, an assistant's output_text)."""
    if not isinstance(item, dict):
        return item
    listed = {"type": "message", "status": "completed", **item}
    if listed["type"] == "message" and isinstance(item.get("content"), str | list):
        with contextlib.suppress(InvalidInput):  # (what the request was answered with: text parts)
            listed["content"] = _parts(item["content"], _part_type(item.get("role")), "input")
    return listed


def _parts(content: Any, part: str, param: str) -> list[dict[str, Any]]:
    """A message's content as text parts."""
    if isinstance(content, str):
        return [_part({"type": part, "text": content})]
    if isinstance(content, list) and content and all(
            isinstance(p, dict) and p.get("type") in ("input_text", "output_text", "text")
            and isinstance(p.get("text"), str) for p in content):
        return [_part({**p, "type": part if p["type"] == "text" else p["type"]}) for p in content]
    raise InvalidInput("a message's 'content' must be a string or a list of text parts (input_text): image, file "
                       "and audio inputs are not supported", param=param)


def _part_type(role: Any) -> str:
    """The type of a message's text parts: an assistant's are output, the others' input."""
    return "output_text" if role == "assistant" else "input_text"


def _part(part: dict[str, Any]) -> dict[str, Any]:
    """A text part as OpenAI lists it: an output_text part has its annotations and log-probabilities."""
    return {"annotations": [], "logprobs": [], **part} if part["type"] == "output_text" else part


class Conversations:
    """The tenants' conversations in the job store."""

    def __init__(self, store: JobStore | None) -> None:
        self.store = store

    def store_or_refuse(self, param: str | None = None) -> JobStore:
        """The store; a 400 (naming `param`) on a server that has none."""
        if self.store is None:
            raise InvalidInput(NOT_STORED, param=param)
        return self.store

    async def items_of(self, owner: str, conversation_id: str, param: str | None = None) -> list[dict[str, Any]]:
        """Its items, oldest first; a 404 (naming `param`) if `owner` has no such conversation."""
        found = await self.store_or_refuse(param).get_conversation(owner, conversation_id, with_items=True)
        if found is None:
            raise _not_found(conversation_id, param)
        return [msgspec.json.decode(item) for item in found.items]

    async def append(self, owner: str, conversation_id: str, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Add `items` (as `conversation_items` makes them) after its last ones."""
        if not await self.store_or_refuse().add_conversation_items(owner, conversation_id, _encoded(items)):
            raise _not_found(conversation_id, None)
        return items

    async def get(self, owner: str, conversation_id: str) -> dict[str, Any]:
        found = await self.store_or_refuse().get_conversation(owner, conversation_id)
        if found is None:
            raise _not_found(conversation_id, None)
        return _conversation(conversation_id, found.created_at, msgspec.json.decode(found.metadata))


def routes(store: JobStore | None, body_limit_bytes: int) -> list[Route]:
    conversations = Conversations(store)

    async def create(request: Request) -> Response:
        given = decode_json(await read_body(request, body_limit_bytes), ConversationCreate)
        check_metadata(given.metadata)
        items = conversation_items(_bounded(given.items or []))
        refuse_duplicate_ids([], items, "items")
        conversation = _conversation(f"conv_{uuid.uuid4().hex}", int(time.time()), given.metadata or {})
        await conversations.store_or_refuse().create_conversation(
            request_tenant(request), conversation["id"], conversation["created_at"],
            msgspec.json.encode(conversation["metadata"]), _encoded(items))
        return json_response(conversation)

    async def retrieve(request: Request) -> Response:
        return json_response(await conversations.get(request_tenant(request), request.path_params["conversation_id"]))

    async def update(request: Request) -> Response:
        given = decode_json(await read_body(request, body_limit_bytes), ConversationUpdate)
        check_metadata(given.metadata)
        owner, conversation_id = request_tenant(request), request.path_params["conversation_id"]
        if not await conversations.store_or_refuse().update_conversation(owner, conversation_id,
                                                                 msgspec.json.encode(given.metadata)):
            raise _not_found(conversation_id, None)
        return json_response(await conversations.get(owner, conversation_id))

    async def delete(request: Request) -> Response:
        conversation_id = request.path_params["conversation_id"]
        if not await conversations.store_or_refuse().delete_conversation(request_tenant(request), conversation_id):
            raise _not_found(conversation_id, None)
        return json_response({"id": conversation_id, "object": "conversation.deleted", "deleted": True})

    async def add_items(request: Request) -> Response:
        given = decode_json(await read_body(request, body_limit_bytes), ItemsCreate)
        items = conversation_items(_bounded(given.items))
        owner, conversation_id = request_tenant(request), request.path_params["conversation_id"]
        refuse_duplicate_ids(await conversations.items_of(owner, conversation_id), items, "items")
        added = await conversations.append(owner, conversation_id, items)
        return list_response(added, False)

    async def list_items(request: Request) -> Response:
        items = await conversations.items_of(request_tenant(request), request.path_params["conversation_id"])
        return items_page(items, request.query_params, MAX_ITEMS_PAGE, "item", "this conversation")

    async def retrieve_item(request: Request) -> Response:
        item_id = request.path_params["item_id"]
        items = await conversations.items_of(request_tenant(request), request.path_params["conversation_id"])
        found = next((item for item in items if item.get("id") == item_id), None)
        if found is None:
            raise NotFound(f"no item {item_id[:80]!r} in this conversation")
        return json_response(found)

    async def delete_item(request: Request) -> Response:
        owner, conversation_id = request_tenant(request), request.path_params["conversation_id"]
        item_id = request.path_params["item_id"]
        if not await conversations.store_or_refuse().delete_conversation_item(owner, conversation_id, item_id):
            await conversations.get(owner, conversation_id)  # a 404 for the conversation itself first
            raise NotFound(f"no item {item_id[:80]!r} in this conversation")
        return json_response(await conversations.get(owner, conversation_id))

    return [
        Route("/v1/conversations", create, methods=["POST"]),
        Route("/v1/conversations/{conversation_id}", retrieve, methods=["GET"]),
        Route("/v1/conversations/{conversation_id}", update, methods=["POST"]),
        Route("/v1/conversations/{conversation_id}", delete, methods=["DELETE"]),
        Route("/v1/conversations/{conversation_id}/items", add_items, methods=["POST"]),
        Route("/v1/conversations/{conversation_id}/items", list_items, methods=["GET"]),
        Route("/v1/conversations/{conversation_id}/items/{item_id}", retrieve_item, methods=["GET"]),
        Route("/v1/conversations/{conversation_id}/items/{item_id}", delete_item, methods=["DELETE"]),
    ]


def _bounded(items: list[Any]) -> list[Any]:
    if len(items) > MAX_ITEMS_PER_CALL:
        raise InvalidInput(f"at most {MAX_ITEMS_PER_CALL} items can be added at once, got {len(items)}",
                           param="items")
    return items


def _encoded(items: list[dict[str, Any]]) -> list[tuple[str, bytes]]:
    return [(item["id"], msgspec.json.encode(item)) for item in items]


def _conversation(conversation_id: str, created_at: int, metadata: dict[str, str]) -> dict[str, Any]:
    return {"id": conversation_id, "object": "conversation", "created_at": created_at, "metadata": metadata}


def _not_found(conversation_id: str, param: str | None) -> NotFound:
    return NotFound(f"no conversation {conversation_id[:80]!r} (it was deleted, or is another tenant's)",
                    param=param)
