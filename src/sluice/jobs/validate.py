"""An input file, checked whole before any item runs: items, or every problem with its line number.

Each line is `{"custom_id": str, "method": "POST", "url": str, "body": {...}}`. The url must be
the batch's endpoint; for the KServe endpoint `/v2/infer`, any `/v2/models/<model>/infer` (or
`.../versions/<v>/infer`) url. `custom_id`s must be unique in the file. A body is kept as the
raw bytes it was sent with (never re-encoded), and the file is parsed once, here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import msgspec

from sluice.jobs.store import NewItem

__all__ = ["ENDPOINTS", "MAX_ITEMS", "Invalid", "Valid", "parse_input"]

ENDPOINTS = ("/v1/embeddings", "/v1/completions", "/v1/chat/completions", "/v2/infer")
MAX_ITEMS = 200_000
MAX_ERRORS = 100
_KSERVE_URL = re.compile(r"^/v2/models/[^/?#]+(/versions/[^/?#]+)?/infer$")


class _Line(msgspec.Struct, forbid_unknown_fields=False):
    custom_id: str
    method: str
    url: str
    body: msgspec.Raw


@dataclass(frozen=True, slots=True)
class Valid:
    items: list[NewItem]


@dataclass(frozen=True, slots=True)
class Invalid:
    errors: list[dict[str, object]]
    """`{"code", "message", "param", "line"}`, at most `MAX_ERRORS` of them, first lines first."""


def url_matches(endpoint: str, url: str) -> bool:
    if endpoint == "/v2/infer":
        return bool(_KSERVE_URL.match(url))
    return url == endpoint


def parse_input(content: bytes, endpoint: str) -> Valid | Invalid:
    items: list[NewItem] = []
    errors: list[dict[str, object]] = []
    seen: set[str] = set()
    decoder = msgspec.json.Decoder(_Line)
    line_no = 0
    for line_no, raw in enumerate(content.splitlines(), start=1):
        if not raw.strip():
            continue
        problem = _check(decoder, raw, endpoint, seen, items)
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
    return Invalid(errors) if errors else Valid(items)


def _check(decoder: msgspec.json.Decoder[_Line], raw: bytes, endpoint: str, seen: set[str],
           items: list[NewItem]) -> tuple[str, str, str | None] | None:
    try:
        line = decoder.decode(raw)
    except msgspec.ValidationError as exc:
        return "invalid_request", f"invalid request line: {exc}", None
    except msgspec.DecodeError as exc:
        return "invalid_json", f"not a JSON object: {exc}", None
    if line.method.upper() != "POST":
        return "invalid_method", f"method must be POST, got {line.method[:16]!r}", "method"
    if not url_matches(endpoint, line.url):
        return "invalid_url", f"url {line.url[:100]!r} does not match the batch's endpoint {endpoint}", "url"
    body = bytes(line.body)
    if not body.startswith(b"{"):
        return "invalid_body", "body must be a JSON object", "body"
    if line.custom_id in seen:
        return "duplicate_custom_id", f"custom_id {line.custom_id[:100]!r} appears more than once", "custom_id"
    seen.add(line.custom_id)
    items.append(NewItem(len(items), line.custom_id, line.url, body))
    return None
