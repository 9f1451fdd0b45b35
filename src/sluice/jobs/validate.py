"""An input file, checked whole before any item runs: items, or every problem with its line number.

Each line is `{"custom_id": str, "method": "POST", "url": str, "body": {...}}`. The url must be
the batch's endpoint; for the KServe endpoint `/v2/infer`, any `/v2/models/<model>/infer` (or
`.../versions/<v>/infer`) url. `custom_id`s must be non-empty and unique in the file. The body
must be an object naming its model (`"model"`, a string; KServe: the url's model, and an
`"inputs"` list), not asking to be streamed (an item's answer is one JSON body in the output
file, not Server-Sent Events), and with `models` given, a model the tenant may use on this server:
a file that would fail item by item fails here, whole, before any item runs. A model that exists
but is not up yet (loading, its worker being restarted) is one it may use: `ModelDirectory` says
which the names missing from the listing are, and its items wait for it once the batch runs. The
body's other fields are left to the endpoint. A body is kept as the raw bytes it was sent with
(never re-encoded), and the file is parsed here (again, with the models found known, when it names
models that are not listed).
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

from sluice.jobs.store import NewItem

__all__ = ["ENDPOINTS", "MAX_ITEMS", "Invalid", "ModelDirectory", "Valid", "item_model", "parse_input"]

ENDPOINTS = ("/v1/embeddings", "/v1/completions", "/v1/chat/completions", "/v1/responses", "/v2/infer")
MAX_ITEMS = 200_000
MAX_ERRORS = 100
_UTF8_BOM = b"\xef\xbb\xbf"
_KSERVE_URL = re.compile(r"^/v2/models/([^/?#]+)(/versions/[^/?#]+)?/infer$")


class _Line(msgspec.Struct, forbid_unknown_fields=False):
    custom_id: str
    method: str
    url: str
    body: msgspec.Raw


class _OpenAIBody(msgspec.Struct, forbid_unknown_fields=False):
    model: Any = None
    stream: Any = None


class _KServeBody(msgspec.Struct, forbid_unknown_fields=False):
    inputs: Any = None


class ModelDirectory(Protocol):
    """The models a batch's tenant (its owner) may use, as the server says when it is validated."""

    async def listed(self, owner: str) -> frozenset[str]:
        """The models listed for the tenant: served now, or loaded on demand by a first request."""

    async def is_known(self, owner: str, model: str) -> bool:
        """Whether the tenant may use `model`, which is not listed: a version of a listed one
        (`"m:2"`), or a model that is not up yet (loading, its worker being restarted); not one
        the server does not have, nor one the tenant may not use."""


@dataclass(frozen=True, slots=True)
class Valid:
    items: list[NewItem]


@dataclass(frozen=True, slots=True)
class Invalid:
    errors: list[dict[str, object]]
    """`{"code", "message", "param", "line"}`, at most `MAX_ERRORS` of them, first lines first."""
    unknown_models: frozenset[str] = frozenset()
    """The model names of its `model_not_found` errors."""


def parse_input(content: bytes, endpoint: str, models: Collection[str] | None = None) -> Valid | Invalid:
    """The file's items, or its problems. `models`: the model names the batch's tenant may use (None:
    names are not checked, as when a validated file is read again)."""
    items: list[NewItem] = []
    errors: list[dict[str, object]] = []
    checker = _Checker(endpoint, models)
    line_no = 0
    content = content.removeprefix(_UTF8_BOM)  # as editors on Windows save a file: not part of line 1
    for line_no, raw in enumerate(content.splitlines(), start=1):
        if not raw.strip():
            continue
        problem = checker.check(raw, items)
        if problem is not None:
            code, message, param = problem
            errors.append({"code": code, "message": message, "param": param, "line": line_no})
            if len(errors) >= MAX_ERRORS:
                break
    if not items and not errors:
        errors.append({"code": "empty_file", "message": "the input file has no requests", "param": None,
                       "line": None})
    if len(items) > MAX_ITEMS:
        errors.append({"code": "too_many_requests", "message": f"a batch may hold at most {MAX_ITEMS} requests",
                       "param": None, "line": line_no})
    return Invalid(errors, frozenset(checker.unknown_models)) if errors else Valid(items)


