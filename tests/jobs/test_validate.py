"""Input-file validation: every problem reported with its line number, nothing half-accepted."""

from __future__ import annotations

import json

from sluice.jobs.validate import Invalid, Valid, parse_input


def test_valid_file_keeps_raw_bodies_and_skips_blank_lines():
    content = (b'{"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": {"model": "m", "input": "x"}}'
               b'\n\n'
               b'{"custom_id": "b", "method": "post", "url": "/v1/embeddings", "body": {"model": "m", "input": "y"}}\n')
    parsed = parse_input(content, "/v1/embeddings", {"m"})
    assert isinstance(parsed, Valid)
    assert [(i.idx, i.custom_id, i.body) for i in parsed.items] == [
        (0, "a", b'{"model": "m", "input": "x"}'), (1, "b", b'{"model": "m", "input": "y"}')]


def test_kserve_endpoint_accepts_any_model_url():
    line = b'{"custom_id": "a", "method": "POST", "url": "/v2/models/m/versions/2/infer", "body": {"inputs": []}}'
    assert isinstance(parse_input(line, "/v2/infer"), Valid)
    assert isinstance(parse_input(line, "/v2/infer", {"m"}), Valid)
    assert isinstance(parse_input(line.replace(b"/infer", b"/ready"), "/v2/infer"), Invalid)


def test_a_leading_utf8_byte_order_mark_is_not_part_of_the_first_line():
    """Seen: a file saved with a BOM (Notepad, Excel's "CSV UTF-8") failed at line 1 with
    'invalid_json: JSON is malformed: invalid character (byte 0)'."""
    content = ('\ufeff{"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": {"model": "m"}}\n'
               '{"custom_id": "b", "method": "POST", "url": "/v1/embeddings", "body": {"model": "m"}}\n').encode()
    parsed = parse_input(content, "/v1/embeddings", {"m"})
    assert isinstance(parsed, Valid) and [i.custom_id for i in parsed.items] == ["a", "b"]


def test_errors_carry_line_numbers():
    content = (b'{"custom_id": "a", "method": "GET", "url": "/v1/embeddings", "body": {}}\n'
               b'{"custom_id": "b", "method": "POST", "url": "/v1/embeddings", "body": [1]}\n'
               b'{"method": "POST", "url": "/v1/embeddings", "body": {}}\n')
    parsed = parse_input(content, "/v1/embeddings")
    assert isinstance(parsed, Invalid)
    assert [(e["line"], e["code"]) for e in parsed.errors] == [(1, "invalid_method"), (2, "invalid_body"),
                                                               (3, "invalid_request")]
    assert isinstance(parse_input(b"\n\n", "/v1/embeddings"), Invalid)


def _file(*bodies_and_ids: tuple[str, object], url: str = "/v1/chat/completions") -> bytes:
    return b"".join(json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body}).encode() + b"\n"
                    for custom_id, body in bodies_and_ids)


def test_bodies_that_would_fail_item_by_item_fail_the_file_at_validation():
    """Each of these passed validation before, then failed (or half-ran) when its item was executed."""
    good = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    content = _file(("ok", good), ("empty-body", {}), ("no-model", {"messages": []}), ("", good),
                    ("number-model", {"model": 3}), ("unknown", {"model": "nope"}), ("not-allowed", {"model": "big"}),
                    ("string-body", "hello"), ("null-body", None))
    parsed = parse_input(content, "/v1/chat/completions", {"tiny"})
    assert isinstance(parsed, Invalid)
    assert [(e["line"], e["code"], e["param"]) for e in parsed.errors] == [
        (2, "missing_model", "body.model"), (3, "missing_model", "body.model"), (4, "invalid_custom_id", "custom_id"),
        (5, "invalid_model", "body.model"), (6, "model_not_found", "body.model"),
        (7, "model_not_found", "body.model"), (8, "invalid_body", "body"), (9, "invalid_body", "body")]
    assert "'nope' does not exist or you do not have access to it" in str(parsed.errors[4]["message"])


def test_a_streamed_body_fails_the_file_at_validation():
    """`"stream": true` used to run: its answer went into the output file as one JSON string of
    Server-Sent Events, where a client reading `response.body` expects the JSON object."""
    good = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    content = _file(("ok", good), ("unstreamed", {**good, "stream": False}), ("streamed", {**good, "stream": True}),
                    ("with-usage", {**good, "stream": True, "stream_options": {"include_usage": True}}))
    parsed = parse_input(content, "/v1/chat/completions", {"tiny"})
    assert isinstance(parsed, Invalid)
    assert [(e["line"], e["code"], e["param"]) for e in parsed.errors] == [
        (3, "invalid_body", "body.stream"), (4, "invalid_body", "body.stream")]
    assert isinstance(parse_input(_file(("a", {"model": "tiny", "prompt": "x", "stream": True}), url="/v1/completions"),
                                  "/v1/completions"), Invalid)


def test_kserve_lines_name_a_served_model_and_carry_inputs():
    content = _file(("ok", {"inputs": []}), ("no-inputs", {}), url="/v2/models/m/infer") + _file(
        ("unknown", {"inputs": []}), url="/v2/models/nope/infer")
    parsed = parse_input(content, "/v2/infer", {"m"})
    assert isinstance(parsed, Invalid)
    assert [(e["line"], e["code"], e["param"]) for e in parsed.errors] == [
        (2, "invalid_body", "body.inputs"), (3, "model_not_found", "url")]


def test_unreadable_lines_are_line_errors_not_crashes():
    deep = b"[" * 5000 + b"]" * 5000
    content = (b'{"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": ' + deep + b'}\n'
               b'{"custom_id": "b\xff", "method": "POST", "url": "/v1/embeddings", "body": {}}\n'
               b'{"custom_id": "c", "method": "POST", "url": "/v1/embeddings", "body": {"model": "m\xfe"}}\n')
    parsed = parse_input(content, "/v1/embeddings", {"m"})
    assert isinstance(parsed, Invalid)
    assert [(e["line"], e["code"]) for e in parsed.errors] == [(1, "invalid_json"), (2, "invalid_json"),
                                                               (3, "invalid_body")]