def item_model(url: str, body: bytes) -> str:
    """The model a stored item asks for (its KServe url's, else its body's `model`); "" if unreadable."""
    url_match = _KSERVE_URL.match(url)
    if url_match:
        return url_match.group(1)
    try:
        model = msgspec.json.decode(body, type=_OpenAIBody).model
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError, UnicodeDecodeError):
        return ""
    return model if isinstance(model, str) else ""


Problem = tuple[str, str, str | None]
"""(code, message, param) of one line's problem."""


class _Checker:
    def __init__(self, endpoint: str, models: Collection[str] | None) -> None:
        self._endpoint = endpoint
        self._models = models
        self._is_kserve = endpoint == "/v2/infer"
        self._decode_line = msgspec.json.Decoder(_Line).decode
        decoder: msgspec.json.Decoder[_KServeBody | _OpenAIBody] = msgspec.json.Decoder(
            _KServeBody if self._is_kserve else _OpenAIBody)
        self._decode_body = decoder.decode
        self._seen: set[str] = set()
        self.unknown_models: set[str] = set()

    def check(self, raw: bytes, items: list[NewItem]) -> Problem | None:
        """None and the line appended to `items` when it is good; else its problem."""
        try:
            line = self._decode_line(raw)
        except msgspec.ValidationError as exc:
            return "invalid_request", f"invalid request line: {exc}", None
        except msgspec.DecodeError as exc:
            return "invalid_json", f"not a JSON object: {exc}", None
        except RecursionError:
            return "invalid_json", "not a JSON object: it is nested too deeply", None
        except UnicodeDecodeError as exc:
            return "invalid_json", f"not a JSON object: a string holds bytes that are not UTF-8 ({exc.reason})", None
        if not line.custom_id:
            return "invalid_custom_id", "custom_id must be a non-empty string", "custom_id"
        if line.method.upper() != "POST":
            return "invalid_method", f"method must be POST, got {line.method[:16]!r}", "method"
        url_match = _KSERVE_URL.match(line.url) if self._is_kserve else None
        if not (url_match if self._is_kserve else line.url == self._endpoint):
            return "invalid_url", f"url {line.url[:100]!r} does not match the batch's endpoint {self._endpoint}", "url"
        if line.custom_id in self._seen:
            return "duplicate_custom_id", f"custom_id {line.custom_id[:100]!r} appears more than once", "custom_id"
        self._seen.add(line.custom_id)
        body = bytes(line.body)
        problem = self._check_body(body, url_match.group(1) if url_match else None)
        if problem is not None:
            return problem
        items.append(NewItem(len(items), line.custom_id, line.url, body))
        return None

    def _check_body(self, body: bytes, url_model: str | None) -> Problem | None:
        try:
            decoded = self._decode_body(body)
        except (msgspec.ValidationError, msgspec.DecodeError, RecursionError, UnicodeDecodeError):
            return "invalid_body", "body must be a JSON object", "body"
        if isinstance(decoded, _KServeBody):
            if not isinstance(decoded.inputs, list):
                return "invalid_body", "body must have an 'inputs' list", "body.inputs"
            model = url_model or ""
        else:
            if decoded.model is None:
                return "missing_model", "body must name its 'model'", "body.model"
            if not isinstance(decoded.model, str) or not decoded.model:
                return "invalid_model", "body's 'model' must be a non-empty string", "body.model"
            model = decoded.model
            if decoded.stream is True:
                return ("invalid_body", "a batch item is answered whole, in the output file: 'stream' must be false "
                        "or left out", "body.stream")
        if self._models is not None and model not in self._models:
            self.unknown_models.add(model)
            return ("model_not_found", f"the model {model[:100]!r} does not exist or you do not have access to it",
                    "url" if url_model is not None else "body.model")
        return None
